"""One benchmark on two commits, alternating in one run: what a change costs against the code before it.

    python benchmarks/before_after.py --before REV [--rounds 3] -- benchmarks/rc_overhead.py --shapes 2x8 --repeats 1

``REV`` is checked out in a temporary worktree (removed at the end). The benchmark then runs there ("before") and in
this tree ("after") in turn, ``--rounds`` times each, in the order before-after, after-before, ... so that a drift of
the machine's load between the first and the last run hits both sides alike. Each run's output is printed as it
comes. At the end, every line that every run printed (its text with the numbers taken out) is compared: the median
of each of its numbers before and after, and their ratio after / before. Nothing is judged: the reader compares the
ratios with the spread between the runs of one side, which the table also prints.

    python benchmarks/before_after.py --before-outputs B1.txt B2.txt --after-outputs A1.txt A2.txt

compares outputs kept from earlier runs (a recorded result at two commits, ``git show REV:PATH``; runs on another
machine) the same way, running nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from record import commit  # the commit (and +dirty) as every recorded result names it

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def worktree(rev: str, where: Path) -> str:
    """Check ``rev`` out at ``where`` (detached); returns its full commit."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO, capture_output=True,
                         text=True)
    if sha.returncode != 0:
        raise SystemExit(f"--before {rev}: not a commit of this repository ({sha.stderr.strip()})")
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(where), sha.stdout.strip()], cwd=REPO,
                   check=True)
    return sha.stdout.strip()


def run(tree: Path, command: list[str], label: str) -> list[str]:
    """The benchmark in ``tree`` (its package first on the path), its output echoed and returned as lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    print(f"--- {label}: {' '.join(command)} (in {tree})", flush=True)
    proc = subprocess.run([sys.executable, *command], cwd=tree, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{label}: the benchmark exited with {proc.returncode}")
    return proc.stdout.splitlines()


def read_output(path: Path) -> list[str]:
    """The lines of a kept output (a result file's ``#`` header lines are not output)."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (give the kept output of a run)")
    return [line for line in path.read_text().splitlines() if not line.startswith("# ")]


def numbers_by_line(lines: list[str]) -> dict[str, list[float]]:
    """Each output line with numbers, keyed by its text with the numbers replaced by ``#`` (the first such line of a
    text; later repeats get ``[2]``, ``[3]`` ... so that a table's rows stay apart)."""
    out: dict[str, list[float]] = {}
    for line in lines:
        values = [float(n) for n in NUMBER.findall(line)]
        if not values or line.startswith("["):  # a log line (its timestamp): not a result
            continue
        key, k = NUMBER.sub("#", line.strip()), 2
        while key in out:
            key, k = f"{NUMBER.sub('#', line.strip())} [{k}]", k + 1
        out[key] = values
    return out


def compare(before: list[dict[str, list[float]]], after: list[dict[str, list[float]]]) -> list[str]:
    """For every line all runs printed with the same count of numbers: per number, the median before and after,
    their ratio, and each side's range (its noise)."""
    report = []
    keys = [k for k in after[0] if all(k in run and len(run[k]) == len(after[0][k]) for run in [*before, *after])]
    for key in keys:
        cells = []
        for i in range(len(after[0][key])):
            b = [run[key][i] for run in before]
            a = [run[key][i] for run in after]
            mb, ma = statistics.median(b), statistics.median(a)
            if min(b) == max(b) == min(a) == max(a):
                continue  # a constant (a shape, a count): nothing to compare
            ratio = f"{ma / mb:.3f}x" if mb else "n/a"
            cells.append(f"#{i + 1}: before {mb:g} [{min(b):g}-{max(b):g}], after {ma:g} [{min(a):g}-{max(a):g}], "
                         f"after/before {ratio}")
        if cells:
            report.append(key)
            report.extend(f"    {cell}" for cell in cells)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the commit to compare against (e.g. HEAD~3, a sha)")
    parser.add_argument("--before-outputs", nargs="+", type=Path, metavar="FILE",
                        help="instead of running: outputs kept from runs before (compared with --after-outputs)")
    parser.add_argument("--after-outputs", nargs="+", type=Path, metavar="FILE", help="outputs kept from runs after")
    parser.add_argument("--rounds", type=int, default=3, help="runs on each side (default 3)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the benchmark script and its arguments, run with this interpreter")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.before_outputs or args.after_outputs:
        if args.before or command or not (args.before_outputs and args.after_outputs):
            raise SystemExit("--before-outputs and --after-outputs go together, without --before and a benchmark")
        kept = {side: [numbers_by_line(read_output(path)) for path in paths]
                for side, paths in (("before", args.before_outputs), ("after", args.after_outputs))}
        print(f"=== after / before: the median of {len(args.before_outputs)} kept output(s) before and "
              f"{len(args.after_outputs)} after, each side's range in brackets")
        for line in compare(kept["before"], kept["after"]):
            print(line)
        return
    if not args.before:
        raise SystemExit("give --before REV (the commit to compare against), or --before-outputs and --after-outputs")
    if not command:
        raise SystemExit("give the benchmark after --, e.g. -- benchmarks/rc_overhead.py --shapes 2x8")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give at least 1")
    with tempfile.TemporaryDirectory(prefix="bamboo-before-") as tmp:
        tree = Path(tmp) / "tree"
        sha = worktree(args.before, tree)
        try:
            print(f"before: {sha} ({args.before}); after: {commit()} (this tree); "
                  f"{args.rounds} run(s) each, alternating", flush=True)
            runs: dict[str, list[dict[str, list[float]]]] = defaultdict(list)
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for side in order:
                    lines = run(tree if side == "before" else REPO, command, f"{side} {r + 1}/{args.rounds}")
                    runs[side].append(numbers_by_line(lines))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
            subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=False)
    print(f"\n=== after / before: the median of {args.rounds} run(s) per side, each side's range in brackets")
    for line in compare(runs["before"], runs["after"]):
        print(line)


if __name__ == "__main__":
    main()
