"""``lightning-bamboo plan``: profile an example model and print its plan (JSON) or a plan table."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.planner.costmodel import Hardware, ModelProfile
from lightning_bamboo.planner.memory import fixed_bytes
from lightning_bamboo.planner.plan import plan, plan_table
from lightning_bamboo.topology.layout import DEFAULT_REDUNDANCY

GiB = 2**30


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4,8 (got {text!r})") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"micro-batch sizes must be >= 1 (got {text!r})")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--example", choices=["gpt"], default="gpt", help="built-in model to plan for")
    parser.add_argument("--world-size", type=int, default=8, help="workers (the table covers 1..N)")
    parser.add_argument("--json", action="store_true", help="print the plan for --world-size as JSON")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step (all pipelines)")
    parser.add_argument(
        "--scale-batch", action="store_true",
        help="Hydrozoa mode: --global-batch is per pipeline and the step's batch grows with the pipelines",
    )
    parser.add_argument("--micro-batch-sizes", type=_sizes, default=(1, 2, 4, 8), help="candidates, e.g. 1,2,4,8")
    parser.add_argument("--memory-gib", type=float, default=8.0,
                        help="memory per worker (a machine's divided by its workers); what a worker holds besides the "
                             "model's layers (its interpreter, framework and communication processes, planner.memory) "
                             "is taken off first")
    parser.add_argument("--bandwidth-gbps", type=float, default=1.0, help="GB/s between workers")
    parser.add_argument("--latency-ms", type=float, default=0.05, help="per message")
    parser.add_argument("--micro-batch-overhead-ms", type=float, default=0.0,
                        help="engine cost per micro-batch and stage (benchmarks/tuner.py measures it)")
    parser.add_argument("--step-overhead-ms", type=float, default=0.0, help="fixed cost per step")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="workers' compute time / profiled time (e.g. 2 when two workers share a core)")
    parser.add_argument("--allow-idle", action="store_true", help="allow plans that leave workers unused")
    parser.add_argument("--replica", action="store_true",
                        help="each worker also holds its successor's stage (redundancy lazy/eager): plans fit with it")
    parser.add_argument("--redundancy", choices=["off", "lazy", "eager", "auto"], default=DEFAULT_REDUNDANCY,
                        help="price the redundancy's time per step (replica update, gradient shipping, eager's "
                             "redundant forwards) and count the replicas in memory (implies --replica); 'auto' (the "
                             f"strategy's default, and this one's: {DEFAULT_REDUNDANCY!r}) is lazy for a layout of one "
                             "pipeline and off for one of several, whose copies of each stage run on other machines")
    parser.add_argument("--one-machine", action="store_true",
                        help="every worker runs on one machine: under 'auto' a layout of several pipelines keeps "
                             "replicas too (no copy of a stage is on another machine)")
    parser.add_argument("--activation-checkpointing", type=int, default=0, metavar="LAYERS",
                        help="plan with activation checkpointing every LAYERS layers (BambooStrategy's "
                             "activation_checkpointing): less activation memory, one more forward per backward")
    parser.add_argument("--n-layer", type=int, default=4, help="GPT transformer blocks (pipeline layers = n + 2)")
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="where to profile (cpu, cuda, cuda:1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per layer (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per layer first")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads while profiling: what each worker runs with (CPU workers on one host share cores)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, help="read a saved profile (JSON) instead of measuring")
    parser.add_argument("--save-profile", type=Path, help="write the measured profile as JSON")


def _measure(args: argparse.Namespace) -> ModelProfile:
    import torch  # the planner itself needs no torch; measuring does

    from lightning_bamboo.models.gpt import GPTConfig, gpt_layers
    from lightning_bamboo.planner.profile import profile_layers

    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size)
    torch.manual_seed(args.seed)
    layers = gpt_layers(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (max(args.micro_batch_sizes), cfg.block_size))
    return profile_layers(
        layers, tokens, args.micro_batch_sizes, device=args.device, repeats=args.repeats, warmup=args.warmup,
        threads=args.threads,
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.world_size < 1:
            raise BambooConfigError(f"--world-size must be >= 1 (got {args.world_size})")
        usable = int(args.memory_gib * GiB) - fixed_bytes()
        if usable <= 0:
            raise BambooConfigError(f"--memory-gib {args.memory_gib} leaves nothing for the model: a worker holds "
                                    f"{fixed_bytes() / GiB:.2f} GiB besides its layers (its interpreter, framework and "
                                    f"communication processes); give it more than that")
        hw = Hardware(
            memory_bytes=usable,
            bandwidth_bytes_per_second=args.bandwidth_gbps * 1e9,
            latency_seconds=args.latency_ms / 1e3,
            micro_batch_overhead_seconds=args.micro_batch_overhead_ms / 1e3,
            step_overhead_seconds=args.step_overhead_ms / 1e3,
            compute_scale=args.compute_scale,
        )
        if args.profile is not None:
            profile = ModelProfile.from_dict(json.loads(args.profile.read_text()))
        else:
            profile = _measure(args)
        if args.save_profile is not None:
            args.save_profile.write_text(json.dumps(profile.to_dict(), indent=2))
        options = dict(scale_batch=args.scale_batch, allow_idle=args.allow_idle,
                       replica=args.replica or args.redundancy != "off", redundancy=args.redundancy,
                       activation_checkpointing=args.activation_checkpointing, copies_apart=not args.one_machine)
        if args.json:
            chosen = plan(profile, hw, args.world_size, args.global_batch, **options)
            print(chosen.to_json())
            return 0
        started = time.perf_counter()
        table = plan_table(profile, hw, args.world_size, args.global_batch, **options)
        elapsed = time.perf_counter() - started
    except BambooConfigError as err:
        print(f"lightning-bamboo plan: {err}", file=sys.stderr)
        return 2
    print(f"{args.example}: {profile.num_layers} layers profiled on {profile.device}; memory {args.memory_gib} GiB "
          f"per worker, {args.bandwidth_gbps} GB/s, global batch {args.global_batch}"
          f"{' per pipeline (scaled)' if args.scale_batch else ''}")
    print(table.format())
    print(f"planned {args.world_size} world size(s) in {elapsed * 1e3:.1f} ms")
    chosen = table.plans[args.world_size - 1]
    if chosen is not None and chosen.node_memory:
        print(f"each node's predicted peak memory at {args.world_size} worker(s), by owner (GiB; planner.memory: "
              f"docs/memory.md):")
        print(chosen.format_memory())
    return 0
