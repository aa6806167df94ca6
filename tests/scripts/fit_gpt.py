"""Train the small GPT through Trainer(strategy=BambooStrategy(...)); used by the multi-process tests.

Writes the consolidated weights to OUT/final.pt (rank 0) and a JSON line per event to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import TokenData, make_config  # noqa: E402

import lightning_bamboo  # noqa: E402
from lightning_bamboo.models.gpt import gpt_layer_specs, gpt_layers, gpt_loss  # noqa: E402

STAGE_DEVICE: dict[str, str] = {}


def logged_specs(cfg):
    """``gpt_layer_specs`` whose builds print ``{"built": index, "node": ..., "meta": ...}`` (a test counts them)."""
    from deepspeed.pipe import LayerSpec

    class Logged(LayerSpec):
        def __init__(self, index, spec):
            super().__init__(spec.typename, *spec.module_args, **spec.module_kwargs)
            self.index = index

        def build(self, log=False):
            layer = super().build(log)
            print(json.dumps({"built": self.index, "node": os.environ.get("BAMBOO_NODE"),
                              "meta": next(layer.parameters()).is_meta}), flush=True)
            return layer

    return [Logged(i, spec) for i, spec in enumerate(gpt_layer_specs(cfg))]


def StageDevice(pl):  # noqa: N802 - a Callback class for the namespace in use
    class _StageDevice(pl.Callback):
        """Where the stage trains (after fit, Lightning's teardown has moved the module to the CPU)."""

        def on_train_batch_end(self, trainer, *args):
            STAGE_DEVICE["seen"] = str(next(trainer.strategy.runner.engine.module.parameters()).device)

    return _StageDevice


def ReplicaCheck(pl):  # noqa: N802 - a Callback class for the namespace in use
    class _ReplicaCheck(pl.Callback):
        """After every step: rank 0 gathers every stage and every replica and compares them bit for bit."""

        def on_train_batch_end(self, trainer, *args):
            from lightning_bamboo.engine.replica import equal_states

            engine = trainer.strategy.engine
            mine = (engine.own_states(), engine.replica.stage, engine.replica.states(), engine.redundant_forwards_run,
                    engine.redundant is not None, engine.exchange.through_shared_memory,
                    engine.exchange.ships_written_ahead)
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, mine)
            if trainer.is_global_zero:
                problems = []
                for rank, (_, successor, replica, *_) in enumerate(gathered):
                    problems += [f"rank {rank}: {p}" for p in equal_states(replica, gathered[successor][0])]
                print(json.dumps({"replica_check": trainer.global_step, "problems": problems,
                                  "redundant_forwards": [g[3] for g in gathered],
                                  "kept_after_commit": [g[4] for g in gathered],
                                  "shared_memory": [g[5] for g in gathered],
                                  "written_ahead": [g[6] for g in gathered]}), flush=True)

    return _ReplicaCheck()


def StepLog(pl):  # noqa: N802 - a Callback class for the namespace in use
    class _StepLog(pl.Callback):
        """After every step, on rank 0: the global gradient norm (inf: an fp16 overflow, skipped) and the loss scale."""

        def on_train_batch_end(self, trainer, *args):
            finished = trainer.strategy.engine.finished
            state = trainer.strategy.runner.precision.state
            if trainer.is_global_zero:
                print(json.dumps({"step_end": trainer.global_step, "norm": finished.norm if finished else None,
                                  "overflow": finished.overflow if finished else None,
                                  "scale": state.scale if state else None}), flush=True)

    return _StepLog()


