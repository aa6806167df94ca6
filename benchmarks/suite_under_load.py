"""`make test` on a fresh clone, several times in a row, with CPU-bound processes running beside it.

A newcomer's machine is rarely idle: the suite must be green there too. This clones the repository's HEAD into a
temporary directory (the Makefile installs everything from nothing there), starts ``--burners`` busy loops, runs
``make test`` ``--runs`` times and prints, per run, its exit status, its seconds and pytest's summary lines, then
the number of green runs. It removes the clone and stops the busy loops at the end, also when interrupted.

    python benchmarks/suite_under_load.py [--runs 3] [--burners 1]

Exits 1 unless every run was green.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: pytest's last line of a part of ``make test`` ("1114 passed, 12 skipped in 855.06s (0:14:15)")
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed)\b.*?)\s*=*$")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--burners", type=int, default=1, help="busy loops beside the suite (each takes a core)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    root = Path(tempfile.mkdtemp(prefix="bamboo-suite-"))
    burners: list[subprocess.Popen] = []
    green = 0
    try:
        clone = root / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", head], cwd=clone, check=True)
        print(f"fresh clone of {head[:12]}; {args.burners} busy loop(s) beside the suite", flush=True)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
        for run in range(1, args.runs + 1):
            started = time.monotonic()
            done = subprocess.run(["make", "test"], cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
            seconds = time.monotonic() - started
            summaries = [m[1] for line in done.stdout.splitlines() if (m := SUMMARY.match(line.strip()))]
            failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
            green += done.returncode == 0
            print(f"run {run}: exit {done.returncode} in {seconds:.0f} s; " + " | ".join(summaries), flush=True)
            for line in failures:
                print(f"    {line}", flush=True)
            if done.returncode != 0:  # what failed, as pytest said it (its first 200 lines), to find why
                text = done.stdout
                start = text.find("= FAILURES =")
                print("\n".join(text[start:].splitlines()[:200]) if start >= 0 else text[-3000:], flush=True)
        load = os.getloadavg()
        print(f"\n{green} of {args.runs} runs green (load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
              f"on {os.cpu_count()} cores)")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        shutil.rmtree(root, ignore_errors=True)
    return 0 if green == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
