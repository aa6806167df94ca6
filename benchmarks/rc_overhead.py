"""Cost of redundant computation: step time and peak memory per process, off vs lazy vs eager, and recovery time.

One run measures, on the same GPT and data: redundancy "off", "lazy" and "eager" at 2 and 4 stages
with 4 and 8 micro-batches (median step time after warm-up, peak RSS per process), then 4-stage
lazy and eager runs under the Bamboo launcher in which node 2 is SIGKILLed, reporting the failover
time and the time from the kill to the next completed step. Prints a table and ratios to "off".
Targets (issue 3): eager <= 1.10x and lazy <= 1.03x step time at 2 stages x 8 micro-batches;
recovery <= 5 s + one step.

    python benchmarks/rc_overhead.py [--steps 20] [--warmup 5] [--repeats 3] [--shapes 2x8,4x8] [--record]
    python benchmarks/rc_overhead.py --pipelines 2 --modes off,lazy,auto --shapes 2x8 --no-kills   # issue 63

``--pipelines P`` runs every shape as P data-parallel pipelines (P x stages processes); ``--modes`` picks the
redundancy modes compared (``auto``: replicas only of stages with no data-parallel copy on another machine; each
process spawned by Lightning is its own machine, so at 2 pipelines auto keeps none, and in the paired runs an auto
step holds what ``topology.replicas`` decides for the layout).

With ``--record`` it writes eager's overhead at 2 x 8 and its failover pause to the simulator's
``redundancy_overhead`` and ``failover_seconds`` defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import BenchGPT, add_worker_flag, launcher_command, launcher_env, self_command

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_embd=192)  # 8 pipeline layers
MICRO = 2


def config_for(block_size: int, n_embd: int = CONFIG.n_embd) -> GPTConfig:
    """The benchmark GPT with sequences of ``block_size`` tokens (the parameters barely change) and width ``n_embd``
    (``--n-embd``: a wider model, whose weights and AdamW state outweigh the framework's own memory)."""
    return dataclasses.replace(CONFIG, block_size=block_size, n_embd=n_embd)

MODES = ("off", "lazy", "eager")
#: every mode ``--modes`` may name
ALL_MODES = ("off", "lazy", "eager", "auto")
#: "PRECISION:CLIP" for every worker of the call (``--precision``, ``--clip``)
PRECISION_ENV = "BAMBOO_BENCH_PRECISION"
PRECISION_CONFIGS = {"32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}


def worker(args: argparse.Namespace) -> None:
    import lightning_bamboo

    batch = MICRO * args.micro_batches

    class Timer(pl.Callback):
        times: list[float] = []
        ends: list[float] = []

        def on_train_batch_start(self, *_):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_):
            self.times.append(time.perf_counter() - self.start)
            self.ends.append(time.time())

    timer = Timer()
    modes = tuple(args.modes.split(","))
    rotate = Rotate(args.warmup, modes)
    precision, clip = os.environ.get(PRECISION_ENV, "32:0").split(":")
    strategy = lightning_bamboo.BambooStrategy(
        stages=args.stages, micro_batch_size=MICRO, partition="uniform", seed=0, redundancy=args.redundancy,
        detection_timeout=5, process_group_backend=args.backend or None, config=PRECISION_CONFIGS[precision],
    )
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.stages * args.pipelines, max_steps=args.steps,
                         gradient_clip_val=float(clip) or None,
                         callbacks=[timer, rotate] if args.rotate else [timer], logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False)
    trainer.fit(BenchGPT(config_for(args.block_size, args.n_embd), args.steps * batch * args.pipelines, batch))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * torch.distributed.get_world_size()
    replica = strategy.engine.replica
    torch.distributed.all_gather_object(gathered, (peak, dict(strategy.engine.replica_seconds),
                                                   replica.stage if replica is not None else None))
    if trainer.is_global_zero:
        res = strategy.resilience
        Path(args.out).write_text(json.dumps({
            "times": timer.times, "ends": timer.ends, "peak_bytes": [g[0] for g in gathered],
            "replica_seconds": [g[1] for g in gathered], "replicas": [g[2] for g in gathered],
            "failovers": [f.as_dict() for f in res.failovers] if res is not None else [],
            "modes": rotate.modes,
        }))


