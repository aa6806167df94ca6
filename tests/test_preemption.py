"""PreemptionCallback and notice pollers: real signals, real local HTTP metadata servers, real Trainer runs."""

from __future__ import annotations

import calendar
import csv
import http.server
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_bamboo.callbacks.notices import (
    AwsSpotPoller,
    AzureScheduledEventsPoller,
    GcpPreemptionPoller,
    Notice,
    NoticeSourceError,
    NoticeWatcher,
)
from lightning_bamboo.callbacks.preemption import PreemptionCallback, preemption_pending
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.runtime.leave import LEAVE

pytestmark = pytest.mark.timeout(150)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_callback_left_active() -> Iterator[None]:
    yield
    assert LEAVE.attached == ()  # every callback a test started was stopped (teardown ran)


# --------------------------------------------------------------------------- a local metadata server
@dataclass
class Route:
    status: int
    body: str
    method: str = "GET"
    need_header: tuple[str, str] | None = None  # answered 403 without it, like the real services


@dataclass
class MetadataServer:
    """A loopback HTTP server whose answers the test changes while it runs; records every request."""

    routes: dict[str, Route] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    url: str = ""

    def answer(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        self.requests.append((method, path, headers))
        route = self.routes.get(path)
        if route is None or route.method != method:
            return 404, "not found"
        if route.need_header and headers.get(route.need_header[0].lower()) != route.need_header[1]:
            return 403, "missing header"
        return route.status, route.body


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    state = MetadataServer()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self) -> None:
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, body = state.answer(self.command, self.path, headers)
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = _reply

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens: connection refused at once


AWS_ACTION = "/latest/meta-data/spot/instance-action"
AWS_TOKEN = "/latest/api/token"
GCP_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
AZURE_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"


def aws_notice_body(deadline: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))
    return json.dumps({"action": "terminate", "time": stamp})


# --------------------------------------------------------------------------- signals
@pytest.fixture
def restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_signal_sets_flag_chains_previous_and_restores(restore_signals: None) -> None:
    seen: list[int] = []

    def previous(signum: int, frame: object) -> None:
        seen.append(signum)

    signal.signal(signal.SIGUSR1, previous)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cb = PreemptionCallback(signals=["SIGTERM", "SIGUSR1"], grace_period=40.0)
    cb._start()
    assert cb.install_signal_handlers()
    assert signal.getsignal(signal.SIGUSR1) is not previous
    assert not preemption_pending()

    before = time.time()
    os.kill(os.getpid(), signal.SIGUSR1)  # handlers run on the main thread before kill() returns to Python
    assert seen == [signal.SIGUSR1]
    assert preemption_pending() and cb.preemption_pending()
    assert cb.notice is not None and cb.notice.source == "signal:SIGUSR1"
    assert before + 40.0 <= cb.notice.deadline <= time.time() + 40.0

    # SIGTERM's previous disposition is SIG_DFL (terminate): taken over, not invoked; first notice wins.
    os.kill(os.getpid(), signal.SIGTERM)
    assert cb.notice.source == "signal:SIGUSR1"

    cb._stop()
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert not preemption_pending()  # a stopped callback no longer answers for the process


def test_restore_leaves_a_handler_installed_on_top(restore_signals: None) -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    cb = PreemptionCallback(signals=[signal.SIGUSR2])
    cb.install_signal_handlers()

    def later(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGUSR2, later)  # someone else took over after us
    cb.restore_signal_handlers()
    assert signal.getsignal(signal.SIGUSR2) is later


def test_install_off_the_main_thread_warns_and_changes_nothing(
    restore_signals: None, caplog: pytest.LogCaptureFixture
) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    cb = PreemptionCallback(signals=["SIGUSR1"])
    result: list[bool] = []
    with caplog.at_level(logging.WARNING, logger="lightning_bamboo"):
        t = threading.Thread(target=lambda: result.append(cb.install_signal_handlers()))
        t.start()
        t.join(10)
    assert result == [False]
    assert signal.getsignal(signal.SIGUSR1) is before
    assert "only lets the main thread install signal handlers" in caplog.text
    cb.notify(Notice("supervisor"))  # the documented way in from another thread
    assert cb.preemption_pending()


