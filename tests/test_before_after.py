"""``benchmarks/before_after.py``: how two commits' outputs of one benchmark are compared, and its refusals.

The runs themselves are a benchmark's; what is compared is a pure function of their output lines, checked here
against lines shaped like ``rc_overhead.py``'s.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))  # its sibling record.py, as when it runs as a script
SPEC = importlib.util.spec_from_file_location("bench_before_after", REPO / "benchmarks" / "before_after.py")
assert SPEC is not None and SPEC.loader is not None
before_after = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(before_after)


def _run(off: float, lazy: float, failover: float) -> list[str]:
    return [
        "[2026-12-02 02:00:00,000] [WARNING] a log line with a timestamp",
        "stages micro-b  mode   step ms  x off",
        f"     2       8   off     {off:.1f}  1.000",
        f"     2       8  lazy     {lazy:.1f}  {lazy / off:.3f}",
        f"lazy recovery at 4 stages (node2 SIGKILLed at step 10): failover {failover:.2f} s",
        f"     2       8   off     {off + 1:.1f}  1.000",  # a second table's row of the same text stays apart
    ]


def test_lines_are_matched_by_their_text_and_each_number_compared():
    before = [before_after.numbers_by_line(_run(200.0, 204.0, 0.50)), before_after.numbers_by_line(_run(210.0, 214.0, 0.60))]
    after = [before_after.numbers_by_line(_run(220.0, 231.0, 0.55)), before_after.numbers_by_line(_run(220.0, 229.0, 0.65))]
    report = "\n".join(before_after.compare(before, after))
    # the off row: 205 before (200-210), 220 after, 1.073x; the constant columns (2, 8, 1.000) are left out
    assert "#3: before 205 [200-210], after 220 [220-220], after/before 1.073x" in report
    assert "#1:" not in report.split("\n")[1]
    assert "failover # s" in report and "before 0.55 [0.5-0.6], after 0.6 [0.55-0.65], after/before 1.091x" in report
    assert "[2]" in report  # the repeated row text is its own line
    assert "WARNING" not in report  # log lines are no result


def test_a_line_missing_from_one_run_is_not_compared():
    full = before_after.numbers_by_line(_run(200.0, 204.0, 0.5))
    short = dict(full)
    short.pop(next(k for k in full if "recovery" in k))
    assert all("recovery" not in line for line in before_after.compare([full], [short]))


def test_refusals_name_the_fix():
    script = str(REPO / "benchmarks" / "before_after.py")
    no_rev = subprocess.run([sys.executable, script, "--before", "no-such-rev", "--", "x.py"], capture_output=True,
                            text=True, timeout=60)
    assert no_rev.returncode != 0 and "--before no-such-rev: not a commit" in no_rev.stderr
    no_command = subprocess.run([sys.executable, script, "--before", "HEAD"], capture_output=True, text=True, timeout=60)
    assert no_command.returncode != 0 and "give the benchmark after --" in no_command.stderr