def PerturbReplica(pl, step: int, rank: int):  # noqa: N802 - a Callback class for the namespace in use
    class _PerturbReplica(pl.Callback):
        """A fault for the replica audit to find: before step ``step``, rank ``rank`` changes one weight of its replica."""

        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == step and trainer.global_rank == rank:
                replica = trainer.strategy.engine.replica
                replica.settle()
                with torch.no_grad():
                    next(replica.module.parameters()).view(-1)[0] += 1e-3

    return _PerturbReplica()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--namespace", default="lightning.pytorch")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu", help="Trainer(accelerator=...): cpu, or gpu (one GPU per process)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--async-every", type=int, default=0, help="AsyncCheckpoint every N steps into OUT/async")
    p.add_argument("--resume", default=None)
    p.add_argument("--partition", default="parameters")
    p.add_argument("--redundancy", default="off")
    p.add_argument("--rf-costs", default="measured", help="'measured' or FORWARD,BACKWARD (eager's RF placement)")
    p.add_argument("--detection-timeout", type=float, default=5.0, help="BambooStrategy(detection_timeout=...)")
    p.add_argument("--check-replicas", action="store_true", help="after every step, compare replicas with their originals")
    p.add_argument("--audit", action="store_true", help="BambooStrategy(audit_replicas=True)")
    p.add_argument("--lr-decay", type=float, default=None, help="multiply the learning rate by this after every step")
    p.add_argument("--perturb-replica", default=None, help="STEP:RANK: change one weight of that rank's replica before that step")
    p.add_argument("--precision", default="32-true", help="Trainer(precision=...)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout in every block")
    p.add_argument("--activation-checkpointing", type=int, default=0,
                   help="BambooStrategy(activation_checkpointing=...): layers per checkpointed segment")
    p.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    p.add_argument("--ds-config", default="{}", help="BambooStrategy(config=...): extra DeepSpeed config, as JSON")
    p.add_argument("--layer-specs", action="store_true",
                   help="configure_pipeline() returns LayerSpecs (each process builds only its layers; builds printed)")
    p.add_argument("--tied", action="store_true",
                   help="configure_pipeline() returns GPT-2's layout as LayerSpecs, the embedding tied to the head")
    p.add_argument("--n-layer", type=int, default=None, help="transformer blocks (default: the tests' config)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    pl = importlib.import_module(args.namespace)
    cfg = dataclasses.replace(make_config(), dropout=args.dropout)
    if args.n_layer is not None:
        cfg = dataclasses.replace(cfg, n_layer=args.n_layer)

    class GPT(pl.LightningModule):
        def configure_pipeline(self):
            if args.tied:
                return gpt_layer_specs(cfg, tie_embeddings=True)
            return logged_specs(cfg) if args.layer_specs else gpt_layers(cfg)

        def pipeline_loss(self, outputs, targets):
            return gpt_loss(outputs, targets)

        def configure_optimizers(self):
            if args.optimizer == "adam":
                optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
            elif args.optimizer == "adamw":
                optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            else:
                optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            if not args.lr_decay:
                return optimizer
            # the learning rate changes at every step: a replica or a resumed stage must follow its position
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: args.lr_decay ** step)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self):
            data = TokenData(cfg, args.steps * args.batch_size * (args.devices // args.stages))
            return torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False)

    partition = args.partition if not args.partition[0].isdigit() else [int(x) for x in args.partition.split(",")]
    strategy = (lightning_bamboo.BambooStrategy if args.namespace == "lightning.pytorch" else lightning_bamboo.PTLBambooStrategy)(
        stages=args.stages, micro_batch_size=args.micro_batch_size, partition=partition, seed=1234, timeout=60,
        redundancy=args.redundancy, detection_timeout=args.detection_timeout, audit_replicas=args.audit,
        config=json.loads(args.ds_config), activation_checkpointing=args.activation_checkpointing,
        rf_costs=args.rf_costs if args.rf_costs == "measured"
        else dict(zip(("forward", "backward"), map(float, args.rf_costs.split(",")), strict=True)),
    )
    callbacks = [StageDevice(pl)(), StepLog(pl)]
    if args.check_replicas:
        callbacks.append(ReplicaCheck(pl))
    if args.perturb_replica:
        callbacks.append(PerturbReplica(pl, *map(int, args.perturb_replica.split(":"))))
    if args.save_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.out, filename="step{step}", every_n_train_steps=args.save_every, save_top_k=-1,
                auto_insert_metric_name=False,
            )
        )
    if args.async_every:
        from lightning_bamboo.callbacks import AsyncCheckpoint

        callbacks.append(AsyncCheckpoint(dirpath=os.path.join(args.out, "async"), every_n_train_steps=args.async_every,
                                         keep_last=10))
    trainer = pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=args.devices, max_steps=args.steps, callbacks=callbacks,
        logger=pl.loggers.CSVLogger(args.out), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, precision=args.precision, gradient_clip_val=args.clip,
    )
    trainer.fit(GPT(), ckpt_path=args.resume)
    # every process: its live threads (a test counts those of old communication generations: none may be left),
    # its stage's device and the transport of its process group
    group = torch.distributed.distributed_c10d._get_default_group()
    print(json.dumps({"node": os.environ.get("BAMBOO_NODE", f"rank{trainer.global_rank}"),
                      "threads": sorted(t.name for t in threading.enumerate()),
                      "device": STAGE_DEVICE.get("seen"),
                      "transport": getattr(getattr(group, "comm", None), "transport", None)}), flush=True)
    trainer.save_checkpoint(os.path.join(args.out, "final.ckpt"))
    if trainer.is_global_zero:
        weights = lightning_bamboo.consolidate_checkpoint(os.path.join(args.out, "final.ckpt"))
        torch.save(weights, os.path.join(args.out, "final.pt"))
        res = trainer.strategy.resilience
        print(json.dumps({
            "global_step": trainer.global_step, "loss": float(trainer.callback_metrics["train_loss"]),
            "failovers": [f.as_dict() for f in res.failovers] if res is not None else [], "world_size": trainer.world_size,
            "audits": trainer.strategy.audits,
            "grad_norm": float(trainer.callback_metrics.get("grad_norm", float("nan"))),
            "loss_scale": trainer.strategy.runner.precision_meta().get("loss_scale"),
        }))


if __name__ == "__main__":
    main()