# --------------------------------------------------------------------------- pollers, one per cloud
def test_aws_imdsv2_notice_has_the_metadata_deadline(server: MetadataServer) -> None:
    deadline = float(int(time.time()) + 120)
    server.routes[AWS_TOKEN] = Route(200, "tok-123", method="PUT")
    server.routes[AWS_ACTION] = Route(
        200, aws_notice_body(deadline), need_header=("X-aws-ec2-metadata-token", "tok-123")
    )
    notice = AwsSpotPoller(endpoint=server.url).poll()
    assert notice == Notice("aws", deadline, notice.detail)
    assert notice.detail.startswith("terminate")
    methods = [(m, p) for m, p, _ in server.requests]
    assert methods == [("PUT", AWS_TOKEN), ("GET", AWS_ACTION)]
    assert server.requests[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"


def test_aws_falls_back_to_imdsv1_and_404_is_no_notice(server: MetadataServer) -> None:
    poller = AwsSpotPoller(endpoint=server.url)
    server.routes[AWS_TOKEN] = Route(403, "forbidden", method="PUT")  # IMDSv2 unavailable
    assert poller.poll() is None  # no instance-action route: 404
    deadline = float(int(time.time()) + 90)
    server.routes[AWS_ACTION] = Route(200, aws_notice_body(deadline))
    notice = poller.poll()
    assert notice is not None and notice.deadline == deadline
    assert "x-aws-ec2-metadata-token" not in server.requests[-1][2]


def test_gcp_true_is_a_notice_false_is_none(server: MetadataServer) -> None:
    poller = GcpPreemptionPoller(endpoint=server.url)
    server.routes[GCP_PATH] = Route(200, "FALSE", need_header=("Metadata-Flavor", "Google"))
    assert poller.poll() is None
    server.routes[GCP_PATH] = Route(200, "TRUE", need_header=("Metadata-Flavor", "Google"))
    notice = poller.poll()
    assert notice is not None and notice.source == "gcp" and notice.deadline is None

    cb = PreemptionCallback(grace_period=30.0)
    before = time.time()
    cb.notify(notice)  # no deadline from GCP: the callback's grace period applies
    assert before + 30.0 <= cb.notice.deadline <= time.time() + 30.0


def azure_events(*events: dict) -> str:
    return json.dumps({"DocumentIncarnation": 2, "Events": list(events)})


def preempt_event(resources: list[str], not_before: str, event_id: str = "E1") -> dict:
    return {
        "EventId": event_id,
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": resources,
        "EventStatus": "Scheduled",
        "NotBefore": not_before,
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


def test_azure_preempt_for_this_vm_is_a_notice_due_at_not_before(server: MetadataServer) -> None:
    header = ("Metadata", "true")
    server.routes[AZURE_NAME] = Route(200, "vm-7", need_header=header)
    server.routes[AZURE_EVENTS] = Route(200, azure_events(), need_header=header)
    poller = AzureScheduledEventsPoller(endpoint=server.url)
    assert poller.poll() is None  # no events

    reboot = dict(preempt_event(["vm-7"], "Mon, 19 Sep 2016 18:00:00 GMT"), EventType="Reboot")
    other = preempt_event(["vm-3"], "Mon, 19 Sep 2016 18:29:47 GMT", "E2")
    server.routes[AZURE_EVENTS] = Route(200, azure_events(reboot, other), need_header=header)
    assert poller.poll() is None  # a reboot, and another VM's eviction
    assert poller.vm_name == "vm-7"

    mine = preempt_event(["vm-3", "vm-7"], "Mon, 19 Sep 2016 18:29:47 GMT", "E3")
    server.routes[AZURE_EVENTS] = Route(200, azure_events(reboot, mine), need_header=header)
    notice = poller.poll()
    assert notice is not None and notice.source == "azure" and "E3" in notice.detail
    assert notice.deadline == calendar.timegm((2016, 9, 19, 18, 29, 47))


@pytest.mark.parametrize(
    "make",
    [
        lambda url: AwsSpotPoller(endpoint=url),
        lambda url: GcpPreemptionPoller(endpoint=url),
        lambda url: AzureScheduledEventsPoller(endpoint=url, vm_name="vm-1"),
    ],
    ids=["aws", "gcp", "azure"],
)
@pytest.mark.parametrize("failure", ["malformed", "http500", "unreachable"])
def test_bad_sources_raise_for_poll_and_are_logged_by_the_watcher(
    server: MetadataServer, make, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    garbage = '{"action": "terminate", "time": "soon"'  # truncated JSON; also not TRUE/FALSE for GCP
    for path in (AWS_ACTION, GCP_PATH, AZURE_EVENTS):
        server.routes[path] = Route(500, "boom") if failure == "http500" else Route(200, garbage)
    url = closed_port_url() if failure == "unreachable" else server.url
    poller = make(url)
    with pytest.raises(NoticeSourceError):
        poller.poll()

    got: list[Notice] = []
    watcher = NoticeWatcher([poller], got.append, interval=0.01, log_every=60.0)
    with caplog.at_level(logging.WARNING, logger="lightning_bamboo"):
        watcher.start()
        try:
            assert watcher.wait_polls(3, timeout=10)  # kept polling after failures
            assert watcher.running
        finally:
            watcher.stop(timeout=5)
    assert not watcher.running and got == []
    failures = [r for r in caplog.records if "failed, polling continues" in r.getMessage()]
    assert len(failures) == 1  # rate-limited: three failing rounds, one line


def test_watcher_hands_over_the_first_notice_and_stops_polling(server: MetadataServer) -> None:
    server.routes[GCP_PATH] = Route(200, "FALSE")
    cb = PreemptionCallback(pollers=[GcpPreemptionPoller(endpoint=server.url)], poll_interval=0.01)
    cb._start()
    try:
        assert cb._watcher is not None and cb._watcher.wait_polls(2, timeout=10)
        assert cb.wait_for_notice(0) is None
        server.routes[GCP_PATH] = Route(200, "TRUE")
        notice = cb.wait_for_notice(timeout=10)
        assert notice is not None and notice.source == "gcp"
        assert preemption_pending()
    finally:
        cb._stop()
    assert cb._watcher is None and not preemption_pending()


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(signals=["SIGNOPE"]), "not a signal"),
        (dict(signals=["SIGKILL"]), "cannot be caught"),
        (dict(on_notice="reboot"), "must be one of"),
        (dict(pollers=["oracle"]), "known sources are"),
        (dict(poll_interval=0), "> 0"),
        (dict(check_every_n_steps=0), ">= 1"),
    ],
)
def test_bad_configuration_states_the_rule(kwargs: dict, words: str) -> None:
    with pytest.raises(BambooConfigError, match=words):
        PreemptionCallback(**kwargs)


