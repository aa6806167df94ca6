"""The examples as their docstrings run them: spot_gpt.py under the Bamboo launcher with a node killed mid-run, and
corpus_gpt.py on a corpus that ``lightning-bamboo prepare`` tokenized from local text files."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import signal
import subprocess

import pytest

from lightning_bamboo import consolidate_checkpoint
from lightning_bamboo.testing import faults
from tests.helpers import PYTHON, REPO, launcher_exit_codes, max_abs_diff, optimizer_states, preloaded, run

pytestmark = pytest.mark.timeout(480)


def test_spot_gpt_trains_on_after_a_kill_and_a_notice_and_logs_the_failovers(tmp_path):
    """node1 is SIGKILLed in step 4 (it kills itself: BAMBOO_FAIL_AT); once the first node reports step 6, node2
    gets a real SIGTERM at the pid its file names (a spot notice, handled by PreemptionCallback's handler):
    it leaves at its next commit and node0 trains on alone. The CSV log shows both failovers."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", **preloaded(), **faults.environment(["node1@4"])}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen(
        [PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "3", "--", PYTHON, "examples/spot_gpt.py", "--steps", "12",
         "--out", str(out), "--checkpoint-every", "5", "--print-every", "2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded by the test's timeout; the finally block kills what is left
            lines.append(line)
            if line.startswith("step 6:"):
                os.kill(int((out / "node2.pid").read_text()), signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(lines)
    assert code == 0, text[-4000:]
    assert re.search(r"exit codes: .*node1=-9", text) and re.search(r"exit codes: .*node2=0", text), text[-2000:]
    assert {p.name for p in out.glob("*.pid")} == {"node0.pid", "node1.pid", "node2.pid"}
    assert "node2: leaving after a preemption notice" in text, text[-3000:]
    # no noise of our making: DeepSpeed's per-step and topology lines, Lightning's warning about the
    # validation_step placeholder of a model without validation data
    assert not re.search(r"samples/sec|Using topology|SEED_LAYERS|validation_step` but have no", text), text[-3000:]
    assert re.search(r"^step 12: loss [\d.]+, nodes node0, failovers 2$", text, re.M), text[-3000:]
    with open(out / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["bamboo/failovers"]]
    assert [(r["bamboo/failovers"], r["bamboo/live_nodes"]) for r in rows] == [("0.0", "3.0"), ("1.0", "2.0"), ("2.0", "1.0")]
    assert all(0 < float(r["bamboo/recovery_seconds"]) < 60 for r in rows[1:])
    assert any(p.name.startswith("step") for p in (out / "checkpoints").iterdir()), "no asynchronous checkpoint"


SPOT_STEPS = 20


def _spot_gpt(out, kill=()):
    """examples/spot_gpt.py for SPOT_STEPS steps under the Bamboo launcher on 4 nodes (an asynchronous checkpoint
    every 5 steps); ``kill``: fault items (``node1@12``). Returns the launcher's output."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, "examples/spot_gpt.py",
                "--steps", str(SPOT_STEPS), "--out", str(out), "--checkpoint-every", "5", "--print-every", "5"],
               timeout=300, env=faults.environment(kill))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def spot_clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("spot_clean")
    _spot_gpt(out)
    return out / "checkpoints" / f"step-{SPOT_STEPS:08d}"


@pytest.mark.parametrize("step, resumed", [(12, "step-00000010"), (3, None)], ids=["from-checkpoint", "from-start"])
def test_a_node_and_its_replica_holder_killed_together_restart_the_job_by_itself_bit_exact(tmp_path, spot_clean,
                                                                                          step, resumed):
    """The example to copy, as a user runs it: node1 and node2 (node2's replica holder) SIGKILLed together, as the
    previous step committed.
    No replica of stage 2 is left, so node0 and node3 restart ``trainer.fit`` in their processes from the last
    complete asynchronous checkpoint (before the first one: from the job's start, with a warning), as 2 stages.
    The launcher exits 0, the survivors 0, and the final checkpoint holds the clean run's weights and optimizer
    state bit for bit."""
    # both die once step - 1 committed everywhere, before they apply it: with nothing sent between the commit and
    # that point, neither can meet the other's loss first (killed at the start of a step, a node slowed by a loaded
    # machine could meet it in the step's start-up, fail it over alone and die in a later failover of its own)
    stdout = _spot_gpt(tmp_path, kill=[f"node1@apply{step - 1}", f"node2@apply{step - 1}"])
    assert launcher_exit_codes(stdout) == {"node0": 0, "node1": -9, "node2": -9, "node3": 0}, stdout[-3000:]
    source = rf"\S+{resumed}, step {int(resumed[5:])}" if resumed else r"the job's start \(no complete checkpoint.*\), step 0"
    restarts = re.findall(rf"(node\d): restarted after a fatal loss at step {step} \(stage 2 \(node node2\) and its "
                          rf"replica holder \(node node1\) are both lost.*\) from {source}, in [\d.]+ s: 2 stage\(s\) x 1 "
                          r"pipeline\(s\) of node0,node3", stdout)
    assert sorted(restarts) == ["node0", "node3"], stdout[-3000:]
    assert ("no complete checkpoint to restart from" in stdout) == (resumed is None)
    assert re.search(rf"^step {SPOT_STEPS}: loss [\d.]+, nodes node0 node3, failovers 1$", stdout, re.M), stdout[-3000:]
    final = tmp_path / "checkpoints" / f"step-{SPOT_STEPS:08d}"
    assert max_abs_diff(consolidate_checkpoint(final), consolidate_checkpoint(spot_clean)) == 0.0
    assert max_abs_diff(optimizer_states(final), optimizer_states(spot_clean)) == 0.0


def test_corpus_gpt_trains_on_local_text_prepared_into_a_token_corpus(tmp_path):
    """This repository's documentation, tokenized by ``lightning-bamboo prepare``, trains a tied GPT of
    ``LayerSpec``s under the launcher with lazy replicas and the callbacks: every node exits 0, the loss falls."""
    data = tmp_path / "corpus"
    prepared = run([PYTHON, "-m", "lightning_bamboo.cli", "prepare", "README.md", "docs", "--out", str(data)],
                   timeout=120, cwd=REPO)
    assert prepared.returncode == 0, prepared.stdout
    assert {p.name for p in data.iterdir()} == {"train.bin", "val.bin", "meta.json"}
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "2", "--", PYTHON, "examples/corpus_gpt.py",
                "--data", str(data), "--steps", "8", "--print-every", "4", "--out", str(tmp_path / "run")],
               timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {"node0": 0, "node1": 0}
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+): train loss ([\d.]+)", proc.stdout, re.M)}
    assert sorted(losses) == [1, 4, 8] and losses[8] < losses[4] < losses[1], proc.stdout[-3000:]
    assert re.search(r"^step 8: val loss [\d.]+$", proc.stdout, re.M), proc.stdout[-3000:]


def test_spot_gpt_yaml_names_classes_that_exist():
    proc = run([PYTHON, "-m", "lightning_bamboo.cli", "fit", "--config", "examples/spot_gpt.yaml", "--print_config"],
               timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for name in ("AsyncCheckpoint", "PreemptionCallback", "RebalanceCallback",
                 "examples.spot_gpt.SpotGPT", "redundancy: lazy"):
        assert name in proc.stdout, (name, proc.stdout[-3000:])