class Rotate(pl.Callback):
    """Switches the engine between ``modes`` ("off", "lazy" and "eager" by default; "auto") at every step, after
    ``warmup`` eager steps (lazy ones when eager is not compared).

    Off, lazy and eager steps then alternate in the same processes, so a drift of the machine's speed
    (tens of percent here between runs minutes apart) hits the three modes alike. The engine is built
    with redundancy="eager" (or "lazy"); an "off" step runs without replica and exchange (a plain DeepSpeed step),
    a "lazy" step without the redundant forwards, an "auto" step with the replicas and exchange peers
    ``topology.replicas`` keeps for the layout (the program without the others' actions). Each redundant step pays
    one replica update (the one the redundant step before it deferred) and one gradient exchange, as in a run of
    that mode alone.
    """

    def __init__(self, warmup: int, modes: tuple[str, ...] = MODES) -> None:
        self.warmup, self.rotation, self.modes, self.saved = warmup, modes, [], None

    def on_train_batch_start(self, trainer, *_):
        from lightning_bamboo.topology.replicas import held_stage, kept_replicas, replica_peers

        strategy = trainer.strategy
        engine = strategy.engine
        if self.saved is None:
            self.saved = (engine.replica, engine.replica_peers, engine.options)
        replica, peers, options = self.saved
        step = len(self.modes)
        # the warm-up is eager: its steps 1-3 measure the costs eager places its forwards with
        warm = "eager" if "eager" in self.rotation else "lazy"
        mode = warm if step < self.warmup else self.rotation[(step - self.warmup) % len(self.rotation)]
        engine.kept = None
        if mode == "off":
            engine.replica, engine.replica_peers = None, (None, None)
        elif mode == "auto":
            layout, rank = strategy.layout, trainer.global_rank
            kept = kept_replicas(strategy.runner.nodes, layout.stages, "auto")
            engine.replica = replica if held_stage(layout, rank, kept) is not None else None
            engine.replica_peers, engine.kept = replica_peers(layout, rank, kept), kept
        else:
            engine.replica, engine.replica_peers = replica, peers
        keep_exchange(engine, self, "off" if engine.replica is None and engine.replica_peers == (None, None) else mode)
        engine.options = dataclasses.replace(options, redundancy="eager" if mode == "eager" else "lazy")
        self.modes.append(mode)


def keep_exchange(engine, holder, mode: str) -> None:
    """Keep the gradient exchange across an off step: the same one serves the next redundant step.

    Its sends in flight, and a replica update still due with its "read" unanswered, carry over the off step to
    the next redundant step, as they would to the next step of a lazy run. Under the Bamboo launcher an off step
    still defers its update to the commit (a real "off" run there commits every step too), and the engine builds
    an exchange without peers for it; without this, the next redundant step would build a fresh exchange (a new
    shared-memory handshake, gradients over the process group meanwhile) that a run of that mode alone builds
    once.
    """
    kept = getattr(holder, "kept_exchange", None)
    if mode == "off":
        key = engine._exchange_key
        if key is not None and key[0] is not None:
            holder.kept_exchange = (engine._exchange, key)
    elif kept is not None:
        engine._exchange, engine._exchange_key = kept
        holder.kept_exchange = None


def run_config(stages: int, micro_batches: int, redundancy: str, steps: int, out: Path, kill: str | None = None,
               block_size: int = CONFIG.block_size, rotate: bool = False, warmup: int = 5, script: str = __file__,
               backend: str = "", n_embd: int = CONFIG.n_embd, launcher: bool = False, pipelines: int = 1,
               modes: tuple[str, ...] = MODES) -> dict:
    """Run ``script``'s worker (this one's, or one that wraps it) on a fresh set of processes; its result.

    ``launcher`` (always with a ``kill``): under the Bamboo launcher, with the membership failover needs (every
    step commits, in every mode); without it Lightning spawns the workers and no step commits. ``pipelines``:
    data-parallel pipelines (``pipelines * stages`` processes); ``modes``: the rotation of a ``rotate`` run."""
    env = launcher_env(kills=[kill] if kill else (), extra={"PYTHONWARNINGS": "ignore"})
    cmd = self_command(script, "worker", "--stages", stages, "--micro-batches", micro_batches, "--redundancy", redundancy,
                       "--steps", steps, "--out", out, "--block-size", block_size, "--warmup", warmup)
    if n_embd != CONFIG.n_embd:
        cmd += ["--n-embd", str(n_embd)]
    if pipelines != 1:
        cmd += ["--pipelines", str(pipelines)]
    if modes != MODES:
        cmd += ["--modes", ",".join(modes)]
    if rotate:
        cmd.append("--rotate")
    if backend:
        cmd += ["--backend", backend]
    if kill or launcher:
        cmd = launcher_command(cmd, nodes=stages * pipelines)
    started = time.time()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    result = json.loads(out.read_text())
    result["started"] = started
    return result


