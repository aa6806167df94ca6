"""One behaviour suite for both front doors: the same job (``tests/scripts/door_job.py``: the same layers, data,
optimizer and micro-batches) through ``Trainer(strategy=BambooStrategy(...))`` and through
``lightning_bamboo.initialize``, under the Bamboo launcher, with real SIGKILLs and every exit code checked.

Each behaviour a user expects of both doors alike runs once per door: a node lost while the job starts, the
replica audit of every step, the random state a resume restores, a spot notice, and a fatal loss (a node and its
replica holder together) that restarts the job from its last checkpoint by itself. And both doors train the same
job to the same weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo import consolidate_checkpoint
from lightning_bamboo.testing import faults
from tests.helpers import (
    PYTHON,
    REPO,
    aws_metadata_with_a_notice,
    launcher_exit_codes,
    max_abs_diff,
    optimizer_states,
    run,
)

pytestmark = pytest.mark.timeout(400)

SCRIPT = REPO / "tests" / "scripts" / "door_job.py"
DOORS = ("lightning", "deepspeed")
STEPS = 12


def _job(door: str, out: Path, nodes: int = 4, stages: int = 4, kill: tuple[str, ...] = (), extra: tuple[str, ...] = (),
         env: dict[str, str] | None = None) -> str:
    """``door_job.py`` through ``door`` on ``nodes`` launcher nodes; asserts the launcher's status 0, every node's 0
    but the killed ones' -9, and a summary from rank 0. Returns the launcher's output."""
    environment = {**(faults.environment(list(kill)) if kill else {}), **(env or {})}
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", str(nodes), "--", PYTHON, str(SCRIPT),
                "--door", door, "--steps", str(STEPS), "--stages", str(stages), "--save-dir", str(out), *extra],
               timeout=300, env=environment or None)
    assert proc.returncode == 0, proc.stdout[-4000:]
    victims = {k.split("@")[0] for k in kill}
    codes = launcher_exit_codes(proc.stdout)
    assert codes == {f"node{i}": (-9 if f"node{i}" in victims else 0) for i in range(nodes)}, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


def _summary(stdout: str) -> dict:
    return next(json.loads(line) for line in stdout.splitlines() if line.startswith('{"door"'))


def _draws(stdout: str) -> dict[tuple[int, int], float]:
    return {(r["rank"], r["step"]): r["draw"] for r in map(json.loads, re.findall(r'\{"rank": [^{}]*\}', stdout))}


def _final(out: Path) -> tuple[dict, dict, dict]:
    final = out / "final"
    return consolidate_checkpoint(final), optimizer_states(final), ckpt.read_meta(final)


def _equal_to(out: Path, clean: Path) -> None:
    weights, states, _ = _final(out)
    clean_weights, clean_states, _ = _final(clean)
    assert max_abs_diff(weights, clean_weights) == 0.0 and max_abs_diff(states, clean_states) == 0.0


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Callable[[str], Path]:
    """The job without events, per door (4 nodes, 4 stages, a checkpoint every 6 steps), run on first use."""
    done: dict[str, Path] = {}

    def of(door: str) -> Path:
        if door not in done:
            out = tmp_path_factory.mktemp(f"clean-{door}")
            assert _summary(_job(door, out, extra=("--save-every", "6")))["step"] == STEPS
            done[door] = out
        return done[door]

    return of


@pytest.mark.parametrize("door", DOORS)
def test_a_node_lost_while_the_job_starts_is_started_without(tmp_path, clean, door):
    """node2 registers and is SIGKILLed before the first rendezvous: the three others start a 3-stage pipeline at
    once, train to the end, and end with the clean 4-stage run's weights and optimizer state (nothing had trained)."""
    stdout = _job(door, tmp_path, kill=("node2@start",), extra=("--save-every", "6"))
    for node in ("node0", "node1", "node3"):
        assert f"{node}: ['node2'] died while the job started; starting with 3 nodes" in stdout, stdout[-3000:]
    _equal_to(tmp_path, clean(door))
    assert len(ckpt.read_meta(tmp_path / "final")["bamboo"]["parts"]) == 4  # saved by the 3-stage job


@pytest.mark.parametrize("door", DOORS)
def test_every_step_is_audited_and_a_resume_restores_each_processes_random_state(tmp_path, door):
    """``audit_replicas`` audits every step's replicas; a resume in as many processes as saved continues each
    process's random generator where it was saved: the draws after it equal an uninterrupted run's."""
    two = {"nodes": 2, "stages": 2}
    whole = _job(door, tmp_path / "whole", **two, extra=("--audit", "--steps", str(2 * STEPS)))
    assert _summary(whole)["audits"] >= 2 * STEPS, whole[-2000:]  # every step's, at least
    _job(door, tmp_path / "part", **two, extra=("--save-every", str(STEPS)))
    resumed = _job(door, tmp_path / "part", **two, extra=("--resume", "--steps", str(2 * STEPS)))
    after = {key: value for key, value in _draws(resumed).items() if key[1] > STEPS}
    assert len(after) == 2 * STEPS and after == {key: value for key, value in _draws(whole).items() if key[1] > STEPS}


@pytest.mark.parametrize("door", DOORS)
def test_a_spot_notice_hands_the_stage_over_at_a_step_boundary_bit_exact(tmp_path, clean, door):
    """node2's AWS metadata says it will be interrupted: it leaves after the step in flight commits and exits 0,
    its stage served from the replica: the clean run's weights and optimizer state."""
    with aws_metadata_with_a_notice() as url:
        stdout = _job(door, tmp_path, env={"NOTICE_URL": url, "NOTICE_NODE": "node2"})
    assert "node2: leaving after a preemption notice" in stdout, stdout[-3000:]
    assert re.search(r"lost \['node2'\] at step \d+", stdout), stdout[-3000:]  # taken over, not restarted
    _equal_to(tmp_path, clean(door))


@pytest.mark.parametrize("door", DOORS)
def test_a_fatal_loss_restarts_from_the_last_checkpoint_by_itself_bit_exact(tmp_path, clean, door):
    """node1 and node2 (node2's replica holder) SIGKILLed together as step 7 commits: no copy of stage 2 is left.
    node0 and node3 restart the job in their processes as 2 stages from the step-6 checkpoint, and the script goes
    on by itself: the clean run's weights and optimizer state, bit for bit."""
    stdout = _job(door, tmp_path, kill=("node1@apply7", "node2@apply7"), extra=("--save-every", "6"))
    restarts = re.findall(r"(node\d): restarted after a fatal loss at step 8 \(stage 2 \(node node2\) and its replica "
                          r"holder \(node node1\) are both lost.*\) from \S+, step 6, in [\d.]+ s: 2 stage\(s\) "
                          r"x 1 pipeline\(s\) of node0,node3", stdout)
    assert sorted(restarts) == ["node0", "node3"], stdout[-3000:]
    _equal_to(tmp_path, clean(door))


def test_both_doors_train_the_same_job_to_the_same_weights(clean):
    """The same layers, seed, data, optimizer and micro-batches through either door: the same weights and optimizer
    state at the end, bit for bit (the doors are two hosts of one runner, not two trainers)."""
    _equal_to(clean("lightning"), clean("deepspeed"))
