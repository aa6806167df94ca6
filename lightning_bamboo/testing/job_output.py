"""Reading and running a launcher's job from outside it, for the tests and the benchmarks alike: each node's exit
code from the launcher's summary line, the JSON reports its workers print, and a command run in a process group of
its own that leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["json_reports", "launcher_exit_codes", "run_in_group"]

#: the line the local launcher prints when its job ended (``[launcher] exit codes: node0=0, node1=-9``)
EXIT_CODES_LINE = "[launcher] exit codes: "


def launcher_exit_codes(output: str) -> dict[str, int]:
    """Each node's exit code from the local launcher's ``[launcher] exit codes: node0=0, node1=-9`` line in
    ``output`` (empty if it printed none)."""
    return {node: int(code) for line in output.splitlines() if line.startswith(EXIT_CODES_LINE)
            for node, code in (item.split("=") for item in line.removeprefix(EXIT_CODES_LINE).split(", "))}


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
