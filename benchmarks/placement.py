"""What it costs to keep every replica on another machine: step time and bytes between machines, two placements.

Two machines (network namespaces on a bridge, each with its own address and host name; etcd on a
third address; needs root) run one pipeline of 4 stages with ``redundancy="lazy"``, one supervisor
per node (``python -m lightning_bamboo.launcher --node ...``), in two placements:

* ``across`` (what ``--workers 2`` on 2 machines gives: ranks interleave machines): n0@A n1@B n2@A
  n3@B. Every stage's replica holder (its predecessor) is on the other machine, so a whole machine
  lost is never fatal; every replica exchange and every pipeline edge crosses the network.
* ``together``: n0@A n1@A n2@B n3@B. Two of the four replica exchanges and two of the three
  pipeline edges stay on a machine (the replica exchange then goes through shared memory); losing
  a machine loses a stage together with its replica holder (a checkpoint restart).

The machines' links are limited with ``tc`` (``--rate``, default: none (the veth pair's memory
speed), 1gbit and 100mbit). The 4 processes share the machine's cores whatever the placement, so
the network only costs what it cannot hide behind their compute; this CPU computes a step about
100x slower than a GPU would, so 100mbit here stands for a network about 100x faster next to GPUs.
Each placement runs ``--steps`` steps, interleaved ``--repeats`` times per link; the step time is rank 0's median over the steps after the first five. Bytes
between machines per step are counted from the model (fp32): each crossing replica exchange sends
its stage's gradients (plus a byte per parameter of mask), each crossing pipeline edge sends every
micro-batch's activations forward and their gradients back.

    sudo python benchmarks/placement.py [--steps 40] [--repeats 2] [--rate none,1gbit,100mbit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from common import HOST_VARIABLES, add_worker_flag, launcher_command, launcher_env, self_command  # noqa: E402

#: the benchmark's model: 6 pipeline layers (embedding, 4 blocks, head), about 3.3M parameters
MODEL = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256}
MICRO, BATCH, STAGES = 4, 16, 4
PLACEMENTS = {"across": ["A", "B", "A", "B"], "together": ["A", "A", "B", "B"]}
NODES = ["n0", "n1", "n2", "n3"]


def worker(args: argparse.Namespace) -> None:
    """One node: train the model through BambooStrategy; rank 0 prints its step times as JSON."""
    import lightning.pytorch as pl
    import torch
    from common import token_dataset

    import lightning_bamboo
    from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss

    cfg = GPTConfig(**MODEL)

    class GPT(pl.LightningModule):
        def configure_pipeline(self):
            return gpt_layers(cfg)

        def pipeline_loss(self, outputs, targets):
            return gpt_loss(outputs, targets)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(token_dataset(cfg, args.steps * BATCH), batch_size=BATCH,
                                               shuffle=False)

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, trainer, *_):
            self.times.append(time.perf_counter())

    times = StepTimes()
    strategy = lightning_bamboo.BambooStrategy(stages=STAGES, micro_batch_size=MICRO, partition="uniform", seed=1,
                                              redundancy="lazy", detection_timeout=30, timeout=120)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=len(NODES), max_steps=args.steps,
                         callbacks=[times], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(GPT())
    # whether this node's own gradients reach its replica holder through shared memory (same machine)
    print("SHARED " + json.dumps({"rank": trainer.global_rank,
                                  "shared": bool(trainer.strategy.engine.exchange.through_shared_memory)}), flush=True)
    if trainer.is_global_zero:
        steps = [b - a for a, b in zip(times.times, times.times[1:], strict=False)][5:]
        print("PLACEMENT " + json.dumps({"step_seconds": statistics.median(steps), "steps": len(steps)}), flush=True)


def crossing_bytes(machines: list[str]) -> dict[str, float]:
    """Bytes per step between machines for a placement (fp32 gradients and activations, see the docstring)."""
    import torch

    from lightning_bamboo.engine.partition import compute_parts
    from lightning_bamboo.models.gpt import GPTConfig, gpt_layers

    cfg = GPTConfig(**MODEL)
    torch.manual_seed(0)
    layers = gpt_layers(cfg)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    parts = compute_parts("uniform", STAGES, counts, [type(layer).__name__ for layer in layers])
    stage_params = [sum(counts[parts[s]:parts[s + 1]]) for s in range(STAGES)]
    replica = sum(stage_params[s] * 5 for s in range(STAGES) if machines[s] != machines[(s - 1) % STAGES])
    activation = MICRO * cfg.block_size * cfg.n_embd * 4 * 2  # forward, and its gradient back
    edges = sum(BATCH // MICRO * activation for s in range(STAGES - 1) if machines[s] != machines[s + 1])
    return {"replica": replica, "activations": edges, "total": replica + edges}


def run_placement(net, url: str, name: str, args: argparse.Namespace, out: Path) -> dict:
    """One run of ``name``'s placement on the namespaces of ``net``; rank 0's result."""
    machines = PLACEMENTS[name]
    env = launcher_env(extra={"PYTHONUNBUFFERED": "1"}, unset=HOST_VARIABLES)
    job = f"place{os.getpid()}{name}{time.monotonic_ns() % 100000}"
    procs, logs = [], []
    for node, machine in zip(NODES, machines, strict=True):
        log = out / f"{job}-{node}.log"
        logs.append(log)
        cmd = launcher_command(self_command(__file__, "worker", "--steps", args.steps), node=node, store=url, job=job,
                               peers=NODES, addr=net.addrs[machine])
        with open(log, "w") as handle:
            procs.append(net.popen(machine, cmd, env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=900) for p in procs]
    text = "".join(log.read_text() for log in logs)
    if any(codes):
        raise RuntimeError(f"placement {name}: exit codes {codes}; logs:\n{text[-4000:]}")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("PLACEMENT ")]
    result = json.loads(line.removeprefix("PLACEMENT "))
    shared = [json.loads(ln.removeprefix("SHARED ")) for ln in text.splitlines() if ln.startswith("SHARED ")]
    result["shared_memory_exchanges"] = sum(r["shared"] for r in shared)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rate", default="none,1gbit,100mbit",
                        help="tc rates of each machine's link to measure, comma-separated ('none': no limit)")
    add_worker_flag(parser)
    args = parser.parse_args()
    if args.role == "worker":
        worker(args)
        return

    from lightning_bamboo.testing.netns import NetnsCluster

    out = Path(tempfile.mkdtemp(prefix="bamboo-placement-"))
    rates = args.rate.split(",")
    results: dict[tuple[str, str], list[dict]] = {(rate, name): [] for rate in rates for name in PLACEMENTS}
    with NetnsCluster(["A", "B"]) as net:
        url = net.start_etcd()
        for rate in rates:
            for machine in ("A", "B"):
                tc = ["tc", "qdisc", "replace", "dev", "eth0", "root"]
                tc += ["pfifo_fast"] if rate == "none" else ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
                done = net.run(machine, tc)
                if done.returncode:
                    raise RuntimeError(f"tc on {machine}: {done.stdout}")
            for repeat in range(args.repeats):
                for name in PLACEMENTS:
                    result = run_placement(net, url, name, args, out)
                    results[(rate, name)].append(result)
                    print(f"link {rate}, repeat {repeat + 1}, {name}: {result['step_seconds'] * 1000:.1f} ms per step; "
                          f"replica exchanges through shared memory: {result['shared_memory_exchanges']} of {STAGES}",
                          flush=True)
    print(f"\none pipeline of {STAGES} stages, redundancy lazy, GPT {MODEL} (Adam), micro-batches of {MICRO}, "
          f"{BATCH} samples per step; {args.steps} steps per run (median of the steps after the first five), "
          f"{args.repeats} runs per cell, interleaved")
    print("\n| link | placement | replica holders on another machine | MB between machines per step "
          "(replicas + activations) | step ms (median of runs) | each run | across / together |\n"
          "|---|---|---:|---:|---:|---|---:|")
    for rate in rates:
        medians = {name: statistics.median(r["step_seconds"] for r in results[(rate, name)]) for name in PLACEMENTS}
        for name, machines in PLACEMENTS.items():
            crossing = crossing_bytes(machines)
            holders = sum(machines[s] != machines[(s - 1) % STAGES] for s in range(STAGES))
            each = ", ".join(f"{r['step_seconds'] * 1000:.1f}" for r in results[(rate, name)])
            ratio = f"{medians['across'] / medians['together']:.3f}x" if name == "across" else ""
            print(f"| {rate} | {name} | {holders} of {STAGES} | {crossing['total'] / 1e6:.2f} "
                  f"({crossing['replica'] / 1e6:.2f} + {crossing['activations'] / 1e6:.2f}) | "
                  f"{medians[name] * 1000:.1f} | {each} | {ratio} |")


if __name__ == "__main__":
    main()