def test_pollers_need_http_endpoints_and_bounded_timeouts() -> None:
    with pytest.raises(BambooConfigError, match="http"):
        AwsSpotPoller(endpoint="169.254.169.254")
    with pytest.raises(BambooConfigError, match="bounded"):
        GcpPreemptionPoller(timeout=0)


def test_configurable_from_yaml_through_jsonargparse(tmp_path) -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--config", action=jsonargparse.ActionConfigFile)
    parser.add_argument("--cb", type=PreemptionCallback)
    config = tmp_path / "c.yaml"
    config.write_text(
        "cb:\n  class_path: lightning_bamboo.callbacks.preemption.PreemptionCallback\n"
        "  init_args:\n    signals: [SIGUSR1]\n    poll_interval: 1.5\n"
        "    pollers:\n    - gcp\n    - class_path: lightning_bamboo.callbacks.notices.AwsSpotPoller\n"
        "      init_args: {endpoint: 'http://127.0.0.1:9', timeout: 0.5}\n"
        "    grace_period: 20\n    on_notice: checkpoint\n"
    )
    cb = parser.instantiate_classes(parser.parse_args(["--config", str(config)])).cb
    assert isinstance(cb, PreemptionCallback)
    assert cb.signals == (signal.SIGUSR1,) and cb.poll_interval == 1.5 and cb.on_notice == "checkpoint"
    gcp, aws = cb.pollers
    assert isinstance(gcp, GcpPreemptionPoller) and isinstance(aws, AwsSpotPoller)
    assert (aws.endpoint, aws.timeout) == ("http://127.0.0.1:9", 0.5)


def test_state_dict_round_trip_never_restores_a_pending_notice() -> None:
    cb = PreemptionCallback()
    cb.notices_seen, cb.last_notice, cb.checkpoint_seconds = 2, Notice("aws", 1.0e9, "terminate"), 3.5
    cb.notify(Notice("gcp"))
    fresh = PreemptionCallback()
    fresh.load_state_dict(cb.state_dict())
    assert (fresh.notices_seen, fresh.last_notice, fresh.checkpoint_seconds) == (
        2,
        Notice("aws", 1.0e9, "terminate"),
        3.5,
    )
    assert fresh.notice is None


