"""Planner benchmark with real processes on CPU: regret, prediction error, planning time, DeepSpeed partitions.

For each model (uneven-width MLP, GPT with a heavy embedding and head, layers of known
sleep-based cost) this profiles the layers, plans for ``--world-size`` workers, then trains
every feasible layout (each depth x pipelines x micro-batch size, cut at the planner's best
split) and the chosen layout cut by DeepSpeed's ``uniform`` and ``parameters`` methods, all
in one set of worker processes running DeepSpeed's PipelineEngine over gloo: the engine that
BambooStrategy drives. Reports, in one run: the chosen plan's regret against the measured
best, the step-time prediction error, planning time for 32 layers x 8 workers, and the chosen
split's speed against DeepSpeed's. Not a test: timings depend on the machine and its load.

    python benchmarks/tuner.py --world-size 4 --steps 5 --report tuner.json
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
    """One layout to train: label says where it came from."""

    label: str
    stages: int
    pipelines: int
    micro_batch_size: int
    micro_batches: int
    parts: tuple[int, ...]
    predicted: float


# ---------------------------------------------------------------------------- workers
def _worker(rank: int, world: int, port: int, example: Example, configs: list[Config], steps: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)  # as profiled: the workers share the host's cores
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    class CutAt(PipelineModule):
        """A PipelineModule cut at given boundaries."""

        def __init__(self, layers: list[nn.Module], parts: tuple[int, ...], **kwargs: Any) -> None:
            self._cut = list(parts)
            super().__init__(layers=layers, **kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:
            stage = self._topo.get_coord(self.global_rank).pipe
            self.parts = self._cut
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    deepspeed.init_distributed(dist_backend="gloo")
    if example.name == "null":
        from lightning_bamboo.planner.network import measure_link

        link = measure_link(num_bytes=2**20, repeats=5)
        if rank == 0:
            results.put(("link", link))
    for cfg in configs:
        topology = PipeDataParallelTopology(num_pp=cfg.stages, num_dp=cfg.pipelines)
        module = CutAt(example.layers(), cfg.parts, topology=topology, loss_fn=example.loss)
        ds_config = {
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": cfg.micro_batches,
            "train_batch_size": cfg.micro_batch_size * cfg.micro_batches * cfg.pipelines,
            "steps_per_print": 2**62,
        }
        optimizer = torch.optim.Adam(module.parameters())
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)
        generator = torch.Generator().manual_seed(rank)

        feed = _batches(example, cfg.micro_batch_size, generator)
        times = []
        for step in range(steps + 2):
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(data_iter=feed)
            dist.barrier()
            if step >= 2:  # two warm-up steps
                times.append(time.perf_counter() - start)
        if rank == 0:
            results.put((cfg, statistics.median(times)))
        del engine, module, optimizer
    dist.destroy_process_group()


def _batches(example: Example, size: int, generator: torch.Generator) -> Any:
    while True:
        yield example.batch(size, generator)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(example: Example, configs: list[Config], world: int, steps: int) -> dict[Any, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(world, _free_port(), example, configs, steps, results), nprocs=world,
                       start_method="spawn")
    expected = len(configs) + (1 if example.name == "null" else 0)
    return dict(results.get(timeout=60) for _ in range(expected))


def calibrate(world: int, steps: int, compute_scale: float) -> Hardware:
    """The engine's costs on this machine: link latency/bandwidth, per micro-batch and per step.

    A model without compute runs as ``world`` pipelines of one stage with 1 and 16 micro-batches:
    ``step(m) = step_overhead + m * micro_batch_overhead``.
    """
    runs = [Config("null", 1, world, 1, m, (0, 8), 0.0) for m in (1, 16)]
    measured = measure(Example("null", 0), runs, world, steps)
    bandwidth, latency = measured["link"]
    one, many = measured[runs[0]], measured[runs[1]]
    per_micro_batch = max(0.0, (many - one) / 15)
    hw = Hardware(
        memory_bytes=2**30,
        bandwidth_bytes_per_second=bandwidth,
        latency_seconds=latency,
        micro_batch_overhead_seconds=per_micro_batch,
        step_overhead_seconds=max(0.0, one - per_micro_batch),
        compute_scale=compute_scale,
    )
    print(f"calibrated: link {bandwidth / 1e9:.2f} GB/s, latency {latency * 1e6:.0f} us, engine "
          f"{hw.micro_batch_overhead_seconds * 1e3:.2f} ms per micro-batch, {hw.step_overhead_seconds * 1e3:.2f} ms "
          f"per step, compute x{hw.compute_scale:.1f} ({world} workers on {os.cpu_count()} cores)")
    return hw


# ---------------------------------------------------------------------------- planning
def configs_for(example: Example, profile: ModelProfile, hw: Hardware, world: int, batch: int) -> tuple[list[Config], Config]:
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

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
    params = [layer.param_bytes for layer in profile.layers]
    for label, parts in (("ds-uniform", partition_uniform(profile.num_layers, best.stages)),
                         ("ds-parameters", partition_balanced(params, best.stages))):
        parts = tuple(int(p) for p in parts)
        if parts == best.parts:  # the same split, measured again: the gap to the chosen run is noise
            configs.append(replace(best, label=label))
            continue
        est = estimate_step(profile, hw, parts, best.micro_batch_size, best.micro_batches, best.pipelines)
        configs.append(Config(label, best.stages, best.pipelines, best.micro_batch_size, best.micro_batches, parts,
                              est.step_seconds))
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
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (median), after 2 warm-up")
    parser.add_argument("--models", default="sleep,mlp,gpt")
    parser.add_argument("--report", help="write the numbers as JSON")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="workers' compute / profiled compute (try workers / cores on an oversubscribed CPU)")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="plan with a bare Hardware (no engine overheads) instead of measuring them first")
    args = parser.parse_args()

    hw = (calibrate(args.world_size, args.steps, args.compute_scale) if args.calibrate
          else Hardware(memory_bytes=2**30, compute_scale=args.compute_scale))
    report: dict[str, Any] = {"world_size": args.world_size, "global_batch": args.global_batch, "models": {},
                              "hardware": hw.__dict__}
    regrets, errors = [], []
    for name in args.models.split(","):
        example = Example(name, seed=0)
        profile = profile_layers(example.layers(), lambda n, e=example: e.batch(n, torch.Generator().manual_seed(0))[0],
                                 MICRO_BATCH_SIZES, repeats=3, warmup=1, threads=1)
        configs, chosen = configs_for(example, profile, hw, args.world_size, args.global_batch)
        measured = measure(example, configs, args.world_size, args.steps)
        planner_runs = {c: t for c, t in measured.items() if c.label == "planner"}
        fastest = min(planner_runs.values())
        regret = measured[chosen] / fastest - 1
        errs = [abs(c.predicted - t) / t for c, t in planner_runs.items()]
        regrets.append(regret)
        errors.extend(errs)
        rows = []
        print(f"\n{name}: chosen {chosen.pipelines}x{chosen.stages} mb{chosen.micro_batch_size} {list(chosen.parts)}; "
              f"regret {regret:.1%}, mean prediction error {statistics.mean(errs):.1%}")
        print(f"{'layout':<16} {'parts':<24} {'predicted ms':>12} {'measured ms':>12} {'error':>7}")
        for cfg in configs:
            t = measured[cfg]
            tag = f"{cfg.label if cfg.label != 'planner' else ''}{' *' if cfg == chosen else ''}"
            layout = f"{cfg.pipelines}x{cfg.stages} mb{cfg.micro_batch_size}"
            print(f"{layout:<16} {str(list(cfg.parts)):<24} {cfg.predicted * 1e3:>12.1f} {t * 1e3:>12.1f} "
                  f"{(cfg.predicted - t) / t:>+7.1%} {tag}")
            rows.append({**cfg.__dict__, "parts": list(cfg.parts), "measured": t})
        vs = {c.label: measured[chosen] / t for c, t in measured.items() if c.label.startswith("ds-")}
        print("chosen step time / DeepSpeed's: " + ", ".join(f"{k} {v:.2f}x" for k, v in vs.items()))
        report["models"][name] = {"regret": regret, "mean_error": statistics.mean(errs), "vs_deepspeed": vs,
                                  "configs": rows}
    planning = planning_time_32x8()
    summary = {
        "median_regret": statistics.median(regrets),
        "max_regret": max(regrets),
        "mean_prediction_error": statistics.mean(errors),
        "planning_seconds_32_layers_8_workers": planning,
    }
    report["summary"] = summary
    print("\n" + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
