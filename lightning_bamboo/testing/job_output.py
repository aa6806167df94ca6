"""Reading and running a launcher's job from outside it, for the tests and the benchmarks alike: each node's exit
code from the launcher's summary line, the JSON reports its workers print, a command run in a process group of
its own that leaves no process behind, and the demo run as a user runs it (``run_demo``, every benchmark's way to
start one)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = ["DEMO", "json_reports", "launcher_exit_codes", "our_lines", "run_demo", "run_in_group"]

#: ``lightning-bamboo demo`` with this interpreter
DEMO = (sys.executable, "-m", "lightning_bamboo.cli", "demo")
#: seconds a demo asked to stop (SIGTERM: it stops its workers) has before its whole group is killed
DEMO_STOP_GRACE = 30.0

#: the line the local launcher prints when its job ended (``[launcher] exit codes: node0=0, node1=-9``)
EXIT_CODES_LINE = "[launcher] exit codes: "


def launcher_exit_codes(output: str) -> dict[str, int]:
    """Each node's exit code from the local launcher's ``[launcher] exit codes: node0=0, node1=-9`` line in
    ``output`` (empty if it printed none)."""
    return {node: int(code) for line in output.splitlines() if line.startswith(EXIT_CODES_LINE)
            for node, code in (item.split("=") for item in line.removeprefix(EXIT_CODES_LINE).split(", "))}


#: what Lightning's Trainer prints when it is made, before any of our code runs (a user sees it on every run)
TRAINER_BANNER = ("GPU available:", "TPU available:", "HPU available:", "💡 Tip:")
#: what DeepSpeed's PipelineModule prints when it is built, on rank 0 (a plain DeepSpeed run prints it too)
PIPELINE_MODULE_LINE = re.compile(r"SEED_LAYERS=|Using topology:|stage=\d+ layers=|\s+\d+: |\s+loss: ")
#: the local launcher's line naming a worker's process
WORKER_PID_LINE = re.compile(r"\[launcher\] node\d+: pid")


def our_lines(output: str) -> list[str]:
    """The lines of a job's ``output`` that this project printed: not blank, not the launcher's line for each worker's
    process, and none of what Lightning's Trainer and DeepSpeed's PipelineModule print on every run."""
    return [line for line in output.splitlines() if line.strip() and not WORKER_PID_LINE.match(line)
            and not line.startswith(TRAINER_BANNER) and not PIPELINE_MODULE_LINE.match(line)]


def json_reports(output: str) -> list[dict]:
    """The one-line JSON objects that start with ``{"node": `` in ``output`` (a worker's reports, as
    ``tests/scripts/slow_mlp.py`` prints them), also where processes' lines interleave."""
    return [json.loads(found) for found in re.findall(r'\{"node": [^{}]*\}', output)]


def run_in_group(cmd: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own, its output and errors captured together; past ``timeout`` seconds its
    whole process group is killed and ``subprocess.TimeoutExpired`` raised (its ``output``: what came until then). Whatever happens, the group is killed at
    the end: no child it started outlives it."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env) if env is not None else None, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise subprocess.TimeoutExpired(list(cmd), timeout, output=out) from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, None)


def run_demo(args: Sequence[str], log: Path | None, timeout: float, env: Mapping[str, str] | None = None,
             cwd: str | Path | None = None, lines: list[tuple[float, str]] | None = None) -> int | None:
    """``lightning-bamboo demo ARGS`` in a session of its own, its output and errors written to ``log`` (None:
    discarded), or with ``lines`` given each output line appended as ``(seconds since the start, text)``. Past
    ``timeout`` seconds it is asked to stop (SIGTERM: the demo stops its workers), and its whole group is killed
    ``DEMO_STOP_GRACE`` s later if it has not; whatever happens, no process of its group outlives the call. Returns
    its exit status, or None when it was stopped."""
    out: int | IO[str] = subprocess.PIPE if lines is not None else log.open("w") if log is not None else subprocess.DEVNULL
    start = time.monotonic()
    proc = subprocess.Popen([*DEMO, *args], cwd=cwd, env=dict(env) if env is not None else None, stdout=out,
                            stderr=subprocess.DEVNULL if lines is not None else subprocess.STDOUT, text=True,
                            start_new_session=True)
    stopped = threading.Event()

    def stop() -> None:  # past the timeout, even while no line comes: SIGTERM, then the group after the grace
        stopped.set()
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=DEMO_STOP_GRACE)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    timer.start()
    try:
        if lines is not None:
            assert proc.stdout is not None
            for text in proc.stdout:  # ends when the group's last writer is gone
                lines.append((time.monotonic() - start, text.rstrip("\n")))
        code = proc.wait()
        return None if stopped.is_set() else code
    finally:
        timer.cancel()
        timer.join()  # a stop under way finishes first
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if not isinstance(out, int):
            out.close()
