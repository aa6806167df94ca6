"""What the launcher tells the user: one start line per worker (node, pid, rank, device), ``--pid-dir`` files
that hold each running worker's pid, and ``--help`` naming every variable a worker gets."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from lightning_bamboo.launcher import WORKER_ENV, Cluster, main, plan_node, visible_gpus, worker_device
from lightning_bamboo.membership import resolve_store
from lightning_bamboo.membership.node import joiner_env
from tests.helpers import PYTHON, REPO, run

pytestmark = pytest.mark.timeout(180)

# a worker in miniature: waits (bounded) for its pid file, then writes its pid, what the file held and its whole
# environment to OUT/<node>.json, and exits 0; the last of the job's initial nodes first waits (bounded) for the
# other nodes' pid files to go, as they exit before it, and reports whether they went
REPORTER = """
import json, os, sys, time
node, pid_dir, out = os.environ["BAMBOO_NODE"], sys.argv[1], sys.argv[2]
path = os.path.join(pid_dir, node + ".pid")
deadline = time.monotonic() + 30
while not os.path.exists(path) and time.monotonic() < deadline:
    time.sleep(0.02)
held = open(path).read() if os.path.exists(path) else None
others = [n for n in os.environ["BAMBOO_NODES"].split(",") if n != node]
last = os.environ.get("BAMBOO_JOIN") != "1" and node == os.environ["BAMBOO_NODES"].split(",")[-1]
while last and any(os.path.exists(os.path.join(pid_dir, n + ".pid")) for n in others) and time.monotonic() < deadline:
    time.sleep(0.02)
gone = None if not last else not any(os.path.exists(os.path.join(pid_dir, n + ".pid")) for n in others)
with open(os.path.join(out, node + ".json"), "w") as f:
    json.dump({"pid": os.getpid(), "held": held, "others_gone": gone, "env": dict(os.environ)}, f)
