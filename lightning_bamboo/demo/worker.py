"""One node of the demo cluster: trains the built-in GPT with strategy='bamboo' under the demo launcher.

Run by ``lightning-bamboo demo`` (never by hand): the launcher sets the cluster environment
(``RANK``, ``WORLD_SIZE``, ``BAMBOO_STORE``, ``BAMBOO_NODE``...). After every step the node
records its progress in the store, which is how the launcher preempts "node2 at step 7".
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

import lightning_bamboo
from lightning_bamboo.callbacks import RebalanceCallback
from lightning_bamboo.engine.audit import ReplicaAuditError
from lightning_bamboo.errors import FATAL_EXIT_CODE, FatalLoss
from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss

#: exit status of a survivor that cannot fail over (a node and its replica holder were lost)
EXIT_FATAL = FATAL_EXIT_CODE
EXIT_AUDIT = 76  # a replica differed from its stage (``--audit``): the run stops, nothing restarts
#: exit status of a node that left after a preemption notice
EXIT_LEFT = 0
#: seconds a warm pool's process waits to be given a node before it exits (the demo stops its pool when it ends)
POOL_WAIT_SECONDS = 24 * 3600.0

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=48)  # 8 pipeline layers (DEMO_LAYERS)


class Tokens(torch.utils.data.Dataset):
    """Deterministic synthetic sequences (no download); the target is the input shifted by one."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.block_size + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i, :-1], self.tokens[i, 1:]


#: ``ulp``: the first weight of the first block starts one ulp higher (how far one rounding drifts a run apart)
PERTURB_ENV = "BAMBOO_DEMO_PERTURB"
#: ``bf16`` or ``fp16``: the layers run under autocast in that precision, fp32 master weights (the strategy's
#: DeepSpeed config ``{"bf16": {"enabled": True}}``); absent or empty: fp32
PRECISION_ENV = "BAMBOO_DEMO_PRECISION"
#: a float: clip the gradients by their global norm to it (the Trainer's ``gradient_clip_val``); absent or 0: off
CLIP_ENV = "BAMBOO_DEMO_CLIP"
#: ``PRECISION_ENV``'s values -> the DeepSpeed config's section
PRECISION_SECTIONS = {"bf16": "bf16", "fp16": "fp16"}


def numerics() -> tuple[dict, float | None]:
    """The strategy's DeepSpeed config and the Trainer's ``gradient_clip_val`` from ``PRECISION_ENV`` and
    ``CLIP_ENV`` (``benchmarks/chaos.py --precision/--clip``; the demo's command line has no flag for them)."""
    precision = os.environ.get(PRECISION_ENV, "")
    if precision and precision not in PRECISION_SECTIONS:
        raise SystemExit(f"{PRECISION_ENV}={precision!r}: use one of {', '.join(PRECISION_SECTIONS)} (unset: fp32)")
    config = {PRECISION_SECTIONS[precision]: {"enabled": True}} if precision else {}
    try:
        clip = float(os.environ.get(CLIP_ENV) or 0.0)
    except ValueError:
        raise SystemExit(f"{CLIP_ENV}={os.environ[CLIP_ENV]!r}: a number, the global norm to clip to") from None
    if clip < 0:
        raise SystemExit(f"{CLIP_ENV}={clip:g}: the norm to clip to is 0 (off) or more")
    return config, clip or None


class DemoGPT(pl.LightningModule):
    def __init__(self, samples: int, batch_size: int, optimizer: str = "sgd", dropout: float = 0.0) -> None:
        super().__init__()
        self.samples, self.batch_size, self.optimizer_name, self.dropout = samples, batch_size, optimizer, dropout

    def configure_pipeline(self):
        layers = gpt_layers(dataclasses.replace(CONFIG, dropout=self.dropout))
        if os.environ.get(PERTURB_ENV) == "ulp":  # benchmarks/noise_floor.py: one weight one ulp up, on every node
            with torch.no_grad():
                weight = next(layers[1].parameters()).view(-1)
                weight[0] = torch.nextafter(weight[0], torch.tensor(float("inf")))
        return layers

    def pipeline_loss(self, outputs, targets):
        return gpt_loss(outputs, targets)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":  # moments and a step count per parameter: more state a replica must match
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Tokens(self.samples), batch_size=self.batch_size)


