"""Shared test helpers: the tiny GPT config, its data, the single-process reference, process running, reading a
job's output."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss
from lightning_bamboo.testing.job_output import json_reports, launcher_exit_codes  # noqa: F401 - the tests' names for them

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def make_config() -> GPTConfig:
    # 4 pipeline layers (embedding, 2 blocks, head): enough for 4 stages, small enough for CPU.
    return GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)


class TokenData(torch.utils.data.Dataset):
    """Deterministic random token sequences; the target is the input shifted by one."""

    def __init__(self, cfg: GPTConfig, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, cfg.vocab_size, (n, cfg.block_size + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def reference_weights(
    steps: int, batch_size: int, pipelines: int, micro_batch_size: int, optimizer: str = "sgd", seed: int = 1234,
    clip: float = 0.0, dtype: torch.dtype | None = None, layer_specs: bool = False,
) -> dict[str, torch.Tensor]:
    """Single-process run of the same layers, micro-batching (gradient accumulation) and data order; ``clip``: by the
    global norm (torch's ``clip_grad_norm_``), ``dtype``: the layers and the loss under CPU autocast to it;
    ``layer_specs``: the model as ``gpt_layer_specs``, every layer built by ``build_layers`` (the whole-model build)."""
    import contextlib

    cfg = make_config()
    if layer_specs:
        from lightning_bamboo.engine.module import build_layers
        from lightning_bamboo.models.gpt import gpt_layer_specs

        model = torch.nn.Sequential(*build_layers(lambda: gpt_layer_specs(cfg), seed).layers)
    else:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*gpt_layers(cfg))
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = TokenData(cfg, steps * batch_size * pipelines)
    per_step = batch_size * pipelines
    chunks = per_step // micro_batch_size
    for step in range(steps):
        opt.zero_grad()
        for c in range(chunks):
            x, y = data[step * per_step + c * micro_batch_size : step * per_step + (c + 1) * micro_batch_size]
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                loss = gpt_loss(model(x), y)
            (loss / chunks).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def optimizer_states(path: Path) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor of a saved checkpoint (any layout), keyed ``layer.param.state``."""
    from lightning_bamboo import checkpoint as ckpt

    layers = ckpt.read_layers(path, range(ckpt.read_meta(path)["bamboo"]["num_layers"]))
    return {f"{layer}.{name}.{key}": torch.as_tensor(value)
            for layer, state in layers.items() for name, saved in state["optimizer"].items()
            for key, value in saved["state"].items()}


#: what a launcher started by :func:`run` preloads (``--preload``): its workers are forks of one interpreter that
#: imported these, so that a test pays for the imports once per job, not once per worker (4-5 s of a core each on
#: 2 cores). A test of the plain start (a worker's own interpreter, as on a GPU machine) passes
#: ``env={PRELOAD_ENV: ""}``; a launcher a test starts itself gets it from :func:`preloaded`.
PRELOAD = "torch,deepspeed,lightning.pytorch,lightning_bamboo.strategy"


#: what the suite's shared fork server imports (``launcher.forks.start_shared``): the preloaded modules and the demo's
#: worker, whose launchers and demos fork their workers there instead of importing in a server of their own (4-5 s of
#: a core and as long before the first worker runs, in each of about a hundred jobs)
SHARED_PRELOAD = (*PRELOAD.split(","), "lightning_bamboo.demo.worker")
_shared: tuple[subprocess.Popen, str] | None = None


#: what the processes a test starts through :func:`process_context` find imported
PROCESS_PRELOAD = ["torch", "torch.distributed", "lightning_bamboo.engine.exchange", "tests.helpers"]


def process_context() -> Any:
    """``multiprocessing``'s forkserver context, its server preloading torch and the engine: a test's processes are
    forks of it (milliseconds) instead of interpreters that each import torch (``spawn``: 4-5 s of a core each).
    The server is started once per test process, with the first process it forks."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PROCESS_PRELOAD)
    return context


def preloaded() -> dict[str, str]:
    """The environment that makes a launcher started by a test fork its workers at the suite's shared fork server
    (or, where that imported with another ``PYTHONPATH``, at a server of its own that imports once per job)."""
    from lightning_bamboo.launcher import PRELOAD_ENV
    from lightning_bamboo.launcher.forks import SHARED_ENV

    return {PRELOAD_ENV: PRELOAD, SHARED_ENV: shared_fork_server()}


def shared_fork_server() -> str:
    """The address of this test process's shared fork server, started at the first call (``stop_shared_fork_server``
    ends it, with every worker it forked that still runs: ``conftest.pytest_sessionfinish``)."""
    global _shared
    if _shared is None or _shared[0].poll() is not None:
        import tempfile

        from lightning_bamboo.launcher.forks import start_shared

        address = os.path.join(tempfile.mkdtemp(prefix="bamboo-forks-"), "forks.sock")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}
        _shared = start_shared(address, SHARED_PRELOAD, env), address
    return _shared[1]


def stop_shared_fork_server() -> None:
    global _shared
    if _shared is not None:
        import shutil

        proc, address = _shared
        proc.kill()
        proc.wait()
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)
        _shared = None


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to process ``pid`` and to every process it started (``descendants``, listed first). ``pid`` must
    still run: a ``ProcessLookupError`` for it is the test's finding. A descendant may end between the listing and
    its signal (a communication process that exits by itself): it needs the signal no more, and is skipped."""
    from lightning_bamboo.membership.node import descendants

    family = descendants(pid)
    os.kill(pid, sig)
    for child in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, sig)


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole process group (children included, and the workers
    the shared fork server forked for its launchers: they die with their launcher's connection).

    A ``python SCRIPT.py`` or ``python -m MODULE`` command is forked at the shared fork server (a job's rank 0, a
    script refused before it starts: 4-6 s of a core importing each), unless ``env`` turns preloading off
    (``PRELOAD_ENV: ""``: a test of processes with interpreters of their own, as on a GPU machine)."""
    from lightning_bamboo.launcher import PRELOAD_ENV
    from lightning_bamboo.launcher.forks import SHARED_ENV

    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", PRELOAD_ENV: PRELOAD,
                SHARED_ENV: shared_fork_server(), **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    with contextlib.ExitStack() as held:
        reading, writing = os.pipe()
        held.callback(os.close, reading)
        try:
            proc: Any = None
            if full_env[PRELOAD_ENV] and full_env[SHARED_ENV]:
                proc = _start_forked(cmd, full_env, cwd, writing, held)
            if proc is None:
                proc = subprocess.Popen(list(cmd), cwd=cwd, env=full_env, stdout=writing, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        finally:
            os.close(writing)
        return _collect(proc, reading, cmd, timeout)


def _start_forked(cmd: Sequence[str], env: dict[str, str], cwd: Path, out: int, held: contextlib.ExitStack) -> Any:
    """``cmd`` forked at the shared fork server, in a session of its own with ``out`` as its output, as a
    ``subprocess.Popen(..., start_new_session=True)`` would start it; None where the server cannot fork it. The
    connection to the server (its workers die with it) is closed by ``held``."""
    from lightning_bamboo.launcher.forks import SHARED_ENV, ForkServer, ForkServerRefused

    try:
        server = ForkServer((), env, runs=("*",), scripts=True, address=env[SHARED_ENV])
    except ForkServerRefused:
        return None
    held.callback(server.close)
    if not server.accepts(cmd):
        return None
    return server.start(cmd, env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)


def _collect(proc: Any, reading: int, cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    """``proc``'s output (read from ``reading`` until every process that holds it has closed it, as ``communicate``
    reads) and exit status; past ``timeout`` its whole process group is killed and the test fails. Whatever happens,
    its process group is killed at the end: it leaves no child behind."""
    import select
    import time

    deadline, out = time.monotonic() + timeout, bytearray()
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout} s; output:\n"
                                     f"{out.decode(errors='replace')[-4000:]}")
            if select.select([reading], [], [], min(left, 1.0))[0]:
                data = os.read(reading, 1 << 16)
                if not data:
                    break
                out += data
        try:
            code = proc.wait(max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{' '.join(cmd)} closed its output but did not exit; output:\n"
                                 f"{out.decode(errors='replace')[-4000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
    return subprocess.CompletedProcess(list(cmd), code, text, None)


def pairs_alike_in_nccls_lanes(trace: Path, kinds: set[int] | None = None) -> None:
    """Every message of a job traced into ``trace`` (``$BAMBOO_COMM_TRACE``) pairs with the receive that gloo gave it by
    tag also by its place in its NCCL lane (``comm_cuda.lane_mismatches``), and the sends cover the lanes ``kinds``
    (default: every one: the pipeline's, the tied gradients', each message of the replica exchange)."""
    from lightning_bamboo.engine.comm_cuda import LANES, lane_mismatches, tag_lane

    records = [json.loads(line) for path in trace.glob("*.jsonl") for line in path.read_text().splitlines()]
    assert lane_mismatches(records) == []
    assert {tag_lane(r["tag"]) for r in records if r["op"] == "send"} == (set(LANES) if kinds is None else kinds)


def callback_from_yaml(cls: type, init_args: str) -> object:
    """``cls`` built the way LightningCLI builds a callback from YAML (``class_path`` + ``init_args``)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callback", type=cls)
    config = parser.parse_string(f"callback:\n  class_path: {cls.__module__}.{cls.__qualname__}\n  init_args: {init_args}\n")
    return parser.instantiate_classes(config).callback