def record(key: str, value: float, how: str) -> None:
    """Write one of the simulator's defaults (lightning_bamboo/data/sim_params.json), measured by this run."""
    import datetime
    import platform

    from lightning_bamboo.sim.params import record_measurement

    record_measurement(key, value, f"benchmarks/rc_overhead.py, {datetime.date.today().isoformat()}, "
                                   f"{platform.node() or 'this machine'}: {os.cpu_count()}-core CPU, no GPU, gloo; {how}")
    print(f"recorded {key} = {value} in lightning_bamboo/data/sim_params.json")


def record_overhead(overhead: float, args: argparse.Namespace) -> None:
    """The simulator's ``redundancy_overhead`` default (Bamboo runs eager RC) from this run."""
    record("redundancy_overhead", round(max(0.0, overhead), 3),
           f"eager vs off step time - 1 at 2 stages x 8 micro-batches (one process per core, so the bubbles are idle "
           f"as on GPUs), median of {args.repeats} interleaved runs; GPT {CONFIG.n_layer} blocks x {CONFIG.n_embd}, "
           f"{args.block_size}-token sequences, not GPT-2 XL")


def record_failover(seconds: float) -> None:
    """The simulator's ``failover_seconds`` default: this run's eager failover, from the loss to the rebuilt pipeline."""
    record("failover_seconds", round(seconds, 2),
           "eager failover after a SIGKILL at 4 stages x 8 micro-batches, from the loss (announced at once by the "
           "Bamboo launcher) to the rebuilt pipeline; a node that vanishes without a launcher to see it is detected "
           "within the detection timeout (default 10 s) on top of this")


