"""A small GPT-style language model written as a flat list of pipeline layers.

A pipeline cuts a model between layers, so the model is written as the list
``[Embedding, Block, Block, ..., Head]`` instead of one module with a ``forward`` that loops.
Each layer takes one tensor and returns one tensor: that is all a pipeline stage can pass on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes: no tokenizer to download
    block_size: int = 32  # context length
    n_layer: int = 4  # transformer blocks; the pipeline has n_layer + 2 layers
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0  # 0: runs with and without a pipeline give the same numbers

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd must be a multiple of n_head (n_embd: {self.n_embd}, n_head: {self.n_head}); "
                f"pick n_embd = {self.n_head * max(1, self.n_embd // self.n_head)}"
            )


class Embedding(nn.Module):
    """Token ids (B, T) -> token + position embeddings (B, T, C).

    ``init_std``: draw both tables from N(0, init_std) instead of torch's N(0, 1), as GPT-2 does (0.02) where the
    token table is also the output head: logits of N(0, 1) rows start far from uniform."""

    def __init__(self, cfg: GPTConfig, init_std: float | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        if init_std is not None:
            with torch.no_grad():
                self.tok.weight.normal_(0.0, init_std)
                self.pos.weight.normal_(0.0, init_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.ff = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.ff(self.ln2(x)))


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.out = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class FinalNorm(nn.Module):
    """The final layer norm of a GPT whose output projection is the token embedding (``tie_embeddings``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


def tied_logits(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output head of a tied GPT: logits from the token embedding's weight (GPT-2's ``lm_head``)."""
    return F.linear(x, embedding.tok.weight)


def gpt_layers(cfg: GPTConfig) -> list[nn.Module]:
    """The model as pipeline layers, built in order (so a fixed seed gives fixed weights)."""
    return [Embedding(cfg), *(Block(cfg) for _ in range(cfg.n_layer)), Head(cfg)]


def gpt_layer_specs(cfg: GPTConfig, tie_embeddings: bool = False) -> list[Any]:
    """The model as DeepSpeed ``LayerSpec``s: each process of a pipeline builds only the layers it holds.

    Under ``strategy="bamboo"`` (and ``lightning_bamboo.initialize``) layer ``i`` is built under ``seed + i``, so
    its weights do not depend on the layout; they differ from ``gpt_layers``' (built in order under one seed).

    ``tie_embeddings``: GPT-2's layout, ``[embedding, blocks..., final norm, head]`` where the head projects with
    the token embedding's weight: the first and the last layer are ``TiedLayerSpec("embed", ...)``, one module
    whose copies on the first and the last stage are kept equal (n_layer + 3 layers).
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    blocks = [LayerSpec(Block, cfg) for _ in range(cfg.n_layer)]
    if tie_embeddings:
        return [TiedLayerSpec("embed", Embedding, cfg, init_std=0.02), *blocks, LayerSpec(FinalNorm, cfg),
                TiedLayerSpec("embed", Embedding, cfg, init_std=0.02, forward_fn=tied_logits,
                              tied_weight_attr=["tok.weight"])]
    return [LayerSpec(Embedding, cfg), *blocks, LayerSpec(Head, cfg)]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; ``targets`` are the inputs shifted by one."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
