"""One job through either front door, for the behaviour suite both doors pass (``tests/test_doors.py``).

``--door deepspeed``: ``examples/deepspeed_spot.py``'s model and data through ``lightning_bamboo.init_distributed``
and ``initialize`` (a loop that owns its iterator and rewinds it on ``JobRestarted``). ``--door lightning``: the same
layers, data, optimizer and micro-batches as a ``LightningModule`` under ``Trainer(strategy=BambooStrategy(...))``.
Run under the Bamboo launcher. The same flags for both:

- the data shuffled in the order DeepSpeed's loader gives one pipeline (a ``DistributedSampler`` of one replica,
  seed 0; the Lightning door's ``shuffle=True`` with the job's seed);
- ``--save-every N`` saves a checkpoint into ``--save-dir`` every N steps (the DeepSpeed door's ``global_stepN``,
  Lightning's ``ModelCheckpoint`` files); the job's end saves ``SAVE_DIR/final`` either way;
- ``--resume`` starts from the newest checkpoint in ``--save-dir``;
- ``--audit`` turns the replica audit on (``audit_replicas``);
- ``NOTICE_URL`` and ``NOTICE_NODE`` in the environment: that node polls an AWS metadata service there for a spot
  notice (the DeepSpeed section's ``"notices"``, Lightning's ``PreemptionCallback``).

Every rank prints one draw of torch's generator after each step (``{"rank", "step", "draw"}``: whether a resume
restored it), and rank 0 ``{"door", "step", "audits"}`` at the end.
"""

import argparse
import itertools
import json
import os
import re
import sys
from pathlib import Path

import torch
from torch import nn

import lightning_bamboo

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from deepspeed_spot import Regression, layers  # noqa: E402

MICRO, MICRO_BATCHES, LR, WEIGHT_DECAY = 4, 4, 1e-3, 0.01


def notices() -> dict:
    """This node's notice source, when the test named it."""
    url = os.environ.get("NOTICE_URL")
    return {"aws": url} if url and os.environ.get("BAMBOO_NODE") == os.environ.get("NOTICE_NODE") else {}


def draw(rank: int, step: int) -> None:
    print(json.dumps({"rank": rank, "step": step, "draw": torch.rand(1).item()}), flush=True)


def deepspeed_door(args: argparse.Namespace) -> None:
    from deepspeed.pipe import PipelineModule

    lightning_bamboo.init_distributed()
    model = PipelineModule(layers=layers(), loss_fn=nn.MSELoss(), num_stages=args.stages, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "bamboo": {"redundancy": args.redundancy, "audit_replicas": args.audit, "notice_interval": 0.2,
                   **({"notices": notices()} if notices() else {})},
    }
    engine, _, loader, _ = lightning_bamboo.initialize(model=model, training_data=Regression(), config=config)
    drawn = engine.load_checkpoint(args.save_dir)[1]["data_position"] if args.resume else 0

    def micro_batches(skip: int):
        return itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), skip, None)

    it = micro_batches(drawn)
    while engine.global_steps < args.steps:
        try:
            engine.train_batch(data_iter=it)
        except lightning_bamboo.JobRestarted as restarted:
            it = micro_batches(restarted.data_position)
            continue
        draw(engine.global_rank, engine.global_steps)
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
    engine.save_checkpoint(args.save_dir, tag="final")
    if engine.global_rank == 0:
        print(json.dumps({"door": "deepspeed", "step": engine.global_steps, "audits": engine.runner.audits}), flush=True)


def lightning_door(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl

    class RegressionModule(pl.LightningModule):
        def configure_pipeline(self):
            return layers()

        def pipeline_loss(self, outputs, targets):
            return nn.functional.mse_loss(outputs, targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        def train_dataloader(self):
            # shuffled with the job's seed (0): the order DeepSpeed's loader gives one pipeline, as the DeepSpeed door
            # draws it
            return torch.utils.data.DataLoader(Regression(), batch_size=MICRO * MICRO_BATCHES, shuffle=True,
                                               drop_last=True)

    class Draws(pl.Callback):
        def on_train_batch_end(self, trainer, *_):
            draw(trainer.global_rank, trainer.global_step)

    callbacks: list = [Draws()]
    if args.save_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.save_dir, filename="step{step}", save_top_k=-1,
                                                      every_n_train_steps=args.save_every, auto_insert_metric_name=False))
    if notices():
        from lightning_bamboo.callbacks import PreemptionCallback
        from lightning_bamboo.callbacks.notices import AwsSpotPoller

        callbacks.append(PreemptionCallback(pollers=[AwsSpotPoller(endpoint=notices()["aws"])], poll_interval=0.2))
    strategy = lightning_bamboo.BambooStrategy(stages=args.stages, micro_batch_size=MICRO, partition="uniform",
                                               seed=1234, redundancy=args.redundancy, audit_replicas=args.audit)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                         max_steps=args.steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=bool(args.save_every))
    resume = None
    if args.resume:
        saved = [p for p in Path(args.save_dir).glob("step*") if re.fullmatch(r"step\d+(\.ckpt)?", p.name)]
        resume = str(max(saved, key=lambda p: int(re.sub(r"\D", "", p.name))))
    trainer.fit(RegressionModule(), ckpt_path=resume)
    trainer.save_checkpoint(os.path.join(args.save_dir, "final"))
    if trainer.is_global_zero:
        print(json.dumps({"door": "lightning", "step": trainer.global_step, "audits": trainer.strategy.audits}),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--door", choices=("lightning", "deepspeed"), required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--redundancy", default="lazy")
    parser.add_argument("--audit", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    (deepspeed_door if args.door == "deepspeed" else lightning_door)(args)


if __name__ == "__main__":
    main()
