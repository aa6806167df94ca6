"""Record results again from the commands their files name: ``make bench`` runs the README's.

    python benchmarks/rerecord.py --all               # every result whose command runs on this machine
    python benchmarks/rerecord.py --readme            # every result the README's numbers table cites
    python benchmarks/rerecord.py memory sim_ettr      # these (benchmarks/results/NAME.txt)
    python benchmarks/rerecord.py --readme --list      # what would run, and what cannot here

Every result file starts with the command that printed it (``record.py``'s ``# command:`` header). This runs each
again through ``record.py`` under the same name, in the order they were first recorded (a file that reads what an
earlier one kept comes after it), with this interpreter in place of the one the header names. A command written for
another machine (a GPU's, a worktree of another commit, a hand-edited excerpt) cannot run as written: it is listed
and skipped, and the exit status says so.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
#: a header holding one of these was not a command to run here as written
NOT_HERE = ("<", "GPU machine", "worktree", "(run ", "(under ")
INTERPRETERS = re.compile(r"^(?:\S*/)?python3?$")


def header(name: str) -> dict[str, str]:
    """The ``# key: value`` lines at the top of ``results/NAME.txt``."""
    found = {}
    for line in (RESULTS / f"{name}.txt").read_text().splitlines():
        if not line.startswith("# "):
            break
        key, _, value = line[2:].partition(": ")
        found[key] = value
    return found


def command(name: str) -> list[str] | None:
    """The command of ``results/NAME.txt`` with this interpreter, or None where it cannot run here as written."""
    text = header(name).get("command", "")
    if not text or any(mark in text for mark in NOT_HERE):
        return None
    argv = shlex.split(text)
    if "--reports" in argv:  # memory.py's cache of measured jobs: a record again measures them again
        at = argv.index("--reports")
        del argv[at:at + 2]
    return [sys.executable if INTERPRETERS.match(arg) and i == 0 else arg for i, arg in enumerate(argv)]


def readme_results() -> list[str]:
    """The result files the README's numbers table cites (by name, without ``.txt``)."""
    readme = (REPO / "README.md").read_text()
    table = readme.split("\n## Numbers\n", 1)[1].split("\n## ", 1)[0]
    return sorted({m for m in re.findall(r"`([a-z0-9_]+)\.txt`", table) if (RESULTS / f"{m}.txt").exists()})


def all_results() -> list[str]:
    """Every result file in ``results/`` (by name, without ``.txt``)."""
    return sorted(path.stem for path in RESULTS.glob("*.txt"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="result names (benchmarks/results/NAME.txt)")
    p.add_argument("--readme", action="store_true", help="every result the README's numbers table cites")
    p.add_argument("--all", action="store_true", help="every result whose command runs here (those written for "
                   "another machine are listed, not run, and do not fail the call)")
    p.add_argument("--list", action="store_true", help="print what would run and what cannot, run nothing")
    args = p.parse_args(argv)
    chosen = set(args.names) | set(readme_results() if args.readme else ()) | set(all_results() if args.all else ())
    names = sorted(chosen, key=lambda n: header(n).get("date", ""))
    if not names:
        p.error("name a result, or pass --readme or --all")
    runnable = {n: command(n) for n in names}
    skipped = [n for n, c in runnable.items() if c is None]
    for name in names:
        cmd = runnable[name]
        print(f"{name}: " + (shlex.join(cmd) if cmd else f"not here ({header(name).get('command', 'no command')})"),
              flush=True)
        if cmd is not None and not args.list:
            code = subprocess.run([sys.executable, str(RESULTS.parent / "record.py"), name, "--keep-failed", "--", *cmd],
                                  cwd=REPO).returncode
            print(f"{name}: exit {code}", flush=True)
    if skipped:
        print(f"not run here ({len(skipped)}): {', '.join(skipped)}")
    # a result named, or cited by the README, must be recordable here; --all alone runs what can
    required = [n for n in skipped if n in set(args.names) | set(readme_results() if args.readme else ())]
    return 1 if required and not args.list else 0


if __name__ == "__main__":
    sys.exit(main())
