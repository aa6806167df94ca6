"""examples/deepspeed_spot.py's model and data with a loop that owns its data iterator (``train_batch(data_iter=it)``)
and rewinds it when a fatal loss restarted the job (``lightning_bamboo.JobRestarted``). ``--redundancy`` sets the
"bamboo" section's (``off``: every loss is fatal, and the job restarts from its last checkpoint in place);
``--audit`` turns the replica audit on; ``--resume`` loads the latest checkpoint of ``--save-dir`` first. Every rank
prints one draw of torch's generator after each step (``{"draw": ...}``: whether a resume restored it), and rank 0 the
replica audits run at the end."""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from deepspeed.pipe import PipelineModule
from torch import nn

import lightning_bamboo

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from deepspeed_spot import Regression, layers  # noqa: E402


def micro_batches(loader, skip):
    """The loader's micro-batches over and over, after the first ``skip`` of them."""
    return itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), skip, None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--save-dir", default="ckpt")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--redundancy", default="off")
    parser.add_argument("--audit", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    lightning_bamboo.init_distributed()
    model = PipelineModule(layers=layers(), loss_fn=nn.MSELoss(), num_stages=args.stages, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "bamboo": {"redundancy": args.redundancy, "audit_replicas": args.audit},
    }
    engine, _, loader, _ = lightning_bamboo.initialize(model=model, training_data=Regression(), config=config)
    drawn = engine.load_checkpoint(args.save_dir)[1]["data_position"] if args.resume else 0
    it = micro_batches(loader, drawn)
    restarts = 0
    while engine.global_steps < args.steps:
        try:
            loss = engine.train_batch(data_iter=it)
        except lightning_bamboo.JobRestarted as restarted:
            restarts += 1
            it = micro_batches(loader, restarted.data_position)
            print(f"rewound to micro-batch {restarted.data_position} at step {restarted.step}", flush=True)
            continue
        print(json.dumps({"rank": engine.global_rank, "step": engine.global_steps, "draw": torch.rand(1).item()}),
              flush=True)
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
    engine.save_checkpoint(args.save_dir, tag="final")
    if engine.global_rank == 0:
        print(f"step {engine.global_steps}: loss {loss.item():.4f}; restarts {restarts}; audits {engine.runner.audits}")


if __name__ == "__main__":
    main()
