"""``redundancy="auto"`` in a real job: two pipelines of one node per machine keep no replica, and a SIGKILL drops
the damaged pipeline as under ``lazy``, ending with the lazy run's weights and optimizer state; the pipeline left
alone then keeps replicas (one pipeline: auto is lazy). The Lightning door under the Bamboo launcher
(``benchmarks/spot_user.py``); the DeepSpeed door's one-pipeline failover is in ``tests/test_deepspeed_door.py``."""

from __future__ import annotations

import json
import re

import pytest

from lightning_bamboo import consolidate_checkpoint
from lightning_bamboo.testing import faults
from tests.helpers import PYTHON, launcher_exit_codes, max_abs_diff, optimizer_states, run

pytestmark = pytest.mark.timeout(600)

STEPS, AT = 16, 8
#: the restart tests' length: a node that released itself is admitted once its standby key has been seen refreshed
#: (``MembershipSession.standby``: it refreshes it every second), a second or two after the restart; 8 steps of this
#: small model take less than a second, so the job runs 24 more to leave the admission that time even on a loaded
#: machine (under the suite's other lane, 8 did not: the job ended before node3 was admitted)
RESTART_STEPS = 40


def _job(out, redundancy: str, killed: tuple[str, ...] = ("node1",),
         when: tuple[str, ...] = (), steps: int = STEPS) -> tuple[str, dict[str, list[dict]]]:
    """Four nodes (each its own machine) as two pipelines of two stages (node ``i``: stage ``i // 2`` of pipeline
    ``i % 2``), ``killed`` SIGKILLed at the start of step AT (or where ``when`` says, ``faults``' form), a checkpoint
    every 4 steps. Returns the output and each node's step records."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, "benchmarks/spot_user.py",
                "--stages", "2", "--steps", str(steps), "--checkpoint-every", "4", "--redundancy", redundancy,
                "--out", str(out)], timeout=400, env=faults.environment(list(when) or [f"{node}@{AT}" for node in killed]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {f"node{i}": -9 if f"node{i}" in killed else 0 for i in range(4)}, \
        proc.stdout[-3000:]
    records = {path.stem.removeprefix("steps-"): [json.loads(line) for line in path.read_text().splitlines()]
               for path in out.glob("steps-*.jsonl")}
    return proc.stdout, records


def test_two_pipelines_keep_no_replica_and_a_kill_drops_the_damaged_one_as_lazy_does(tmp_path):
    auto, auto_steps = _job(tmp_path / "auto", "auto")
    lazy, lazy_steps = _job(tmp_path / "lazy", "lazy")
    for stdout in (auto, lazy):  # the same failover: pipeline 1 dropped, its survivor released, no restart
        assert f"lost ['node1'] at step {AT}; new layout ('node0', 'node2') (1 pipeline(s))" in stdout, stdout[-3000:]
        assert "released ['node3']" in stdout and "restarted after a fatal loss" not in stdout
    # two pipelines on four machines: every stage has a copy on another machine, so auto keeps no replica; once one
    # pipeline is left each survivor keeps its successor's stage, as lazy's nodes do from the start
    for node, successor in (("node0", 1), ("node1", 1), ("node2", 0), ("node3", 0)):
        before = [r for r in auto_steps[node] if r["step"] < AT]
        assert [r["step"] for r in before] == list(range(AT)) and {r["replica"] for r in before} == {None}, node
        assert {r["replica"] for r in lazy_steps[node] if r["step"] < AT} == {successor}, node
    for node, successor in (("node0", 1), ("node2", 0)):
        after = [r for r in auto_steps[node] if r["step"] >= AT]
        assert [r["step"] for r in after] == list(range(AT, STEPS)) and {r["replica"] for r in after} == {successor}
        assert {len(r["nodes"]) for r in after} == {2}
    # every step on the same samples in both runs, and the same model and optimizer state at the end, bit for bit
    assert [r["batch"] for r in auto_steps["node0"]] == [r["batch"] for r in lazy_steps["node0"]]
    assert max_abs_diff(consolidate_checkpoint(tmp_path / "auto" / "final"),
                        consolidate_checkpoint(tmp_path / "lazy" / "final")) == 0.0
    assert max_abs_diff(optimizer_states(tmp_path / "auto" / "final"),
                        optimizer_states(tmp_path / "lazy" / "final")) == 0.0


@pytest.mark.parametrize("when", [(), ("node1@8", "node2@8:3")], ids=["together", "inside-the-failover"])
def test_a_loss_in_every_pipeline_without_kept_replicas_restarts_from_the_checkpoint(tmp_path, when):
    """node1 (stage 0 of pipeline 1) and node2 (stage 1 of pipeline 0): no pipeline is whole and auto kept no
    replica to fail one over from, so the survivors restart the job in their processes from the last checkpoint, as
    one pipeline, which then keeps every replica. Both survivors restart where both saw both losses in their first
    decision; a survivor that saw one of them first released itself (its pipeline dropped) and stands by, so the
    other restarts alone (the restart does not wait for a node that released itself, which ended the job) and admits
    it once it sees its standby key refreshed. Together: either can happen on a loaded machine. node2 lost a moment
    later (inside the failover of node1's loss, which released node3): node0 restarts alone and admits node3, or both
    restart."""
    stdout, steps = _job(tmp_path, "auto", killed=("node1", "node2"), when=when, steps=RESTART_STEPS)
    assert f"restarted after a fatal loss at step {AT} (every pipeline lost a node and none can fail over" in stdout
    assert "no replica of it is kept" in stdout, stdout[-3000:]
    resumed = int(re.search(r"restarted after a fatal loss at step 8 .* from \S+, step (\d+), in", stdout)[1])
    # together: the last complete checkpoint is step 4's; node2 dying inside step 8 has saved its shard of step 8's
    assert resumed == 4 if not when else resumed in (4, 8), stdout[-3000:]
    restarted = sorted(set(re.findall(r"(node[03]): restarted after a fatal loss at step 8", stdout)))
    assert restarted, stdout[-3000:]
    for node in ("node0", "node3"):  # both end in one pipeline of two, each holding the other's stage's replica
        again = [r for r in steps[node] if len(r["nodes"]) == 2 and r["step"] >= resumed]
        assert again, (node, stdout[-3000:])
        assert [r["step"] for r in again] == list(range(again[0]["step"], RESTART_STEPS))
        assert {r["replica"] for r in again} == {1 - again[-1]["nodes"].index(node)}
    # a node that restarted trained every step from the checkpoint on
    first = restarted[0]
    assert [r["step"] for r in steps[first] if r["step"] >= resumed][-(RESTART_STEPS - resumed):] == \
        list(range(resumed, RESTART_STEPS))
