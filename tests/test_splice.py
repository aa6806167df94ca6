"""Reusing an eager redundant forward after a failover (engine.module.Splice), in one process."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lightning_bamboo.engine.module import BambooPipelineModule, Splice


def _stage(layers: list[nn.Module], splice: Splice | None) -> SimpleNamespace:
    """What BambooPipelineModule.forward reads of its module: a merged stage of layers 0..3, layers 2..3 spliced."""
    return SimpleNamespace(precision=None, checkpoint_every=0, splice=splice, activation_checkpoint_interval=0, seed_layers=False, _local_start=0,
                           forward_funcs=layers, keys=None, training=True, forwards=0)


def _kept(layers: list[nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An RF of layers 2..3 as the engine runs it: a leaf copy of the sent activation, the graph kept."""
    with torch.no_grad():
        sent = layers[1](layers[0](x))
    leaf = sent.clone().requires_grad_(True)
    return leaf, layers[3](layers[2](leaf))


def test_a_kept_forward_is_reused_and_its_backward_gives_the_same_gradients():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)]
    xs = [torch.randn(3, 4) for _ in range(2)]
    # plain: both micro-batches through all four layers
    for x in xs:
        nn.Sequential(*layers)(x).pow(2).sum().backward()
    plain = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    # failover: micro-batch 0 has a kept forward of layers 2..3, micro-batch 1 has none
    splice = Splice(2, {0: _kept(layers, xs[0])})
    stage = _stage(layers, splice)
    for x in xs:
        BambooPipelineModule.forward(stage, x).pow(2).sum().backward()
    assert splice.reused == [0] and splice.backwards == 1 and stage.forwards == 2
    spliced = [p.grad for layer in layers for p in layer.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, spliced, strict=True))


def test_a_kept_forward_of_other_inputs_is_not_reused():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)]
    x, other = torch.randn(3, 4), torch.randn(3, 4)
    splice = Splice(2, {0: _kept(layers, other)})  # kept for a different micro-batch: must not be spliced in
    out = BambooPipelineModule.forward(_stage(layers, splice), x)
    assert splice.reused == []
    assert torch.equal(out, layers[3](layers[2](layers[1](layers[0](x)))))
