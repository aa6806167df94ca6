"""Run a benchmark and keep its raw output in ``benchmarks/results/NAME.txt`` with the commit and date.

    python benchmarks/record.py NAME -- python benchmarks/rc_overhead.py --repeats 5
    python benchmarks/record.py NAME --keep-failed -- python benchmarks/chaos.py   # keep a run that missed a target

The file starts with ``#`` header lines (command, commit, date, machine, load average: other work on the
machine slows timings) and then holds the
command's standard output and error exactly as printed (they are also echoed while it runs). The
README quotes numbers only from these files (``tests/test_readme_numbers.py`` checks). The file is
written to a temporary name and renamed when the command has finished, so a result is never half
written; a command that fails leaves the previous result in place and exits with its status, unless
``--keep-failed`` asks to keep its output (a benchmark that measured and missed its target), with its
exit status as the last line.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]


def commit() -> str:
    """The commit the benchmark runs on; ``+dirty`` when the tree has uncommitted changes to tracked files."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.strip()
    return sha + ("+dirty" if dirty else "")


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def header(command: list[str]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return "".join(f"# {key}: {value}\n" for key, value in (
        ("command", shlex.join(command)), ("commit", commit()), ("date", now), ("machine", machine()),
        ("load average at start", " ".join(f"{x:.1f}" for x in os.getloadavg()))))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args or args[1 : args.index("--")] not in ([], ["--keep-failed"]):
        raise SystemExit("usage: python benchmarks/record.py NAME [--keep-failed] -- COMMAND [ARGS...] (NAME is the "
                         "result file's name without .txt; the command follows the --)")
    keep_failed = args.index("--") == 2
    name, command = args[0], args[args.index("--") + 1 :]
    if not command or not name.replace("_", "").replace("-", "").isalnum():
        raise SystemExit(f"record.py needs a NAME of letters, digits, '-' and '_' and a command after '--' (got "
                         f"name {name!r}, command {command!r})")
    RESULTS.mkdir(exist_ok=True)
    target, partial = RESULTS / f"{name}.txt", RESULTS / f".{name}.txt.partial"
    head = header(command)
    with partial.open("w") as out:
        out.write(head)
        out.flush()
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        status = proc.wait()
    if status != 0 and keep_failed:
        with partial.open("a") as out:
            out.write(f"# exit status: {status} (kept with --keep-failed: the benchmark reported a failed target)\n")
    elif status != 0:
        partial.unlink()
        print(f"record.py: {shlex.join(command)} exited with {status}; {target} is unchanged", file=sys.stderr)
        return status
    os.replace(partial, target)
    print(f"record.py: wrote {target.relative_to(REPO)}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