class SampleOrder(pl.Callback):
    """Writes the dataset indices of every finished step to ``order-<node>.json`` (checks data order)."""

    def __init__(self, data: Tokens, path: Path) -> None:
        self.index = {bytes(row[:-1].numpy().tobytes()): i for i, row in enumerate(data.tokens)}
        self.path = path
        self.steps: list[list[int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        samples = [self.index[bytes(row.numpy().tobytes())] for row in batch[0]]
        self.steps.append(samples)
        self.path.write_text(json.dumps(self.steps))
        # and by step number, appended (a SIGKILL loses no earlier line): which samples each step trained on,
        # whichever process and job ran it (``benchmarks/chaos.py`` checks none is lost or repeated)
        with self.path.with_name(self.path.name.replace("order-", "samples-") + "l").open("a") as log:
            log.write(json.dumps({"step": trainer.global_step, "samples": samples}) + "\n")


class Progress(pl.Callback):
    """Puts ``progress/<node>`` = the number of finished steps into the store after every step."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.strategy.runner.publish("progress", str(trainer.global_step))
        if self.delay:
            time.sleep(self.delay)  # demo pacing, so a person can watch; 0 in tests


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=8, help="samples per step of each pipeline the job starts with")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step over all pipelines (default: "
                   "--batch-size); sizes the dataset")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--redundancy", default="lazy")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--detection-timeout", type=float, default=5.0)
    p.add_argument("--partition", default="parameters", help="uniform, parameters or boundaries like 0,2,5,8")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--resume", default=None)
    p.add_argument("--out", required=True, help="directory for this run's report part and weights")
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--preferred-stages", type=int, default=None, help="the depth to return to when nodes join")
    p.add_argument("--audit", action="store_true", help="compare every replica with its stage after every step and "
                   "membership change (BambooStrategy(audit_replicas=True))")
    p.add_argument("--restart-in-place", action="store_true",
                   help="after a fatal loss, offer this process to the restarted job instead of exiting")
    return p.parse_args(argv)


def main() -> int:
    from lightning_bamboo.demo.pool import POOLED

    pooled = sys.argv[1:] == [POOLED]  # a warm pool's process: its node and arguments come with its assignment
    if not pooled:
        args = parse(sys.argv[1:])
    import deepspeed  # noqa: F401 - imported now (the strategy would, later) so that its objects are frozen too

    # What the interpreter and the libraries made at import lives as long as the process: out of the
    # collector's way, the full collections of a restart in this process (``release_for_restart``) take
    # milliseconds instead of a fifth of a second each.
    gc.freeze()
    if pooled:
        from lightning_bamboo.membership.node import die_with_parent
        from lightning_bamboo.membership.offers import offer_process

        die_with_parent(True)
        assignment = offer_process(timeout=POOL_WAIT_SECONDS)
        if assignment is None:
            return 0  # never needed
        die_with_parent(False)
        args = _assigned(assignment)
    while True:
        try:
            return train(args)
        except ReplicaAuditError as err:
            # every node found the same difference: the controller stops the demo with this message
            print(json.dumps({"node": os.environ.get("BAMBOO_NODE", "node0"), "audit": str(err)}), flush=True)
            return EXIT_AUDIT
        except FatalLoss as err:
            print(json.dumps({"node": os.environ.get("BAMBOO_NODE", "node0"), "fatal": str(err)}), flush=True)
            assignment = _restart_in_place() if args.restart_in_place else None
            if assignment is None:
                return EXIT_FATAL
            args = _assigned(assignment)


def _assigned(assignment: dict) -> argparse.Namespace:
    """Take on an assignment (``offer_process``): its node's environment, its job's log; its arguments, parsed."""

    if assignment.get("log"):  # the output of the job it runs now goes with that job's
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(assignment["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.update(assignment["env"])  # a standby node's process may join the next job as one again
    return parse(assignment["args"])


def _restart_in_place() -> dict | None:
    """Free the failed job and wait to be given the next one (``lightning_bamboo.membership.offers.offer_process``)."""
    from lightning_bamboo.membership.offers import offer_process
    from lightning_bamboo.strategy.patches import release_for_restart

    release_for_restart()
    assignment = offer_process()
    if assignment is not None:
        # as a fresh process starts: the checkpoint restores the model, the loops and the data cursor;
        # the default generator goes back to its initial seed (a new interpreter's state)
        torch.manual_seed(torch.initial_seed())
    return assignment


def train(args: argparse.Namespace) -> int:
    node = os.environ.get("BAMBOO_NODE", "node0")
    model = DemoGPT(samples=args.steps * (args.global_batch or args.batch_size), batch_size=args.batch_size,
                    optimizer=args.optimizer, dropout=args.dropout)
    config, clip = numerics()
    strategy = lightning_bamboo.BambooStrategy(
        # a lone survivor restarted with its redundancy on runs one stage until nodes join (stages=None: the world's)
        stages=None if args.stages == 1 and args.redundancy != "off" else args.stages, micro_batch_size=args.micro_batch_size, seed=0,
        partition=[int(x) for x in args.partition.split(",")] if args.partition[0].isdigit() else args.partition,
        redundancy=args.redundancy, timeout=60, detection_timeout=args.detection_timeout, audit_replicas=args.audit,
        restart_on_fatal_loss=False,  # the demo's controller restarts the job (counting how it recovered)
        config=config,
    )
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=args.checkpoint_dir, filename="step{step}", every_n_train_steps=args.checkpoint_every,
        save_top_k=-1, auto_insert_metric_name=False,
    )
    out = Path(args.out)
    callbacks = [Progress(args.step_delay), checkpoints, SampleOrder(Tokens(model.samples), out / f"order-{node}.json")]
    if args.redundancy != "off":
        # after a failover: even out the layers; when spare nodes join: the preferred depth again
        callbacks.append(RebalanceCallback(stages=args.preferred_stages))
    # SIGTERM is a preemption notice: a flag-only handler; the node announces that it leaves
    # before its next commit and exits once that step committed (see Session.commit).
    from lightning_bamboo.runtime.leave import LEAVE

    LEAVE.on_sigterm()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", args.stages)),
        max_steps=args.steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=clip,  # clipped by norm in the engine
    )
    start = time.perf_counter()
    trainer.fit(model, ckpt_path=args.resume)
    seconds = time.perf_counter() - start
    trainer.save_checkpoint(out / "final.ckpt", weights_only=False)  # trusted: a save, no load (weights and optimizer state)
    if trainer.is_global_zero:
        runner = strategy.runner
        report = {
            "steps_completed": trainer.global_step,
            "final_loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
            "failovers": [record.as_dict() for record in runner.failovers],
            "train_seconds": seconds,
            "resumed_from": args.resume,
            "world_size": trainer.world_size,
            "parts": list(runner.layout.parts),
            "micro_batches": runner.micro_batches,
        }
        torch.save(lightning_bamboo.consolidate_checkpoint(out / "final.ckpt"), out / "weights.pt")
        (out / "report.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
