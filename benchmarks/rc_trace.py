"""Where redundancy's time goes: every pipeline instruction timed, off vs lazy vs eager steps in the same processes.

Runs ``rc_overhead.py``'s paired configuration (off, lazy and eager alternating step by step, so a
drift of the machine's speed hits all three alike) with each instruction of DeepSpeed's schedule, the
replica's update, the gradient exchange's ship and receive, and the deferred own update wrapped in a
timer, and also counts each process's CPU time (all threads, and the main thread) per step. Prints,
per rank, the mean milliseconds per step of each part in each mode and lazy's difference to off,
averaged over the runs (steps slower than 1.2x their mode's median are left out: a burst of load
elsewhere on the machine). What a part costs on the critical path shows as its difference in the
step time; what it costs the other process shows as slower forwards and backwards there.

    python benchmarks/rc_trace.py [--stages 2] [--micro-batches 8] [--paired-steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import rc_overhead

TIMED = ("train_batch", "apply_step", "_settle_replica")


def instrument(records: list[tuple[int, str, float]]) -> None:
    """Wrap the engine's instructions and the exchange's calls; each appends (step, name, ms)."""
    from lightning_bamboo.engine import exchange, pipe

    engine = pipe.BambooPipelineEngine
    current = [0]

    def timed(name: str, fn: Any, bound: bool = True) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                records.append((current[0], name, (time.perf_counter() - started) * 1e3))
        return wrapper

    engine._INSTRUCTION_MAP = {kind: timed(kind.__name__, fn) for kind, fn in engine._INSTRUCTION_MAP.items()}
    for name in TIMED[1:]:
        setattr(engine, name, timed(name, getattr(engine, name)))
    for name in ("ship", "receive"):
        setattr(exchange.GradientExchange, name, timed(f"exchange.{name}", getattr(exchange.GradientExchange, name)))
    # the copy of the own gradients into the buffer they are sent from, inside ship
    exchange.flat_grads = timed("exchange.ship: copy", exchange.flat_grads)
    train_batch = engine.train_batch

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        current[0] = self.batches_run
        usage, main, started = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
        try:
            return train_batch(self, *args, **kwargs)
        finally:
            after = resource.getrusage(resource.RUSAGE_SELF)
            records.append((current[0], "train_batch", (time.perf_counter() - started) * 1e3))
            records.append((current[0], "cpu, all threads",
                            (after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime) * 1e3))
            records.append((current[0], "cpu, main thread", (time.thread_time() - main) * 1e3))

    engine.train_batch = step


def worker(args: argparse.Namespace) -> None:
    records: list[tuple[int, str, float]] = []
    instrument(records)
    try:
        rc_overhead.worker(args)
    finally:
        rank = os.environ.get("LOCAL_RANK", "0")
        Path(f"{args.out}.rank{rank}").write_text(json.dumps(records))


def run(stages: int, micro_batches: int, steps: int, warmup: int, out: Path) -> dict[int, dict[str, dict[str, float]]]:
    modes = rc_overhead.run_config(stages, micro_batches, "eager", steps, out, rotate=True, warmup=warmup,
                                   script=__file__)["modes"]
    means: dict[int, dict[str, dict[str, float]]] = {}
    for rank in range(stages):
        per_step: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        for step, name, ms in json.loads(Path(f"{out}.rank{rank}").read_text()):
            if warmup <= step < len(modes):  # modes[i] is the mode of step i (0-based, as recorded)
                per_step[step][name] += ms
        means[rank] = {}
        for mode in rc_overhead.MODES:
            steps_of = [s for s in per_step if modes[s] == mode]
            median = statistics.median(per_step[s]["train_batch"] for s in steps_of)
            kept = [s for s in steps_of if per_step[s]["train_batch"] < 1.2 * median]
            names = {name for s in kept for name in per_step[s]}
            means[rank][mode] = {name: statistics.mean(per_step[s][name] for s in kept) for name in names}
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rc_overhead.worker_arguments(parser)
    parser.add_argument("--paired-steps", type=int, default=60, help="steps of each mode per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs (their means are averaged)")
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            steps = args.warmup + len(rc_overhead.MODES) * args.paired_steps
            runs.append(run(args.stages, args.micro_batches, steps, args.warmup, Path(tmp, f"trace-{repeat}.json")))
    print(f"{args.stages} stages x {args.micro_batches} micro-batches, off, lazy and eager alternating step by step, "
          f"{args.paired_steps} steps of each per run, {args.repeats} runs: mean ms per step")
    for rank in range(args.stages):
        print(f"rank {rank} (stage {rank}){'':14}" + "".join(f"{mode:>9}" for mode in rc_overhead.MODES)
              + "  lazy-off")
        names = sorted({name for r in runs for mode in r[rank].values() for name in mode})
        for name in names:
            values = [statistics.mean(r[rank][mode].get(name, 0.0) for r in runs) for mode in rc_overhead.MODES]
            print(f"  {name:30}" + "".join(f"{v:9.2f}" for v in values) + f"  {values[1] - values[0]:+8.2f}")
    step = {mode: statistics.mean(r[0][mode]["train_batch"] for r in runs) for mode in rc_overhead.MODES}
    print("step time x off: " + ", ".join(f"{mode} {step[mode] / step['off']:.3f}" for mode in rc_overhead.MODES))


if __name__ == "__main__":
    main()
