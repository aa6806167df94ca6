"""A bad input under the Bamboo launcher is refused before the job trains: once, in a few lines, without a
traceback, with exit status 2 from the launcher (issue 41: it came after the first step, once per rank, 152 lines)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from lightning_bamboo.errors import CONFIG_EXIT_CODE
from lightning_bamboo.testing.job_output import our_lines
from tests.helpers import PYTHON, launcher_exit_codes, run


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
    # the launcher starts node1 once node0 got past its checks: node0 refused, so node1 never started
    assert launcher_exit_codes(proc.stdout) == {"node0": CONFIG_EXIT_CODE}, proc.stdout[-3000:]
    assert "[launcher] node1: pid" not in proc.stdout
    assert proc.stdout.count("the job was refused before it trained") == 1, proc.stdout[-3000:]
    assert rule in proc.stdout and "trained\n" not in proc.stdout
    assert "Traceback" not in proc.stdout and not re.search(r"warn", proc.stdout, re.I), proc.stdout[-3000:]
    said = our_lines(proc.stdout)
    assert len(said) <= 5, "\n".join(said)


@pytest.mark.timeout(200)
def test_a_mistake_only_some_workers_meet_stops_the_whole_job_before_it_trains():
    """``devices=2`` (2 stages) under ``--nodes 4``: node0 and node1 pass their checks and reach the job's start;
    node2 and node3, workers 2 and 3 of a Trainer with 2 devices a machine, refuse. The refusal ends the whole job
    with status 2: the rule once, no step trained (the job did not start with the nodes that passed)."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, "tests/scripts/bad_input.py",
                "devices"], timeout=180)
    assert proc.returncode == CONFIG_EXIT_CODE, proc.stdout[-3000:]
    codes = launcher_exit_codes(proc.stdout)
    assert CONFIG_EXIT_CODE in (codes["node2"], codes["node3"]), codes
    assert set(codes.values()) <= {CONFIG_EXIT_CODE, -9}, codes  # the others stopped for it, none trained or failed
    assert proc.stdout.count("the job was refused before it trained") == 1, proc.stdout[-3000:]
    assert "devices counts the workers (GPUs) of one machine" in proc.stdout
    assert "trained step" not in proc.stdout and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert "starting with 2 nodes" not in proc.stdout


@pytest.mark.timeout(200)
def test_a_refusal_on_one_machine_stops_every_machines_supervisor_with_its_status():
    """Two machines of two workers (one supervisor each, a shared store); on m0 the Trainer has ``devices=1``, so
    its worker 1 refuses, and m0's supervisor stops its worker 0. m1's workers pass every check: they find the job
    refused when its nodes are lost, and stop too. Both supervisors end with status 2 (not 1), the rule is said once
    for the job, and no step trains."""
    from concurrent.futures import ThreadPoolExecutor

    from lightning_bamboo.membership import resolve_store

    url, server = resolve_store("embedded")
    assert server is not None
    try:
        def machine(name: str) -> Any:
            return run([PYTHON, "-m", "lightning_bamboo.launcher", "--store", url, "--job", "refused", "--node", name,
                        "--peers", "m0,m1", "--workers", "2", "--", PYTHON, "tests/scripts/bad_input.py", "devices"],
                       timeout=180, env={"BAD_INPUT_DEVICES": "1" if name == "m0" else "2"})

        with ThreadPoolExecutor(2) as pool:
            procs = list(pool.map(machine, ["m0", "m1"]))
    finally:
        server.stop()
    output = "".join(p.stdout for p in procs)
    assert [p.returncode for p in procs] == [CONFIG_EXIT_CODE, CONFIG_EXIT_CODE], output[-4000:]
    assert output.count("the job was refused before it trained") == 1, output[-4000:]
    assert "devices counts the workers (GPUs) of one machine" in output
    assert "trained step" not in output and "Traceback" not in output, output[-4000:]


@pytest.mark.timeout(200)
def test_the_deepspeed_door_refuses_a_bad_bamboo_section_once():
    """``lightning_bamboo.initialize`` refuses as the Lightning door does: one message for the job, exit status 2."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "2", "--", PYTHON, "tests/scripts/bad_door.py"],
               timeout=180)
    assert proc.returncode == CONFIG_EXIT_CODE, proc.stdout[-3000:]
    codes = launcher_exit_codes(proc.stdout)
    assert CONFIG_EXIT_CODE in codes.values() and set(codes.values()) <= {CONFIG_EXIT_CODE, -9}, codes
    assert proc.stdout.count("the job was refused before it trained") == 1, proc.stdout[-3000:]
    assert '"bamboo" section: redundancy must be one of' in proc.stdout and "sometimes" in proc.stdout
    assert "trained\n" not in proc.stdout
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    # without what DeepSpeed's PipelineModule prints when it is built (its layers, on rank 0): a plain run prints it
    said = our_lines(proc.stdout)
    assert len(said) <= 5, "\n".join(said)


@pytest.mark.timeout(200)
def test_a_script_that_fails_before_its_job_fails_once():
    """A bug before ``trainer.fit``: one traceback (the first worker's), the others never started, the launcher's
    status 1 (a failure, not a refusal)."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "3", "--", PYTHON, "tests/scripts/bad_input.py",
                "bug"], timeout=180)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert launcher_exit_codes(proc.stdout) == {"node0": 1}, proc.stdout[-3000:]
    assert proc.stdout.count("Traceback") == 1 and "a bug in the user's script" in proc.stdout, proc.stdout[-3000:]
    assert "node0 ended with exit code 1 before it reached the job's start: node1, node2 not started" in proc.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("mistake", "rule"), [
    ("form", "needs batches of the form (inputs, targets), got a list of length 1"),
    ("divisibility", "is not a multiple of micro_batch_size 2"),
    ("precision", "strategy='bamboo' runs precision '32-true', 'bf16-mixed' or '16-mixed'"),
])
def test_under_lightnings_own_launcher_a_bad_input_is_refused_before_any_child_starts(mistake, rule):
    """``python script.py`` with devices=2: Lightning's launcher would start a second process; the options and the
    training data are refused in the launching process first (one message, no child's), as the rule and the user's
    line that met it, without Python's traceback unless BAMBOO_TRACEBACK=1 asks for it."""
    proc = run([PYTHON, "tests/scripts/bad_input.py", mistake], timeout=180)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert rule in proc.stdout and "trained\n" not in proc.stdout
    assert proc.stdout.count("the job was refused before it trained") == 1, proc.stdout[-3000:]
    assert "Initializing distributed" not in proc.stdout, proc.stdout[-3000:]  # no process group, so no child
    assert "Traceback" not in proc.stdout and re.search(r"bad_input\.py:\d+: trainer\.fit\(model\)", proc.stdout), proc.stdout[-3000:]
    said = our_lines(proc.stdout)
    assert len(said) <= 5, "\n".join(said)
    if mistake == "precision":
        full = run([PYTHON, "tests/scripts/bad_input.py", mistake], timeout=180, env={"BAMBOO_TRACEBACK": "1"})
        assert full.returncode != 0 and "Traceback" in full.stdout and "raise BambooConfigError" in full.stdout, full.stdout[-3000:]