def test_picklable_for_spawn_launchers(server: MetadataServer, restore_signals: None) -> None:
    import pickle

    server.routes[GCP_PATH] = Route(200, "FALSE")
    cb = PreemptionCallback(signals=["SIGUSR1"], pollers=[GcpPreemptionPoller(endpoint=server.url)])
    cb._start()
    cb.install_signal_handlers()
    try:
        cb.notify(Notice("gcp", 5.0))
        copy = pickle.loads(pickle.dumps(cb))
    finally:
        cb._stop()
    assert copy.notice is None and copy._watcher is None and copy._installed == {}
    assert copy.signals == (signal.SIGUSR1,) and copy.pollers[0].endpoint == server.url
    copy.notify(Notice("aws", 7.0))
    assert copy.wait_for_notice(timeout=1) == Notice("aws", 7.0)


# --------------------------------------------------------------------------- real Trainer runs
class TinyModel(LightningModule):
    """Regression on 8 features; ``on_step`` runs inside training_step (the engine's view of a step)."""

    def __init__(self, on_step=None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.on_step = on_step
        self.pending_inside_step: list[bool] = []

    def training_step(self, batch, batch_idx):
        if self.on_step is not None:
            self.on_step(batch_idx)
        self.pending_inside_step.append(preemption_pending())
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        return DataLoader(data, batch_size=2)


def make_trainer(tmp_path, callback: PreemptionCallback, **kwargs) -> Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=20,
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    options.update(kwargs)
    return Trainer(callbacks=[callback], **options)


def test_aws_notice_mid_run_writes_a_last_checkpoint_and_stops_at_that_step(
    server: MetadataServer, tmp_path, restore_signals: None
) -> None:
    server.routes[AWS_TOKEN] = Route(200, "tok", method="PUT")
    cb = PreemptionCallback(
        pollers=[AwsSpotPoller(endpoint=server.url, timeout=2.0)], poll_interval=0.02, checkpoint_seconds=5.0
    )
    sigterm_before = signal.getsignal(signal.SIGTERM)

    def on_step(batch_idx: int) -> None:
        if batch_idx == 4:  # the notice appears during the 5th step; wait for the poller to see it
            server.routes[AWS_ACTION] = Route(200, aws_notice_body(time.time() + 120))
            assert cb.wait_for_notice(timeout=10) is not None

    model = TinyModel(on_step)
    trainer = make_trainer(tmp_path, cb, logger=CSVLogger(str(tmp_path), name="log"), log_every_n_steps=50)
    trainer.fit(model)

    assert trainer.global_step == 5 and cb.stopped_at_step == 5
    assert model.pending_inside_step == [False] * 4 + [True]  # visible inside the step that got it
    path = tmp_path / "checkpoints" / "preempted-step=5.ckpt"
    assert cb.last_checkpoint_path == str(path) and path.is_file()
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["global_step"] == 5
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("PreemptionCallback")]
    assert state["notices_seen"] == 1 and state["last_notice"]["source"] == "aws"
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("preemption/notices")]
    assert [float(r["preemption/notices"]) for r in rows] == [1.0]
    assert signal.getsignal(signal.SIGTERM) is sigterm_before  # restored after fit
    assert not preemption_pending()


def test_sigterm_mid_run_bypasses_lightning_handler_and_stops_cleanly(
    tmp_path, restore_signals: None
) -> None:
    chained: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: chained.append(s))  # a user's handler, set before fit
    user_handler = signal.getsignal(signal.SIGTERM)
    cb = PreemptionCallback(signals=["SIGTERM"], grace_period=30.0, checkpoint_seconds=1.0)

    def on_step(batch_idx: int) -> None:
        if batch_idx == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer = make_trainer(tmp_path, cb)
    trainer.fit(TinyModel(on_step))
    assert trainer.global_step == 3
    assert chained == [signal.SIGTERM]  # Lightning's composite chained through, without its notifier
    assert not trainer.received_sigterm  # Lightning's in-handler broadcast never ran
    assert (tmp_path / "checkpoints" / "preempted-step=3.ckpt").is_file()
    assert signal.getsignal(signal.SIGTERM) is user_handler


