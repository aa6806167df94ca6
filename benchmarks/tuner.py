"""Planner benchmark with real processes on CPU: regret, prediction error, planning time, DeepSpeed partitions.

For each model (uneven-width MLP, GPT with a heavy embedding and head, layers of known
sleep-based cost) this profiles the layers, plans for ``--world-size`` workers, then trains
every feasible layout (each depth x pipelines x micro-batch size, cut at the planner's best
split) and the chosen layout cut by DeepSpeed's ``uniform`` and ``parameters`` methods, all
in one set of worker processes, each config trained by ``Trainer(strategy=BambooStrategy(stages,
micro_batch_size, partition))`` over gloo: what a user runs, Lightning's loop included. Reports, in one run: the chosen plan's regret against the measured
best, the step-time prediction error, planning time for 32 layers x 8 workers, and the chosen
split's speed against DeepSpeed's. Not a test: timings depend on the machine and its load.

    python benchmarks/tuner.py [--world-size W (default: one worker per core)] --steps 5 --report tuner.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss
from lightning_bamboo.planner import Hardware, ModelProfile, estimate_step, plan, solve_split
from lightning_bamboo.planner.profile import profile_layers
from lightning_bamboo.planner.solver import Split

MICRO_BATCH_SIZES = (1, 2, 4)


# ---------------------------------------------------------------------------- models
class _Sleep(torch.autograd.Function):
    """Forward and backward that take a known time: ``base + per_sample * batch`` seconds each."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fwd: tuple[float, float], bwd: tuple[float, float]) -> torch.Tensor:
        if fwd != (0, 0):  # sleep(0) still yields the core: a null layer must not call it
            time.sleep(fwd[0] + fwd[1] * x.shape[0])
        ctx.bwd = bwd
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        if ctx.bwd != (0, 0):
            time.sleep(ctx.bwd[0] + ctx.bwd[1] * x.shape[0])
        return grad * w, (grad * x).sum().reshape(w.shape), None, None


class SleepLayer(nn.Module):
    """A layer whose cost is known in advance (milliseconds: fixed part, per-sample part)."""

    def __init__(self, fwd_ms: tuple[float, float], bwd_ms: tuple[float, float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.fwd = (fwd_ms[0] / 1e3, fwd_ms[1] / 1e3)
        self.bwd = (bwd_ms[0] / 1e3, bwd_ms[1] / 1e3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.w, self.fwd, self.bwd)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


@dataclass(frozen=True)
class Example:
    name: str
    seed: int

    def layers(self) -> list[nn.Module]:
        torch.manual_seed(self.seed)
        if self.name == "sleep":  # uneven: two heavy layers in the middle, a heavy last layer
            costs = [(0.5, 0.5), (0.5, 0.5), (2, 2), (0.5, 0.5), (2, 1), (0.5, 0.5), (0.5, 0.5), (1, 2)]
            return [SleepLayer((f, f / 2), (2 * f, b)) for f, b in costs]
        if self.name == "null":  # no compute: what is left is the engine's own cost
            return [SleepLayer((0, 0), (0, 0)) for _ in range(8)]
        if self.name == "mlp":  # uneven widths, big enough that compute outweighs the engine's overhead
            widths = [256, 2048, 256, 4096, 256, 64]
            return [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:], strict=False)]
        if self.name == "gpt":  # a big vocabulary: heavy embedding (parameters) and head (time)
            return list(gpt_layers(self.gpt_config()))
        raise ValueError(self.name)

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=8192, n_layer=4, n_embd=128, n_head=4, block_size=64)

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name == "gpt":
            cfg = self.gpt_config()
            tokens = torch.randint(0, cfg.vocab_size, (size, cfg.block_size + 1), generator=generator)
            return tokens[:, :-1], tokens[:, 1:]
        width_in, width_out = (16, 16) if self.name in ("sleep", "null") else (256, 64)
        return torch.randn(size, width_in, generator=generator), torch.randn(size, width_out, generator=generator)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return gpt_loss(out, target) if self.name == "gpt" else _mse(out, target)