"""

START = re.compile(r"^\[launcher\] (\S+): pid (\d+), (rank (\d+) of (\d+)|standby \(joins the running job\)), "
                   r"device (.+)$", re.MULTILINE)


def _launch(args: list[str], tmp_path: Path) -> tuple[str, dict[str, dict]]:
    """Run the launcher with ``args`` over the reporter; returns its output and each worker's report."""
    pids, out = tmp_path / "pids", tmp_path / "out"
    out.mkdir(parents=True)
    cmd = [PYTHON, "-m", "lightning_bamboo.launcher", *args, "--pid-dir", str(pids), "--",
           PYTHON, "-c", REPORTER, str(pids), str(out)]
    result = run(cmd, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]
    assert os.listdir(pids) == [], "a pid file outlived its worker"
    return result.stdout, {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def _check_start_lines(output: str, reports: dict[str, dict], roles: dict[str, str]) -> None:
    lines = {m[0]: m for m in START.findall(output)}
    assert sorted(lines) == sorted(roles) == sorted(reports), output[-4000:]
    assert len(START.findall(output)) == len(roles), "one start line per worker"
    gpus = visible_gpus()
    for node, (_, pid, role, _, _, device) in lines.items():
        report = reports[node]
        assert int(pid) == report["pid"]  # the worker's real pid
        assert report["held"] == f"{report['pid']}\n"  # its pid file, read while it ran
        assert role == roles[node]
        assert device == worker_device(report["env"], gpus)
        assert report["env"]["BAMBOO_NODE"] == node
    last = [r for r in reports.values() if r["others_gone"] is not None]
    if len(reports) > 1:  # the other workers' files went when they exited, while the last one still ran
        assert [r["others_gone"] for r in last] == [True]


def test_a_local_launch_names_each_workers_pid_rank_and_device_and_keeps_pid_files_while_they_run(tmp_path):
    output, reports = _launch(["--nodes", "2"], tmp_path)
    _check_start_lines(output, reports, {"node0": "rank 0 of 2", "node1": "rank 1 of 2"})
    # what a worker finds set (or changed) in its environment, beyond the launcher's own, is all in --help
    documented = {name for name, _ in WORKER_ENV}
    for report in reports.values():
        env = report["env"]
        given = {k for k in env if os.environ.get(k) != env[k]} - {"PYTHONUNBUFFERED", "DS_ACCELERATOR", "BAMBOO_PRELOAD",
                                                                 "BAMBOO_FORK_SERVER"}  # run()'s own
        assert given <= documented, sorted(given - documented)
        assert {"BAMBOO_NODE", "BAMBOO_NODES", "BAMBOO_STORE", "BAMBOO_JOB", "RANK", "WORLD_SIZE"} <= given
    # one machine: worker i is LOCAL_RANK i of LOCAL_WORLD_SIZE 2 (GPU i on a machine with GPUs)
    assert {n: (r["env"]["LOCAL_RANK"], r["env"]["LOCAL_WORLD_SIZE"]) for n, r in reports.items()} == {
        "node0": ("0", "2"), "node1": ("1", "2")}


def test_a_supervisors_workers_and_standby_nodes_get_start_lines_and_pid_files(tmp_path):
    url, server = resolve_store("embedded")  # a running store that two supervisors share, as etcd would be
    assert server is not None
    try:
        output, reports = _launch(["--store", url, "--job", "report", "--node", "m0", "--peers", "m0", "--workers", "2"],
                                  tmp_path / "peers")
        _check_start_lines(output, reports, {"m0.0": "rank 0 of 2", "m0.1": "rank 1 of 2"})
        assert all(r["env"]["BAMBOO_MACHINE"] == "m0" for r in reports.values())
        # --workers 2: each worker's index on its machine, the device Lightning's parallel_devices[LOCAL_RANK] takes
        assert {n: (r["env"]["LOCAL_RANK"], r["env"]["LOCAL_WORLD_SIZE"]) for n, r in reports.items()} == {
            "m0.0": ("0", "2"), "m0.1": ("1", "2")}
        output, reports = _launch(["--store", url, "--job", "report", "--node", "m1", "--join"], tmp_path / "join")
        _check_start_lines(output, reports, {"m1": "standby (joins the running job)"})
        assert reports["m1"]["env"]["BAMBOO_JOIN"] == "1"
    finally:
        server.stop()


def _variables_the_launcher_sets(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every variable the launcher's code puts into a worker's environment: the shared part (with the caller's
    own choices removed, so that the defaults are set), a rank's, a standby node's and a machine's."""
    for name in [n for n in os.environ if n.startswith("BAMBOO_")] + [
            "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"]:
        monkeypatch.delenv(name, raising=False)
    cluster = Cluster("embedded", job="help", local_workers=2)
    try:
        shared = {k for k, v in cluster.env.items() if os.environ.get(k) != v}
        rank = set(cluster.rank_env("node0", 0, ["node0"]))
    finally:
        cluster.close()
    machine = set(plan_node(["true"], "m0", store="etcd://127.0.0.1:1", peers=["m0"]).env)
    return shared | rank | set(joiner_env("node0")) | machine


def test_help_and_the_docs_list_every_variable_the_launcher_sets(monkeypatch, capsys):
    variables = _variables_the_launcher_sets(monkeypatch)
    assert {"BAMBOO_NODE", "BAMBOO_JOIN", "BAMBOO_MACHINE", "LOCAL_RANK", "OMP_NUM_THREADS",
            "GLOO_SOCKET_IFNAME"} <= variables  # the derivation finds them
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    missing = sorted(v for v in variables if not re.search(rf"^\s+{v}\s", text, re.MULTILINE))
    assert not missing, f"--help does not list {missing}"
    assert "--pid-dir" in text
    assert {name for name, _ in WORKER_ENV} == variables, "WORKER_ENV lists a variable the launcher does not set"
    for doc in ("README.md", "docs/deploy.md"):  # and the user's documentation names them too
        text = (REPO / doc).read_text()
        missing = sorted(v for v in variables if f"`{v}" not in text)
        assert not missing, f"{doc} does not name {missing}"


def test_a_start_line_names_the_gpu_of_the_local_rank_and_the_cpu_without_gpus():
    assert worker_device({"LOCAL_RANK": "1"}, 0) == "cpu"
    assert worker_device({"LOCAL_RANK": "1"}, 2) == "cuda:1"
    assert worker_device({}, 1) == "cuda:0"
    assert worker_device({"LOCAL_RANK": "3"}, 2) == "cuda:3 (this machine has 2 GPU(s))"