def wait_until_standing_by(url: str, job: str, node: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until ``node`` is registered as a standby of ``job`` in the store at ``url`` (its launcher ``proc`` alive)."""
    from lightning_bamboo.membership import connect
    from lightning_bamboo.membership.keys import JobKeys
    from lightning_bamboo.membership.watch import wait_for_key

    store = connect(url)
    try:
        kv = wait_for_key(store, JobKeys(job).standby(node), timeout, abort=lambda: proc.poll() is not None)
    finally:
        store.close()
    assert proc.poll() is None, f"the standby launcher exited with {proc.returncode} before standing by"
    assert kv is not None, f"{node} did not stand by within {timeout} s"


def launch_beside_a_standby_machine(job: str, nodes: int, standby: str, command: Sequence[str],
                                    env: dict[str, str] | None = None, standby_env: dict[str, str] | None = None,
                                    timeout: float = 240) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """A job of ``nodes`` local workers (``python -m lightning_bamboo.launcher --nodes N``, ``env``) and a machine
    ``standby`` standing by before it starts (another launcher, ``--node NAME --join``, ``standby_env``) on one
    embedded store, as etcd would be, both running ``command`` (the script and its arguments). Returns both
    launchers' outcomes (output merged), every process and the store stopped."""
    from lightning_bamboo.membership import resolve_store

    url, server = resolve_store("embedded")
    assert server is not None
    common = ["--store", url, "--job", job, "--", *command]
    waiting = None
    try:
        waiting = subprocess.Popen([PYTHON, "-m", "lightning_bamboo.launcher", "--node", standby, "--join", *common],
                                   cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                "DS_ACCELERATOR": "cpu", **(standby_env or {})})
        wait_until_standing_by(url, job, standby, waiting)  # else a kill may come before it stands by
        proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", str(nodes), *common], timeout=timeout, env=env)
        joined, _ = waiting.communicate(timeout=60)
    finally:
        if waiting is not None and waiting.poll() is None:
            os.killpg(waiting.pid, signal.SIGKILL)
            waiting.communicate()
        server.stop()
    return proc, subprocess.CompletedProcess(waiting.args, waiting.returncode, joined, None)


@contextlib.contextmanager
def aws_metadata_with_a_notice() -> Any:
    """A loopback stand-in for AWS's instance metadata service that has scheduled this machine's interruption
    (IMDSv2: a token, then the instance action). Yields its URL."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            self._answer(b"token" if self.path == "/latest/api/token" else None)

        def do_GET(self):
            self._answer(json.dumps({"action": "terminate", "time": stamp}).encode()
                         if self.path == "/latest/meta-data/spot/instance-action" else None)

        def _answer(self, body):
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