def test_too_little_time_left_stops_without_a_checkpoint(tmp_path, restore_signals: None) -> None:
    cb = PreemptionCallback(signals=["SIGUSR1"], grace_period=2.0, checkpoint_seconds=60.0)
    trainer = make_trainer(tmp_path, cb)
    trainer.fit(TinyModel(lambda i: i == 1 and os.kill(os.getpid(), signal.SIGUSR1)))
    assert trainer.global_step == 2 and cb.stopped_at_step == 2
    assert cb.last_checkpoint_path is None and not (tmp_path / "checkpoints").exists()


class HandoverStrategy(SingleDeviceStrategy):
    """The Bamboo strategy's hook, as the callback calls it: one call per rank at the agreed boundary."""

    def __init__(self, accept: bool) -> None:
        super().__init__(device=torch.device("cpu"))
        self.accept = accept
        self.calls: list[tuple[Notice | None, tuple[int, ...], int]] = []

    def handle_preemption_notice(self, notice: Notice | None, *, leaving_ranks: tuple[int, ...]) -> bool:
        self.calls.append((notice, leaving_ranks, self.lightning_module.trainer.global_step))
        return self.accept


@pytest.mark.parametrize("accept", [True, False], ids=["handover", "declined"])
def test_strategy_hook_takes_over_or_falls_back(tmp_path, restore_signals: None, accept: bool) -> None:
    strategy = HandoverStrategy(accept)
    cb = PreemptionCallback(signals=["SIGUSR1"], checkpoint_seconds=1.0)
    trainer = make_trainer(tmp_path, cb, strategy=strategy, max_steps=8)
    trainer.fit(TinyModel(lambda i: i == 3 and os.kill(os.getpid(), signal.SIGUSR1)))
    ((notice, leaving, step),) = strategy.calls
    assert notice is not None and notice.source == "signal:SIGUSR1" and leaving == (0,) and step == 4
    if accept:  # the strategy owns the leaving node's fate: training goes on, no checkpoint from us
        assert trainer.global_step == 8 and cb.last_checkpoint_path is None
    else:
        assert trainer.global_step == 4 and (tmp_path / "checkpoints" / "preempted-step=4.ckpt").is_file()


# --------------------------------------------------------------------------- two real ranks (gloo)
def _ddp_worker(rank: int, root: str, out: str) -> None:
    """One rank of a 2-process DDP run; rank 1 gets SIGTERM during its 3rd step."""
    cb = PreemptionCallback(signals=["SIGTERM"], grace_period=30.0, checkpoint_seconds=1.0)

    def on_step(batch_idx: int) -> None:
        if rank == 1 and batch_idx == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer = make_trainer(root, cb, strategy="ddp", devices=2)
    trainer.fit(TinyModel(on_step))
    with open(out, "w") as f:
        json.dump(
            {
                "step": trainer.global_step,
                "stopped_at": cb.stopped_at_step,
                "ckpt": cb.last_checkpoint_path,
                "lightning_sigterm": trainer.received_sigterm,
            },
            f,
        )


def test_sigterm_on_a_nonzero_rank_stops_both_ranks_at_the_same_step(tmp_path) -> None:
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            NODE_RANK="0",
            LOCAL_RANK=str(rank),
            RANK=str(rank),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        cmd = [
            sys.executable,
            __file__,
            "ddp-worker",
            str(rank),
            str(tmp_path),
            str(tmp_path / f"rank{rank}.json"),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in results] == [3, 3] and [r["stopped_at"] for r in results] == [3, 3]
    assert not any(r["lightning_sigterm"] for r in results)
    assert (tmp_path / "checkpoints" / "preempted-step=3.ckpt").is_file()


@pytest.mark.parametrize("action, steps", [("log", 6), ("stop", 2)])
def test_log_only_keeps_training_and_stop_writes_nothing(
    tmp_path, restore_signals: None, action, steps
) -> None:
    cb = PreemptionCallback(signals=["SIGUSR1"], on_notice=action)
    trainer = make_trainer(tmp_path, cb, max_steps=6)
    trainer.fit(TinyModel(lambda i: i == 1 and os.kill(os.getpid(), signal.SIGUSR1)))
    assert trainer.global_step == steps and cb.notices_seen == 1
    assert cb.last_notice is not None and cb.last_notice.source == "signal:SIGUSR1"
    assert not (tmp_path / "checkpoints").exists()


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "ddp-worker":
        _ddp_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