def worker_arguments(parser: argparse.ArgumentParser) -> None:
    """What a worker reads (``run_config`` passes them), with the shape of the run."""
    add_worker_flag(parser)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--redundancy", default="off")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=CONFIG.block_size,
                        help="tokens per sequence: compute per step grows with it, the redundancy's per-step cost does not")
    parser.add_argument("--n-embd", type=int, default=CONFIG.n_embd,
                        help="the GPT's width (default %(default)s; 768 gives 43M parameters, whose weights and AdamW "
                             "state outweigh the framework's memory, to see what the replica costs)")
    parser.add_argument("--pipelines", type=int, default=1,
                        help="data-parallel pipelines of each shape (pipelines x stages processes; default 1)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"the redundancy modes compared, of {','.join(ALL_MODES)} (default %(default)s; off first)")
    parser.add_argument("--rotate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="", help="process_group_backend (default: the strategy's, 'bamboo' on CPU)")
    parser.add_argument("--out", help=argparse.SUPPRESS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    worker_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (median of their medians)")
    parser.add_argument("--shapes", default="2x4,2x8,4x4,4x8", help="stages x micro-batches to measure")
    parser.add_argument("--no-kills", dest="kills", action="store_false", help="skip the two recovery runs")
    parser.add_argument("--precision", choices=sorted(PRECISION_CONFIGS), default="32",
                        help="every run in this precision (DeepSpeed's bf16/fp16 section: fp32 masters, autocast)")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clip_val of every run (0: none)")
    parser.add_argument("--record", action="store_true",
                        help="write eager's measured overhead at 2 x 8 to the simulator's defaults (sim_params.json)")
    parser.add_argument("--launcher", action="store_true",
                        help="run every configuration under the Bamboo launcher (membership, a commit per step), as a "
                             "job that can fail over runs; default: Lightning spawns the workers")
    parser.add_argument("--layer-cost", action="store_true",
                        help="also time redundancy 'off' on plain gloo against the default abortable backend")
    # 60: on a shared machine a step's time spreads by tens of percent within a run; the median of 30 steps
    # moved by about 2%, the size of the lazy target (docs/measurements.md)
    parser.add_argument("--paired-steps", type=int, default=60,
                        help="steps per mode in the paired runs (off, lazy and eager alternating in one run; 0: none)")
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    modes = tuple(args.modes.split(","))
    if not set(modes) <= set(ALL_MODES) or modes[0] != "off" or len(set(modes)) != len(modes):
        parser.error(f"--modes lists distinct modes of {','.join(ALL_MODES)}, off first (got {args.modes!r})")
    os.environ[PRECISION_ENV] = f"{args.precision}:{args.clip}"
    print(f"precision {args.precision}, gradient clipping {args.clip or 'off'}"
          + (", every run under the Bamboo launcher (a commit per step)" if args.launcher else "")
          + f"; {args.pipelines} pipeline(s) of each shape ({args.pipelines} x stages processes); modes {args.modes}")

    rows = {}
    costs: dict[tuple[int, int, str], dict[str, list[float]]] = {}
    held: dict[tuple[int, int, str], list[int | None]] = {}  # per rank, the stage whose replica it kept
    with tempfile.TemporaryDirectory() as tmp:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
        for stages, m in shapes:
            medians: dict[str, list[float]] = {mode: [] for mode in modes}
            peaks: dict[str, list[int]] = {mode: [] for mode in modes}
            # modes interleaved and repeated: a burst of load elsewhere on the machine hits all of them alike
            for repeat in range(args.repeats):
                for mode in modes:
                    r = run_config(stages, m, mode, args.steps, Path(tmp, f"{stages}-{m}-{mode}-{repeat}.json"),
                                   block_size=args.block_size, warmup=args.warmup, n_embd=args.n_embd,
                                   launcher=args.launcher, pipelines=args.pipelines)
                    held[(stages, m, mode)] = r["replicas"]
                    times = sorted(r["times"][args.warmup:])
                    medians[mode].append(times[len(times) // 2])
                    peaks[mode].append(max(r["peak_bytes"]))
                    if mode != "off" and repeat == 0:
                        per_step = {k: [s[k] / args.steps for s in r["replica_seconds"]] for k in r["replica_seconds"][0]}
                        costs[(stages, m, mode)] = per_step
            for mode in modes:
                rows[(stages, m, mode)] = (statistics.median(medians[mode]), max(peaks[mode]))
        # the same shapes with the three modes alternating step by step in one run (see Rotate)
        paired: dict[tuple[int, int], list[dict[str, float]]] = {}
        for stages, m in shapes if args.paired_steps else []:
            for repeat in range(args.repeats):
                r = run_config(stages, m, "eager" if "eager" in modes else "lazy",
                               args.warmup + len(modes) * args.paired_steps,
                               Path(tmp, f"paired-{stages}-{m}-{repeat}.json"), block_size=args.block_size, rotate=True, warmup=args.warmup,
                               n_embd=args.n_embd, launcher=args.launcher, pipelines=args.pipelines, modes=modes)
                by_mode = {mode: sorted(t for t, md in list(zip(r["times"], r["modes"], strict=True))[args.warmup:] if md == mode)
                           for mode in modes}
                paired.setdefault((stages, m), []).append({mode: ts[len(ts) // 2] for mode, ts in by_mode.items()})
        layer: dict[tuple[int, int], dict[str, list[float]]] = {}
        for stages, m in shapes if args.layer_cost else []:
            for repeat in range(args.repeats):
                for backend in ("gloo", "bamboo"):
                    r = run_config(stages, m, "off", args.steps, Path(tmp, f"layer-{stages}-{m}-{backend}-{repeat}.json"),
                                   block_size=args.block_size, warmup=args.warmup, backend=backend, n_embd=args.n_embd,
                                   pipelines=args.pipelines)
                    times = sorted(r["times"][args.warmup:])
                    layer.setdefault((stages, m), {}).setdefault(backend, []).append(times[len(times) // 2])
        kill_step = args.steps // 2
        kills = {mode: run_config(4, 8, mode, args.steps, Path(tmp, f"kill-{mode}.json"), kill=f"node2@{kill_step}",
                                  block_size=args.block_size, warmup=args.warmup, n_embd=args.n_embd)
                 for mode in ("lazy", "eager")} if args.kills else {}
    layers = gpt_layers(config_for(args.block_size, args.n_embd))
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    print(f"GPT {params / 1e6:.1f}M params (width {args.n_embd}), "
          f"{args.block_size}-token sequences, "
          f"micro-batch {MICRO}, AdamW, CPU ({args.backend or 'bamboo'} backend over gloo), "
          f"{args.steps - args.warmup} timed steps per run, "
          f"median of {args.repeats} interleaved runs per config")
    print(f"{'stages':>6} {'micro-b':>7} {'mode':>5} {'step ms':>9} {'x off':>6} {'peak MiB/proc':>14} {'x off':>6}")
    for (stages, m, mode), (step, peak) in rows.items():
        base_step, base_peak = rows[(stages, m, "off")]
        print(f"{stages:>6} {m:>7} {mode:>5} {step * 1e3:>9.1f} {step / base_step:>6.3f} {peak / 2**20:>14.0f} "
              f"{peak / base_peak:>6.3f}")
    for stages in sorted({stages for stages, _, _ in rows}):
        # what holding a replica should add: the successor's weights, gradients and two AdamW moments, 16 bytes each
        per_stage = params / stages
        print(f"at {stages} stages a stage holds about {per_stage / 1e6:.1f}M parameters: a replica of one adds about "
              f"{per_stage * 16 / 2**20:.0f} MiB (weights, gradients and AdamW's two moments in fp32, 16 bytes each)")
    for (stages, m, mode), ranks in held.items():
        print(f"{mode} {stages} stages x {m} micro-batches x {args.pipelines} pipeline(s): replica kept by each rank "
              "(the stage it holds; - none): " + " ".join("-" if s is None else str(s) for s in ranks))
    for (stages, m, mode), per_step in costs.items():
        print(f"{mode} {stages} stages x {m} micro-batches, ms per step on each rank: "
              + ", ".join(f"{k} " + "/".join(f"{v * 1e3:.1f}" for v in values) for k, values in per_step.items()))
    if (2, 8, "lazy") in rows and (2, 8, "eager") in rows:
        base = rows[(2, 8, "off")][0]
        print(f"targets at 2 stages x 8 micro-batches: lazy {rows[(2, 8, 'lazy')][0] / base:.3f}x (<= 1.03x), "
              f"eager {rows[(2, 8, 'eager')][0] / base:.3f}x (<= 1.10x)")
    if "auto" in modes and "lazy" in modes:
        for stages, m in shapes:
            (auto, auto_peak), (lazy, lazy_peak) = rows[(stages, m, "auto")], rows[(stages, m, "lazy")]
            print(f"auto against lazy at {stages} stages x {m} micro-batches x {args.pipelines} pipeline(s), separate "
                  f"runs: step {auto / lazy:.3f}x, peak memory per process {auto_peak / lazy_peak:.3f}x "
                  f"({(auto_peak - lazy_peak) / 2**20:+.0f} MiB)")
    if paired:
        print(f"paired: {', '.join(modes)} alternating step by step in the same processes, {args.paired_steps} steps "
              f"of each per run, median step per mode; ratio to off per run (median of {args.repeats} runs)")
        print(f"{'stages':>6} {'micro-b':>7} {'mode':>5} {'step ms':>9} {'x off':>6}  per run")
        for (stages, m), runs in paired.items():
            for mode in modes:
                ratios = [run[mode] / run["off"] for run in runs]
                print(f"{stages:>6} {m:>7} {mode:>5} {statistics.median(run[mode] for run in runs) * 1e3:>9.1f} "
                      f"{statistics.median(ratios):>6.3f}  " + " ".join(f"{x:.3f}" for x in ratios))
            if "auto" in modes and "lazy" in modes:
                ratios = [run["auto"] / run["lazy"] for run in runs]
                print(f"paired auto against lazy at {stages} stages x {m} micro-batches x {args.pipelines} "
                      f"pipeline(s): {statistics.median(ratios):.3f}x  per run " + " ".join(f"{x:.3f}" for x in ratios))
        if (2, 8) in paired and {"lazy", "eager"} <= set(modes):
            runs = paired[(2, 8)]
            lazy, eager = (statistics.median(run[mode] / run["off"] for run in runs) for mode in ("lazy", "eager"))
            print(f"targets at 2 stages x 8 micro-batches, paired: lazy {lazy:.3f}x (<= 1.03x), eager {eager:.3f}x "
                  f"(<= 1.10x)")
    for (stages, m), by in layer.items():
        gloo, bamboo = statistics.median(by["gloo"]), statistics.median(by["bamboo"])
        print(f"communication layer at {stages} stages x {m} micro-batches, redundancy off: plain gloo {gloo * 1e3:.1f} ms, "
              f"abortable 'bamboo' backend {bamboo * 1e3:.1f} ms per step: {bamboo / gloo:.3f}x, "
              f"{(bamboo - gloo) * 1e3:+.1f} ms per step (median of {args.repeats})")
    if args.record and (2, 8, "eager") in rows and args.pipelines == 1:
        record_overhead(rows[(2, 8, "eager")][0] / rows[(2, 8, "off")][0] - 1, args)
    if args.record and kills:
        record_failover(kills["eager"]["failovers"][0]["seconds"])
    for mode, r in kills.items():
        (failover,) = r["failovers"]
        before = sorted(r["times"][args.warmup:kill_step] or r["times"])
        step_s = before[len(before) // 2]
        # the victim dies when step kill_step starts; the next completed step is the redone one
        redone_end = r["ends"][kill_step]
        previous_end = r["ends"][kill_step - 1]
        print(f"{mode} recovery at 4 stages x 8 micro-batches (node2 SIGKILLed at step {kill_step}): failover "
              f"{failover['seconds']:.2f} s; last step before the kill -> next completed step "
              f"{redone_end - previous_end:.2f} s (a step is {step_s:.2f} s; target <= 5 s + one step)")


if __name__ == "__main__":
    main()
