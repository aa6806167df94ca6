"""What a user sees from the command line and from our loggers, checked without training where possible."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from lightning_bamboo import logs
from tests.helpers import PYTHON, REPO, run

pytestmark = pytest.mark.timeout(180)


def test_fit_passes_its_arguments_without_lightning_cli_warning():
    """`lightning-bamboo fit` gave LightningCLI both ``args`` and a non-empty ``sys.argv``, which it warns about."""
    proc = run([PYTHON, "-m", "lightning_bamboo.cli", "fit", "--config", str(REPO / "tests" / "scripts" / "gpt_test.yaml"),
                "--print_config"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"^model:", proc.stdout, re.M) and "micro_batch_size" in proc.stdout  # the config was read
    assert "sys.argv" not in proc.stdout and "args parameter" not in proc.stdout, proc.stdout[-3000:]


def test_our_log_lines_carry_a_timestamp_unless_the_application_configured_logging(monkeypatch):
    stream = io.StringIO()
    handler = next(h for h in logging.getLogger(logs.LOGGER).handlers if isinstance(h, logs._WhenUnconfigured))
    monkeypatch.setattr(handler, "stream", stream)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    logging.getLogger("lightning_bamboo.strategy.bamboo").warning("%s: failover done in %.2f s", "node1", 0.25)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} WARNING node1: failover done in 0\.25 s\n", stream.getvalue())

    configured = io.StringIO()
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler(configured)])
    logging.getLogger("lightning_bamboo.strategy.bamboo").warning("reconfigured")
    assert stream.getvalue().count("\n") == 1 and configured.getvalue() == "reconfigured\n"  # once, the app's way


def test_deepspeed_construction_lines_are_dropped_others_pass(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.delenv("BAMBOO_DEEPSPEED_LOGS", raising=False)
    with logs.deepspeed_prints_hidden():
        print("SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None")
        print("Using topology: {ProcessCoord(pipe=0, data=0): 0}")
        print("ours", end="")
        print(" stays")
    assert out.getvalue() == "ours stays\n" and sys.stdout is out
    monkeypatch.setenv("BAMBOO_DEEPSPEED_LOGS", "1")
    with logs.deepspeed_prints_hidden():
        print("Using topology: {}")
    assert out.getvalue().endswith("Using topology: {}\n")


def test_log_level_from_the_environment():
    shown = run([PYTHON, "-c", "import logging, lightning_bamboo; print(logging.getLogger('lightning_bamboo').level)"],
                timeout=60, env={"BAMBOO_LOG_LEVEL": "info"})
    assert shown.returncode == 0 and shown.stdout.strip().splitlines()[-1] == "20", shown.stdout
    refused = run([PYTHON, "-c", "import lightning_bamboo"], timeout=60, env={"BAMBOO_LOG_LEVEL": "loud"})
    assert refused.returncode != 0 and "BAMBOO_LOG_LEVEL='LOUD' is not a logging level" in refused.stdout, refused.stdout
