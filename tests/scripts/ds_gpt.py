"""Train the small GPT with plain DeepSpeed code through lightning_bamboo.initialize (run under torchrun)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepspeed.pipe import PipelineModule  # noqa: E402
from helpers import TokenData, make_config  # noqa: E402

import lightning_bamboo  # noqa: E402
from lightning_bamboo.deepspeed_api import init_distributed  # noqa: E402
from lightning_bamboo.models.gpt import gpt_layers, gpt_loss  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed(timeout=60)
    cfg = make_config()
    torch.manual_seed(1234)
    module = PipelineModule(layers=gpt_layers(cfg), num_stages=args.stages, loss_fn=gpt_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "steps_per_print": 1000,
        "bamboo": {"redundancy": "off", "timeout": 60},
    }
    engine, opt, _, _ = lightning_bamboo.initialize(model=module, optimizer=optimizer, config=config)
    assert opt is optimizer and type(engine).__name__ == "BambooPipelineEngine"
    data = TokenData(cfg, args.steps * 8)
    micro = iter([data[i : i + 2] for i in range(0, len(data), 2)])
    for _ in range(args.steps):
        engine.train_batch(data_iter=micro)
    engine.save_layer_checkpoint(os.path.join(args.out, "final.ckpt"))
    if torch.distributed.get_rank() == 0:
        torch.save(lightning_bamboo.consolidate_checkpoint(os.path.join(args.out, "final.ckpt")), os.path.join(args.out, "final.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
