"""How fast and how briefly a bad input is refused (issue 41): seconds from the command to its exit, lines printed.

Each bad input of ``tests/scripts/bad_input.py`` (batches without targets, a batch size that is not a
multiple of the micro-batch size, a precision the engine does not run) is started two ways:

* under the Bamboo launcher, ``python -m lightning_bamboo.launcher --nodes N -- python bad_input.py MISTAKE``:
  the launcher does not import the user's script; it starts the first worker alone and the others only once
  that one is past its checks, so the first worker refuses before the others start (it prints the rule
  once, and the launcher exits with status 2); once as it starts on a GPU machine, with each worker's own
  interpreter, and once with ``--preload torch,lightning,deepspeed`` (forks of one preloaded interpreter);
* the DeepSpeed door's bad ``"bamboo"`` section (``tests/scripts/bad_door.py``) under the Bamboo launcher: it
  is read in ``lightning_bamboo.initialize``, after the job's rendezvous, so every worker has started;
* as a plain script (``python bad_input.py MISTAKE``, ``devices=2``: Lightning's own launcher), where the
  Trainer's options and the training data (the module's ``train_dataloader()``) are refused in the launching
  process before any child starts.

Prints, per case: the exit status, the seconds from start to exit, the lines printed (without the
launcher's own pid lines and Lightning's "GPU available" banner, which every run prints), and whether the
rule was in them. Bounds: 10 s and 5 lines. Exits 1 if a case is not refused (status 0 or no rule printed).

    python benchmarks/refusal.py [--nodes 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import launcher_command, launcher_env  # (benchmarks/: the script's folder)

from lightning_bamboo.testing.job_output import our_lines

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "bad_input.py"
DOOR_SCRIPT = ROOT / "tests" / "scripts" / "bad_door.py"
RULES = {
    "form": "needs batches of the form (inputs, targets)",
    "divisibility": "is not a multiple of micro_batch_size 2",
    "precision": "strategy='bamboo' runs precision '32-true', 'bf16-mixed' or '16-mixed'",
    "bamboo section": '"bamboo" section: redundancy must be one of',
}
PRELOAD = "torch,lightning,deepspeed"
SECONDS_BOUND, LINES_BOUND = 10.0, 5


def run(cmd: list[str]) -> tuple[int, float, list[str]]:
    env = launcher_env(unset=("BAMBOO_PRELOAD",))  # (the plain script's run gets the same environment)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    seconds = time.perf_counter() - start
    lines = our_lines(proc.stdout + proc.stderr)
    return proc.returncode, seconds, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs per case (the median time is printed)")
    args = parser.parse_args()
    cases = [(f"Bamboo launcher, {args.nodes} nodes{', preloaded' if preload else ''}", mistake,
              launcher_command([sys.executable, str(SCRIPT), mistake, "--stages", str(args.nodes)], nodes=args.nodes,
                               options=["--preload", PRELOAD] if preload else ()))
             for preload in (False, True) for mistake in ("form", "divisibility", "precision")]
    cases.append(("DeepSpeed door, 2 nodes", "bamboo section",
                  launcher_command([sys.executable, str(DOOR_SCRIPT)], nodes=2)))
    cases += [("plain script, Lightning's launcher", mistake, [sys.executable, str(SCRIPT), mistake])
              for mistake in ("form", "divisibility", "precision")]
    print(f"{'how it is started':<40} {'mistake':<15} {'status':>6} {'seconds':>8} {'lines':>6}  rule printed")
    wrong = []
    for how, mistake, cmd in cases:
        results = [run(cmd) for _ in range(args.repeats)]
        codes = {code for code, _, _ in results}
        seconds = statistics.median(s for _, s, _ in results)
        lines = max(len(said) for _, _, said in results)
        ruled = all(RULES[mistake] in "\n".join(said) for _, _, said in results)
        print(f"{how:<40} {mistake:<15} {'/'.join(map(str, sorted(codes))):>6} {seconds:>8.2f} {lines:>6}  "
              f"{'yes' if ruled else 'NO'}")
        if 0 in codes or not ruled:
            wrong.append((how, mistake, results[-1][2][-20:]))
        over = [f"{seconds:.1f} s > {SECONDS_BOUND:g} s"] if seconds > SECONDS_BOUND else []
        over += [f"{lines} lines > {LINES_BOUND}"] if lines > LINES_BOUND else []
        if over:
            print(f"  missed the bound: {', '.join(over)}")
    for how, mistake, tail in wrong:
        print(f"NOT REFUSED: {how}, {mistake}; its output ends:\n  " + "\n  ".join(tail))
    print(f"bounds: refused within {SECONDS_BOUND:g} s in at most {LINES_BOUND} lines (median of {args.repeats} runs; "
          f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f})")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