@dataclass(frozen=True)
class Config:
    """One layout to train: label says where it came from; ``partition`` is what BambooStrategy gets.

    ``partition`` is explicit boundaries (the planner's split) or one of DeepSpeed's methods
    (``"uniform"``, ``"parameters"``), resolved by the strategy as it would be for a user.
    """

    label: str
    stages: int
    pipelines: int
    micro_batch_size: int
    micro_batches: int
    partition: tuple[int, ...] | str
    predicted: float

    @property
    def batch_per_pipeline(self) -> int:
        return self.micro_batch_size * self.micro_batches


class _Samples(torch.utils.data.Dataset):
    """``n`` fixed random (inputs, targets) pairs of the example."""

    def __init__(self, example: Example, n: int) -> None:
        self.inputs, self.targets = example.batch(n, torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


# ---------------------------------------------------------------------------- workers
def _worker(
    rank: int, world: int, port: int, example: Example, configs: list[Config], steps: int, rounds: int, results: Any
) -> None:
    """One process of ``world``: train every config through Trainer(strategy=BambooStrategy(...)), time the steps.

    The processes are started here and Lightning finds them through the environment (as under
    torchrun), so one set of processes trains every config in turn instead of paying the start-up
    (~10 s of imports) per config.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), NODE_RANK="0", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # as profiled: the workers share the host's cores
    import logging
    import warnings

    import lightning.pytorch as pl
    import torch.distributed as dist

    import lightning_bamboo

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "DeepSpeed", "lightning_bamboo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if example.name == "null":
        from lightning_bamboo.planner.network import measure_link

        link = measure_link(num_bytes=2**20, repeats=5)
        if rank == 0:
            results.put(("link", link))

    class Bench(pl.LightningModule):
        def __init__(self, batch_size: int, samples: int) -> None:
            super().__init__()
            self.batch_size, self.samples = batch_size, samples

        def configure_pipeline(self) -> list[nn.Module]:
            return example.layers()

        def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return example.loss(outputs, targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters())

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(_Samples(example, self.samples), batch_size=self.batch_size)

    class StepTimer(pl.Callback):
        """Wall time of each training step, every process lined up before and after it."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            dist.barrier()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            dist.barrier()
            self.times.append(time.perf_counter() - self.start)

    def fit(cfg: Config) -> tuple[tuple[int, ...], float]:
        partition = cfg.partition if isinstance(cfg.partition, str) else list(cfg.partition)
        strategy = lightning_bamboo.BambooStrategy(stages=cfg.stages, micro_batch_size=cfg.micro_batch_size,
                                                   partition=partition, seed=example.seed, timeout=120)
        timer = StepTimer()
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=world, max_steps=steps + 2, callbacks=[timer],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(Bench(cfg.batch_per_pipeline, (steps + 2) * cfg.batch_per_pipeline * cfg.pipelines))
        layout = strategy.layout
        assert (layout.stages, layout.pipelines) == (cfg.stages, cfg.pipelines), (layout, cfg)
        return tuple(int(p) for p in layout.parts), statistics.median(timer.times[2:])  # two warm-up steps

    fit(configs[0])  # the first run in fresh processes is slow (lazy imports, first allocations): not timed
    for round_ in range(rounds):  # the order alternates, so drift in the machine's load hits every config alike
        for index in range(len(configs)) if round_ % 2 == 0 else reversed(range(len(configs))):
            result = fit(configs[index])
            if rank == 0:
                results.put((index, result))
    dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(example: Example, configs: list[Config], world: int, steps: int, rounds: int) -> dict[Any, Any]:
    """``{config index: (boundaries the strategy used, step seconds)}`` (and ``"link"`` for null).

    Step seconds: the lowest over ``rounds`` of the median of ``steps`` timed steps (the least
    disturbed measurement on a shared machine).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(world, _free_port(), example, configs, steps, rounds, results), nprocs=world,
                       start_method="spawn")
    out: dict[Any, Any] = {}
    for _ in range(len(configs) * rounds + (1 if example.name == "null" else 0)):
        key, value = results.get(timeout=60)
        if key == "link":
            out[key] = value
        else:
            parts, seconds = value
            out[key] = (parts, min(seconds, out[key][1]) if key in out else seconds)
    return out


def calibrate(world: int, steps: int, rounds: int, compute_scale: float) -> Hardware:
    """The training loop's costs on this machine: link latency/bandwidth, per micro-batch and per step.

    A model without compute runs through the Trainer as ``world`` pipelines of one stage with 1
    and 16 micro-batches: ``step(m) = step_overhead + m * micro_batch_overhead``.
    """
    runs = [Config("null", 1, world, 1, m, (0, 8), 0.0) for m in (1, 16)]
    measured = measure(Example("null", 0), runs, world, steps, rounds)
    bandwidth, latency = measured["link"]
    one, many = measured[0][1], measured[1][1]
    per_micro_batch = max(0.0, (many - one) / 15)
    hw = Hardware(
        memory_bytes=2**30,
        bandwidth_bytes_per_second=bandwidth,
        latency_seconds=latency,
        micro_batch_overhead_seconds=per_micro_batch,
        step_overhead_seconds=max(0.0, one - per_micro_batch),
        compute_scale=compute_scale,
    )
    print(f"calibrated: link {bandwidth / 1e9:.2f} GB/s, latency {latency * 1e6:.0f} us, Trainer + engine "
          f"{hw.micro_batch_overhead_seconds * 1e3:.2f} ms per micro-batch, {hw.step_overhead_seconds * 1e3:.2f} ms "
          f"per step, compute x{hw.compute_scale:.1f} ({world} workers on {os.cpu_count()} cores)", flush=True)
    return hw


# ---------------------------------------------------------------------------- planning
def configs_for(example: Example, profile: ModelProfile, hw: Hardware, world: int, batch: int) -> tuple[list[Config], Config]:
    """Every feasible layout cut at the planner's best split, then the chosen one cut by DeepSpeed's methods."""
    chosen = plan(profile, hw, world, batch)
    configs: list[Config] = []
    best: Config | None = None
    for stages in range(1, min(world, profile.num_layers) + 1):
        if world % stages:
            continue
        pipelines = world // stages
        for mbs in profile.micro_batch_sizes:
            if batch % (pipelines * mbs):
                continue
            m = batch // pipelines // mbs
            result = solve_split(profile, hw, stages, mbs, m, pipelines)
            if not isinstance(result, Split):
                continue
            cfg = Config("planner", stages, pipelines, mbs, m, result.partition, result.estimate.step_seconds)
            configs.append(cfg)
            if (stages, pipelines, mbs, result.partition) == (chosen.stages, chosen.pipelines, chosen.micro_batch_size,
                                                               chosen.partition):
                best = cfg
    assert best is not None
    # DeepSpeed's splits at the chosen layout and, when the planner chose fewer stages, also at the depth a
    # pipeline user gets by default (all workers in one pipeline): there the split is what differs
    deepest = max((c for c in configs if c.micro_batch_size == best.micro_batch_size), key=lambda c: c.stages)
    for against in (best, deepest) if deepest.stages != best.stages else (best,):
        for method in ("uniform", "parameters"):  # resolved by BambooStrategy, as for a user who picks them
            configs.append(replace(against, label=f"ds-{method}", partition=method, predicted=float("nan")))
    return configs, best


def planning_time_32x8() -> float:
    """Median seconds to plan 32 GPT layers for 8 workers (profile measured once, cheaply)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=30)
    profile = profile_layers(gpt_layers(cfg), torch.randint(0, cfg.vocab_size, (8, cfg.block_size)), (1, 2, 4, 8),
                             repeats=1, warmup=1, threads=1)
    hw = Hardware(memory_bytes=2**30)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        plan(profile, hw, 8, 32)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=max(2, os.cpu_count() or 2),
                        help="workers (default: one per core, as Hydrozoa's model has one device per worker)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (median), after 2 warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="times every layout is trained (best median counts)")
    parser.add_argument("--models", default="sleep,mlp,gpt")
    parser.add_argument("--report", help="write the numbers as JSON")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="workers' compute / profiled compute (try workers / cores on an oversubscribed CPU)")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="plan with a bare Hardware (no engine overheads) instead of measuring them first")
    args = parser.parse_args()

    hw = (calibrate(args.world_size, args.steps, args.rounds, args.compute_scale) if args.calibrate
          else Hardware(memory_bytes=2**30, compute_scale=args.compute_scale))
    report: dict[str, Any] = {"world_size": args.world_size, "global_batch": args.global_batch, "models": {},
                              "hardware": hw.__dict__,
                              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                          "gpu": torch.cuda.is_available(), "load_at_start": os.getloadavg()}}
    regrets, errors = [], []
    for name in args.models.split(","):
        example = Example(name, seed=0)
        profile = profile_layers(example.layers(), lambda n, e=example: e.batch(n, torch.Generator().manual_seed(0))[0],
                                 MICRO_BATCH_SIZES, repeats=3, warmup=1, threads=1)
        configs, chosen = configs_for(example, profile, hw, args.world_size, args.global_batch)
        measured = measure(example, configs, args.world_size, args.steps, args.rounds)
        used = {i: parts for i, (parts, _) in measured.items()}
        seconds = {i: t for i, (_, t) in measured.items()}
        for i, cfg in enumerate(configs):  # DeepSpeed's splits: predicted for the boundaries the strategy used
            if cfg.label.startswith("ds-"):
                est = estimate_step(profile, hw, used[i], cfg.micro_batch_size, cfg.micro_batches, cfg.pipelines)
                configs[i] = replace(cfg, predicted=est.step_seconds)
            else:
                assert used[i] == cfg.partition, (used[i], cfg)
        planner_runs = {i: seconds[i] for i, c in enumerate(configs) if c.label == "planner"}
        chosen_index = configs.index(chosen)
        regret = seconds[chosen_index] / min(planner_runs.values()) - 1
        errs = [abs(configs[i].predicted - t) / t for i, t in planner_runs.items()]
        regrets.append(regret)
        errors.extend(errs)
        rows = []
        print(f"\n{name}: chosen {chosen.pipelines}x{chosen.stages} mb{chosen.micro_batch_size} {list(chosen.partition)}; "
              f"regret {regret:.1%}, mean prediction error {statistics.mean(errs):.1%}")
        print(f"{'layout':<16} {'parts':<24} {'predicted ms':>12} {'measured ms':>12} {'error':>7}")
        for i, cfg in enumerate(configs):
            t = seconds[i]
            same = cfg.label.startswith("ds-") and used[i] == next(o.partition for o in configs if o.label == "planner" and (o.stages, o.micro_batch_size) == (
                cfg.stages, cfg.micro_batch_size))
            tag = (f"{cfg.label if cfg.label != 'planner' else ''}{' *' if i == chosen_index else ''}"
                   f"{' (same split as the planner)' if same else ''}")
            layout = f"{cfg.pipelines}x{cfg.stages} mb{cfg.micro_batch_size}"
            print(f"{layout:<16} {str(list(used[i])):<24} {cfg.predicted * 1e3:>12.1f} {t * 1e3:>12.1f} "
                  f"{(cfg.predicted - t) / t:>+7.1%} {tag}")
            rows.append({**cfg.__dict__, "partition": list(used[i]), "measured": t})
        vs = {}
        for i, c in enumerate(configs):  # the planner's split vs DeepSpeed's, same layout and micro-batching
            if not c.label.startswith("ds-"):
                continue
            ours = next(j for j, o in enumerate(configs) if o.label == "planner" and
                        (o.stages, o.pipelines, o.micro_batch_size) == (c.stages, c.pipelines, c.micro_batch_size))
            key = f"{c.label[3:]} {c.pipelines}x{c.stages} mb{c.micro_batch_size}"
            vs[key] = {"ratio": seconds[ours] / seconds[i], "partition": list(used[i]),
                       "planner_partition": list(used[ours]), "same_split": used[i] == used[ours],
                       "chosen_layout": ours == chosen_index}
        print("planner's split step time / DeepSpeed's: " + ", ".join(
            f"{k} {v['ratio']:.2f}x{' (same split)' if v['same_split'] else ''}" for k, v in vs.items()), flush=True)
        report["models"][name] = {"chosen": {**chosen.__dict__, "partition": list(chosen.partition)},
                                  "regret": regret, "mean_error": statistics.mean(errs), "vs_deepspeed": vs,
                                  "configs": rows}
    planning = planning_time_32x8()
    summary = {
        "median_regret": statistics.median(regrets),
        "max_regret": max(regrets),
        "mean_prediction_error": statistics.mean(errors),
        "planning_seconds_32_layers_8_workers": planning,
    }
    report["summary"] = summary
    report["machine"]["load_at_end"] = os.getloadavg()
    print("\n" + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
