"""``benchmarks/before_after.py``: how two commits' outputs of one benchmark are compared, and its refusals.

The runs themselves are a benchmark's; what is compared is a function of their output lines alone, checked here
through ``--before-outputs``/``--after-outputs`` (kept outputs, nothing run) with lines shaped like
``rc_overhead.py``'s.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

SCRIPT = str(REPO / "benchmarks" / "before_after.py")


def _run(off: float, lazy: float, failover: float) -> list[str]:
    return [
        "[2026-12-02 02:00:00,000] [WARNING] a log line with a timestamp",
        "stages micro-b  mode   step ms  x off",
        f"     2       8   off     {off:.1f}  1.000",
        f"     2       8  lazy     {lazy:.1f}  {lazy / off:.3f}",
        f"lazy recovery at 4 stages (node2 SIGKILLed at step 10): failover {failover:.2f} s",
        f"     2       8   off     {off + 1:.1f}  1.000",  # a second table's row of the same text stays apart
    ]


def _compare(tmp: Path, before: list[list[str]], after: list[list[str]]) -> list[str]:
    """The report of ``before_after.py`` on these outputs, kept as files (a result file's header first)."""
    files: dict[str, list[str]] = {"before": [], "after": []}
    for side, runs in (("before", before), ("after", after)):
        for i, lines in enumerate(runs):
            path = tmp / f"{side}{i}.txt"
            path.write_text("# command: benchmarks/rc_overhead.py --shapes 2x8\n# date: 2026-12-02T02:00:00Z\n"
                            + "\n".join(lines) + "\n")
            files[side].append(str(path))
    proc = subprocess.run([sys.executable, SCRIPT, "--before-outputs", *files["before"], "--after-outputs",
                           *files["after"]], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[1:]  # after its heading


def test_lines_are_matched_by_their_text_and_each_number_compared(tmp_path):
    report = "\n".join(_compare(tmp_path, [_run(200.0, 204.0, 0.50), _run(210.0, 214.0, 0.60)],
                                [_run(220.0, 231.0, 0.55), _run(220.0, 229.0, 0.65)]))
    # the off row: 205 before (200-210), 220 after, 1.073x; the constant columns (2, 8, 1.000) are left out
    assert "#3: before 205 [200-210], after 220 [220-220], after/before 1.073x" in report
    assert "#1:" not in report.split("\n")[1]
    assert "failover # s" in report and "before 0.55 [0.5-0.6], after 0.6 [0.55-0.65], after/before 1.091x" in report
    assert "[2]" in report  # the repeated row text is its own line
    assert "WARNING" not in report  # log lines are no result
    assert "date" not in report and "command" not in report  # nor a result file's header


def test_a_line_missing_from_one_run_is_not_compared(tmp_path):
    full = _run(200.0, 204.0, 0.5)
    short = [line for line in _run(210.0, 214.0, 0.6) if "recovery" not in line]
    report = _compare(tmp_path, [full], [short])
    assert report and all("recovery" not in line for line in report)


def test_refusals_name_the_fix():
    script = str(REPO / "benchmarks" / "before_after.py")
    no_rev = subprocess.run([sys.executable, script, "--before", "no-such-rev", "--", "x.py"], capture_output=True,
                            text=True, timeout=60)
    assert no_rev.returncode != 0 and "--before no-such-rev: not a commit" in no_rev.stderr
    no_command = subprocess.run([sys.executable, script, "--before", "HEAD"], capture_output=True, text=True, timeout=60)
    assert no_command.returncode != 0 and "give the benchmark after --" in no_command.stderr
    half = subprocess.run([sys.executable, script, "--before-outputs", script], capture_output=True, text=True,
                          timeout=60)
    assert half.returncode != 0 and "--before-outputs and --after-outputs go together" in half.stderr
