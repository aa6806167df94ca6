"""A model of real size under the launcher: what each process holds against what its own layers need.

A GPT of GPT-2-medium's shape (24 blocks x 1024, vocabulary 50304, the embedding tied to the head as GPT-2 ties
them: 355M parameters, ``gpt_layer_specs(tie_embeddings=True)``) trains in 4 stages cut by parameters, one process
per stage under the Bamboo launcher, with ``redundancy="lazy"`` and AdamW: 2 steps, then node2 is SIGKILLed and
the job fails over, then 1 more step (tiny batches: this measures memory, not speed).

Each process reports its peak resident memory (``VmHWM``) above what it held before it built anything (its
interpreter with torch, DeepSpeed and Lightning imported), before the failover and over the whole run, next to
the bytes its own layers need (``_need``): its stage's weights, gradients and AdamW moments (16 bytes per parameter),
its replica's weights and moments (12), the shared buffers its replica's gradients arrive in and its stage's leave in
(two halves of 4 bytes per parameter each; RSS counts a shared page in each process that touched it) and a tied
copy's gradient receive buffer, in the layout it started in and in the one it ended in. The ratio of the first to the larger second is the target's (<= 1.25).

    python benchmarks/scale.py [--layers 24] [--width 1024] [--vocab 50304] [--kill-at 2] [--steps 3] [--fused]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_worker_flag, launcher_command, launcher_env, self_command

GiB = 2**30
TARGET = 1.25


def _rss(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _need(runner) -> dict[str, int]:  # noqa: ANN001 - the strategy's runner
    """The bytes this process's own layers need, as its RSS counts them.

    Its stage: weights, gradients and AdamW's two moments (16 bytes per parameter). Its replica: weights and moments
    (12: the replica's gradients are views of the buffer they arrive in). The replica's gradient buffer (two halves of
    4 bytes per parameter), and the one the stage's own gradients leave in: on one host both are shared memory, which
    the writer maps as well as the reader, and RSS counts a shared page in every process that touched it. A tied
    module with a copy in another process: a receive buffer of that copy's gradients (4 bytes per parameter)."""
    from lightning_bamboo.engine.ties import held_layers

    engine = runner.engine
    own = sum(p.numel() for p in engine.module.parameters())
    replica = sum(p.numel() for p in engine.replica.module.parameters()) if engine.replica is not None else 0
    shipped = own if runner.layout.stages > 1 and engine.replica is not None else 0
    held = held_layers(engine.module)
    tied = 0
    for layers in (getattr(engine.module, "ties", None) or {}).values():
        local = [i for i in layers if i in held]
        if local:
            tied += sum(p.numel() for p in held[local[0]].parameters()) * sum(i not in held for i in layers)
    return {"own_params": own, "replica_params": replica,
            "bytes": 16 * own + 12 * replica + 2 * 4 * replica + 2 * 4 * shipped + 4 * tied,
            "layers": list(engine.layer_range), "replica_layers": list(engine.replica.layers) if engine.replica else []}


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch

    import lightning_bamboo
    from lightning_bamboo.models.gpt import GPTConfig, gpt_layer_specs, gpt_loss

    before = _rss("VmRSS")  # imports done, nothing built
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=16, n_embd=args.width)
    node = os.environ.get("BAMBOO_NODE", "rank0")
    report: dict = {"node": node, "before": before}

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int):
            row = torch.randint(0, cfg.vocab_size, (cfg.block_size + 1,), generator=torch.Generator().manual_seed(i))
            return row[:-1], row[1:]

    class GPT(pl.LightningModule):
        def configure_pipeline(self):
            return gpt_layer_specs(cfg, tie_embeddings=True)

        def pipeline_loss(self, outputs, targets):
            return gpt_loss(outputs, targets)

        def configure_optimizers(self):
            # torch's default AdamW (for-each off on the CPU: two temporaries of a parameter's size); --fused: none
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=args.fused)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Tokens(), batch_size=2)

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, *rest) -> None:
            runner = trainer.strategy.runner
            report.setdefault("start", _need(runner))
            report["end"] = _need(runner)
            report["steps"] = trainer.global_step
            report["failovers"] = len(runner.failovers)
            if not runner.failovers:
                report["peak_before"] = _rss("VmHWM")  # the peak before any failover

    strategy = lightning_bamboo.BambooStrategy(stages=4, redundancy="lazy", partition="parameters",
                                               micro_batch_size=1, seed=0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 4)),
                         max_steps=args.steps, callbacks=[Watch()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(GPT())
    report["peak"] = _rss("VmHWM")
    report["shared"] = _rss("RssShmem")  # the gradient buffers' pages this process touched (in its RSS too)
    Path(args.out, f"{node}.json").write_text(json.dumps(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_worker_flag(parser)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--block", type=int, default=32, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=False,
                        help="AdamW(fused=True): no temporaries of a parameter's size (torch's default AdamW has two)")
    parser.add_argument("--kill-at", type=int, default=2, help="node2 is SIGKILLed at the start of this step")
    args = parser.parse_args()
    if args.role == "worker":
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as out:
        worker_command = self_command(__file__, "worker", "--out", out, "--layers", args.layers, "--width", args.width,
                                      "--vocab", args.vocab, "--block", args.block, "--steps", args.steps,
                                      "--fused" if args.fused else "--no-fused")
        victim = "node2"
        env = launcher_env(kills=[f"{victim}@{args.kill_at}"])
        proc = subprocess.run(launcher_command(worker_command, nodes=4), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=3000)
        reports = {p.stem: json.loads(p.read_text()) for p in Path(out).glob("*.json")}
    codes = [line for line in proc.stdout.splitlines() if "exit codes" in line]
    print(f"GPT {args.layers} x {args.width}, vocabulary {args.vocab}, embedding tied to the head; 4 stages by "
          f"parameters, lazy, AdamW(fused={args.fused}); {victim} SIGKILLed at step {args.kill_at}, {args.steps} steps")
    print(codes[-1] if codes else proc.stdout[-3000:])
    if proc.returncode != 0 or not reports:
        print(proc.stdout[-3000:])
        return 1
    worst = 0.0
    print(f"{'node':<6}{'layers':>14}{'replica':>14}{'params':>10}{'need GiB':>10}{'peak GiB':>10}{'ratio':>7}"
          "   (first row: the layout it started in, the peak before the failover; second: after it, the peak of the run)")
    for node, r in sorted(reports.items()):
        start, end = r["start"], r["end"]
        need = max(start["bytes"], end["bytes"])
        grown = r["peak"] - r["before"]
        ratio = grown / need
        worst = max(worst, ratio)
        for phase, held in (("start", start), ("end", end)):
            layers = f"{held['layers'][0]}-{held['layers'][-1]}"
            replica = f"{held['replica_layers'][0]}-{held['replica_layers'][-1]}" if held["replica_layers"] else "-"
            params = (held["own_params"] + held["replica_params"]) / 1e6
            before = r.get("peak_before", r["before"]) - r["before"]
            tail = (f"{grown / GiB:>10.2f}{ratio:>7.2f}" if phase == "end"
                    else f"{before / GiB:>10.2f}{before / start['bytes']:>7.2f}")
            print(f"{node if phase == 'start' else '':<6}{layers:>14}{replica:>14}{params:>9.1f}M"
                  f"{held['bytes'] / GiB:>10.2f}{tail}")
    print("shared memory in each RSS at the end (RssShmem, GiB): "
          + ", ".join(f"{node} {r['shared'] / GiB:.2f}" for node, r in sorted(reports.items())))
    total = sum(r["start"]["own_params"] for r in reports.values())
    print(f"failovers seen: {sorted({r['failovers'] for r in reports.values()})}; steps: "
          f"{sorted({r['steps'] for r in reports.values()})}; a survivor's layers at the start sum to {total / 1e6:.1f}M")
    print(f"peak RSS above the bare interpreter / what the own layers need: worst {worst:.2f}x (target <= {TARGET}x)")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
