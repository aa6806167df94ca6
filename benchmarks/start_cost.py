"""What starting the workers costs: CPU seconds and wall seconds of a whole job, its workers started as their own
interpreters against forks of a preloaded one (the launcher's ``--preload``; the demo's nodes start so).

Each case runs ``python -m lightning_bamboo.launcher --nodes N -- python tests/scripts/slow_mlp.py --stages N
--steps S`` (a small MLP: its training costs little, so the job's CPU is mostly what its processes cost to start and
end), alternating the two starts, ``--repeats`` times each. CPU seconds are every process of the job's, counted by
a cgroup of its own (cgroup v1 ``cpuacct``, as root); where none can be made, by the children's resource usage,
which misses processes no one waits for (the communication processes), so it reads lower. Prints the median of
each and the ratios (preloaded / own interpreters).

    python benchmarks/start_cost.py [--nodes 4] [--steps 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import launcher_command, launcher_env

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = "torch,deepspeed,lightning.pytorch,lightning_bamboo.strategy"
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class Meter:
    """CPU seconds of a command and everything it starts."""

    def __init__(self) -> None:
        self.group: Path | None = None
        if CPUACCT.is_dir() and os.access(CPUACCT, os.W_OK):
            group = CPUACCT / f"start_cost_{os.getpid()}"
            try:
                group.mkdir(exist_ok=True)
                self.group = group
            except OSError:
                self.group = None
        self.method = "cgroup cpuacct" if self.group else "children's resource usage (misses unwaited processes)"

    def run(self, cmd: list[str], env: dict[str, str]) -> tuple[int, float, float, str]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        if self.group is not None:
            usage0 = int((self.group / "cpuacct.usage").read_text())
            # the child joins the cgroup before it execs: all it starts is counted there
            tasks = str(self.group / "tasks")
            proc = subprocess.run(["sh", "-c", f'echo $$ > {tasks} && exec "$@"', "sh", *cmd], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - start
            time.sleep(1.0)  # processes that outlive the launcher by a moment (none should) are counted too
            cpu = (int((self.group / "cpuacct.usage").read_text()) - usage0) / 1e9
        else:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return proc.returncode, wall, cpu, proc.stdout + proc.stderr

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.rmdir()
            except OSError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cmd = launcher_command([sys.executable, "tests/scripts/slow_mlp.py", "--stages", str(args.nodes), "--steps",
                            str(args.steps), "--redundancy", "lazy"], nodes=args.nodes)
    base = launcher_env(extra={"PYTHONUNBUFFERED": "1"})
    cases = {"own interpreters": {**base, "BAMBOO_PRELOAD": ""}, "preloaded forks": {**base, "BAMBOO_PRELOAD": PRELOAD}}
    meter = Meter()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    failed = False
    try:
        print(f"{args.nodes} nodes, {args.steps} steps of tests/scripts/slow_mlp.py, redundancy lazy; CPU by {meter.method}; "
              f"preload: {PRELOAD}")
        print(f"{'run':<5} {'workers start as':<18} {'status':>6} {'wall s':>8} {'CPU s':>8}")
        for repeat in range(args.repeats):
            for name in (list(cases) if repeat % 2 == 0 else list(reversed(cases))):
                code, wall, cpu, out = meter.run(cmd, cases[name])
                print(f"{repeat + 1:<5} {name:<18} {code:>6} {wall:>8.2f} {cpu:>8.2f}", flush=True)
                if code != 0:
                    failed = True
                    print("  its output ends:\n  " + "\n  ".join(out.splitlines()[-15:]))
                results[name].append((wall, cpu))
    finally:
        meter.close()
    own = [statistics.median(v) for v in zip(*results["own interpreters"], strict=True)]
    forked = [statistics.median(v) for v in zip(*results["preloaded forks"], strict=True)]
    print(f"median own interpreters: wall {own[0]:.2f} s, CPU {own[1]:.2f} s")
    print(f"median preloaded forks:  wall {forked[0]:.2f} s, CPU {forked[1]:.2f} s")
    print(f"ratio preloaded/own: wall {forked[0] / own[0]:.2f}x, CPU {forked[1] / own[1]:.2f}x "
          f"({os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
