"""examples/deepspeed_spot.py's model and data with a loop that owns its data iterator (``train_batch(data_iter=it)``)
and rewinds it when a fatal loss restarted the job (``lightning_bamboo.JobRestarted``). ``--redundancy`` sets the
"bamboo" section's (``off``: every loss is fatal, and the job restarts from its last checkpoint in place)."""

import argparse
import itertools
import sys
from pathlib import Path

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
    args = parser.parse_args()

    lightning_bamboo.init_distributed()
    model = PipelineModule(layers=layers(), loss_fn=nn.MSELoss(), num_stages=args.stages, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "bamboo": {"redundancy": args.redundancy},
    }
    engine, _, loader, _ = lightning_bamboo.initialize(model=model, training_data=Regression(), config=config)
    it = micro_batches(loader, 0)
    restarts = 0
    while engine.global_steps < args.steps:
        try:
            loss = engine.train_batch(data_iter=it)
        except lightning_bamboo.JobRestarted as restarted:
            restarts += 1
            it = micro_batches(loader, restarted.data_position)
            print(f"rewound to micro-batch {restarted.data_position} at step {restarted.step}", flush=True)
            continue
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
    engine.save_checkpoint(args.save_dir, tag="final")
    if engine.global_rank == 0:
        print(f"step {engine.global_steps}: loss {loss.item():.4f}; restarts {restarts}")


if __name__ == "__main__":
    main()
