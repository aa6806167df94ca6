"""A bad input under the Bamboo launcher is refused before the job trains: once, in a few lines, without a
traceback, with exit status 2 from the launcher (issue 41: it came after the first step, once per rank, 152 lines)."""

from __future__ import annotations

import re

import pytest

from lightning_bamboo.errors import CONFIG_EXIT_CODE
from tests.helpers import PYTHON, launcher_exit_codes, run

#: what a Trainer prints when it is made, before any of our code runs (the user sees it on every run)
LIGHTNING_TRAINER_LINES = ("GPU available:", "TPU available:", "💡 Tip:")


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mistake", "rule"), [
    ("form", "needs batches of the form (inputs, targets), got a list of length 1"),
    ("divisibility", "the global batch of 7 samples (DataLoader batch_size x the pipelines the job started with) is "
                     "not a multiple of micro_batch_size 2"),
    ("precision", "strategy='bamboo' runs precision '32-true', 'bf16-mixed' or '16-mixed'"),
])
def test_a_bad_input_is_refused_once_before_the_job_trains(mistake, rule):
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "2", "--", PYTHON, "tests/scripts/bad_input.py",
                mistake], timeout=180)
    assert proc.returncode == CONFIG_EXIT_CODE, proc.stdout[-3000:]
    codes = launcher_exit_codes(proc.stdout)
    # the first to refuse exits 2; the launcher stops the other, which refuses too or is killed on the way
    assert sorted(codes) == ["node0", "node1"] and CONFIG_EXIT_CODE in codes.values(), codes
    assert set(codes.values()) <= {CONFIG_EXIT_CODE, -9}, codes
    assert proc.stdout.count("the job was refused before it trained") == 1, proc.stdout[-3000:]
    assert rule in proc.stdout and "trained\n" not in proc.stdout
    assert "Traceback" not in proc.stdout and not re.search(r"warn", proc.stdout, re.I), proc.stdout[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.strip() and not re.match(r"\[launcher\] node\d: pid", line)
            and not line.startswith(LIGHTNING_TRAINER_LINES)]
    assert len(said) <= 5, "\n".join(said)


@pytest.mark.timeout(200)
def test_under_lightnings_own_launcher_a_bad_precision_is_refused_before_any_child_starts():
    """``python script.py`` with devices=2: Lightning's launcher would start a second process; the precision is
    refused in the launching process first (one message, no child's), as the rule and the user's line that met it,
    without Python's traceback unless BAMBOO_TRACEBACK=1 asks for it."""
    proc = run([PYTHON, "tests/scripts/bad_input.py", "precision"], timeout=180)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "strategy='bamboo' runs precision '32-true', 'bf16-mixed' or '16-mixed'" in proc.stdout
    assert "64-true" in proc.stdout and "trained\n" not in proc.stdout
    assert "Initializing distributed" not in proc.stdout, proc.stdout[-3000:]  # no process group, so no child
    assert "Traceback" not in proc.stdout and re.search(r"bad_input\.py:\d+: trainer\.fit\(model\)", proc.stdout), proc.stdout[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith(LIGHTNING_TRAINER_LINES)]
    assert len(said) <= 5, "\n".join(said)
    full = run([PYTHON, "tests/scripts/bad_input.py", "precision"], timeout=180, env={"BAMBOO_TRACEBACK": "1"})
    assert full.returncode != 0 and "Traceback" in full.stdout and "raise BambooConfigError" in full.stdout, full.stdout[-3000:]
