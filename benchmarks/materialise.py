"""What a process pays to build its layers: its stage and its replica only, against every layer.

A GPT of GPT-2-medium's shape (24 blocks x 1024, vocabulary 50304, context 1024; the head untied: 406M parameters) as
``LayerSpec``s is cut into 4 stages by parameters. Each variant runs in a fresh process (so the peaks do not mix)
and builds what rank ``--rank`` of that layout holds, its stage and the replica of its successor's stage:

* ``layer-wise`` (this version): the census on the meta device, then only the kept ``LayerSpec``s, each under
  ``seed + index`` (``engine.module.build_layers``);
* ``every-spec`` (before #38's item 1): every ``LayerSpec`` built in order under one seed, the others dropped as
  soon as built: the memory of the kept layers, the time of all of them;
* ``whole``: every layer built and kept (what a model returned as built ``nn.Module``s costs every process).

It prints, per variant, the seconds to build (the fastest of ``--repeats`` processes) and the peak resident memory
the build added (``ru_maxrss`` after it minus before it, imports done), then the ratios of ``layer-wise`` to the
others. One thread per process, as when a machine's cores are shared by its pipeline's processes.

    python benchmarks/materialise.py [--layers 24] [--width 1024] [--rank 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import time

from common import add_worker_flag, self_command

VARIANTS = ("layer-wise", "every-spec", "whole")


def _config(args: argparse.Namespace):
    from lightning_bamboo.models.gpt import GPTConfig

    return GPTConfig(vocab_size=50304, block_size=1024, n_layer=args.layers, n_head=16, n_embd=args.width)


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _held(args: argparse.Namespace) -> tuple[set[int], list[int], list[int]]:
    """The layers rank ``args.rank`` holds in 4 stages cut by parameters (its stage and its successor's)."""
    from lightning_bamboo.engine.module import census_layers
    from lightning_bamboo.engine.partition import compute_parts
    from lightning_bamboo.models.gpt import gpt_layer_specs

    cfg = _config(args)
    census = census_layers(lambda: gpt_layer_specs(cfg), args.seed)
    parts = compute_parts("parameters", 4, census.param_counts, census.names)
    stage = args.rank
    held = set(range(parts[stage], parts[stage + 1])) | set(range(parts[(stage + 1) % 4], parts[(stage + 1) % 4 + 1]))
    return held, parts, census.param_counts


def child(args: argparse.Namespace) -> None:
    import torch
    import torch._dynamo  # noqa: F401 - a training process has it (Lightning imports it); the meta device's inits need it

    from lightning_bamboo.engine.module import build_layers
    from lightning_bamboo.models.gpt import gpt_layer_specs

    torch.set_num_threads(1)
    cfg = _config(args)
    before = _peak_bytes()
    started = time.perf_counter()
    if args.role == "layer-wise":
        held, parts, counts = _held(args)  # the census is part of this path's cost
        layers = build_layers(lambda: gpt_layer_specs(cfg), args.seed, keep=lambda i: i in held).layers
    elif args.role == "every-spec":
        held, parts, counts = _held(args)
        layers = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            for index, spec in enumerate(gpt_layer_specs(cfg)):
                layer = spec.build()
                layers.append(layer if index in held else None)
                del layer
    else:
        held, parts, counts = set(range(cfg.n_layer + 2)), [], []
        layers = build_layers(lambda: gpt_layer_specs(cfg), args.seed).layers
    seconds = time.perf_counter() - started
    kept = sum(p.numel() * p.element_size() for layer in layers if layer is not None for p in layer.parameters())
    print(json.dumps({"variant": args.role, "seconds": seconds, "peak_added": _peak_bytes() - before,
                      "kept_bytes": kept, "kept_layers": sorted(held), "parts": parts,
                      "params": sum(counts) if counts else None}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=1, help="the stage (of 4) whose process is measured")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per variant; the fastest is shown")
    add_worker_flag(parser, choices=VARIANTS)  # the variant a child builds
    args = parser.parse_args()
    if args.role:
        child(args)
        return
    results: dict[str, dict] = {}
    for _ in range(args.repeats):  # the variants alternate; each keeps its fastest build (the machine is shared)
        for variant in VARIANTS:
            proc = subprocess.run(self_command(__file__, variant, "--layers", args.layers, "--width", args.width,
                                               "--rank", args.rank, "--seed", args.seed),
                                  capture_output=True, text=True, check=True, timeout=600)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            if variant not in results or got["seconds"] < results[variant]["seconds"]:
                results[variant] = got
    mine = results["layer-wise"]
    gib = 1 << 30
    print(f"GPT {args.layers} x {args.width}, {mine['params'] / 1e6:.0f}M parameters as LayerSpecs, 4 stages cut "
          f"by parameters at {mine['parts']}; rank {args.rank} holds layers {mine['kept_layers'][0]}-"
          f"{mine['kept_layers'][-1]} (its stage and its replica), {mine['kept_bytes'] / gib:.2f} GiB of fp32 weights")
    for variant in VARIANTS:
        r = results[variant]
        print(f"{variant:>10}: build {r['seconds']:6.2f} s, peak RSS added {r['peak_added'] / gib:5.2f} GiB, "
              f"holding {r['kept_bytes'] / gib:5.2f} GiB")
    for other in VARIANTS[1:]:
        r = results[other]
        print(f"layer-wise / {other}: time {mine['seconds'] / r['seconds']:.2f}x, "
              f"peak memory {mine['peak_added'] / max(1, r['peak_added']):.2f}x")


if __name__ == "__main__":
    main()
