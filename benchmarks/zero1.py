"""What ZeRO-1 would save a lightning_bamboo process: measured optimizer state against everything a node holds.

lightning_bamboo refuses ZeRO (``docs/precision.md``). This script measures the bytes behind that decision on a
real model and a real AdamW step (fp32 masters, as the engine keeps them in every precision): per parameter, the
weights, the fp32 gradients, AdamW's moments, and the replica of the successor's stage (the same again, in host
memory under ``redundancy="lazy"`` or ``"eager"``). ZeRO-1 shards only the optimizer's moments over the P
data-parallel pipelines; the script prints what that would take off a node for P = 1, 2, 4 and 8, with and without
a replica whose moments would be sharded too.

    python benchmarks/zero1.py [--layers 12] [--width 768]
"""

from __future__ import annotations

import argparse

import torch

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    args = parser.parse_args()
    cfg = GPTConfig(vocab_size=50304, block_size=128, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*gpt_layers(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.block_size + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    weights, grads = tensor_bytes(params), tensor_bytes(p.grad for p in params)
    moments = tensor_bytes(v for state in optimizer.state.values() for k, v in state.items() if k != "step")
    own = weights + grads + moments
    print(f"GPT {args.layers} blocks x {args.width}: {n / 1e6:.1f}M parameters; measured after one bf16-autocast AdamW step "
          f"(fp32 masters)")
    print(f"bytes per parameter: weights {weights / n:.1f}, gradients {grads / n:.1f}, AdamW moments {moments / n:.1f}; "
          f"a stage {own / n:.1f}, with its successor's replica {2 * own / n:.1f}")
    print(f"{'pipelines':>9} {'ZeRO-1 saves (own)':>19} {'of a node with replica':>23} {'with the replica sharded too':>29}")
    for pipelines in (1, 2, 4, 8):
        saved = moments * (1 - 1 / pipelines)
        print(f"{pipelines:>9} {saved / n:>15.1f} B/p {saved / (2 * own):>22.1%} {2 * saved / (2 * own):>28.1%}")


if __name__ == "__main__":
    main()
