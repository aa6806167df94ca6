"""examples/deepspeed_pipe.py on spot machines: the import, init_distributed, initialize and the "bamboo" section.

    python -m lightning_bamboo.launcher --nodes 4 -- python examples/deepspeed_spot.py --steps 40 --save-dir ckpt

A node lost mid-run is taken over by its predecessor from the replica it keeps; the run ends as without it.
"""

import argparse

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

import lightning_bamboo

WIDTH, DEPTH = 32, 8


class Regression(torch.utils.data.Dataset):
    """A fixed random regression problem: y = tanh(x @ W) + noise."""

    def __init__(self, n=4096):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, WIDTH, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(WIDTH, WIDTH, generator=g)) + 0.1 * torch.randn(n, WIDTH, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def layers():
    specs = []
    for _ in range(DEPTH):
        specs += [LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Tanh)]
    return specs + [LayerSpec(nn.Linear, WIDTH, WIDTH)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--save-dir", default="ckpt")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    lightning_bamboo.init_distributed()
    model = PipelineModule(layers=layers(), loss_fn=nn.MSELoss(), num_stages=args.stages, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "steps_per_print": 10,
        "bamboo": {"redundancy": "lazy"},
    }
    engine, _, _, _ = lightning_bamboo.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        training_data=Regression(), config=config)
    if args.resume:
        engine.load_checkpoint(args.save_dir)
    while engine.global_steps < args.steps:
        loss = engine.train_batch()
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
    engine.save_checkpoint(args.save_dir, tag="final")
    if engine.global_rank == 0:
        print(f"step {engine.global_steps}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
