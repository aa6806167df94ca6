"""``engine.probe``: what one micro-batch holds in each layer of a stage, measured without changing the step."""

from __future__ import annotations

import torch
from torch import nn

from lightning_bamboo.engine.probe import measure_layers


def test_saved_and_output_bytes_per_layer_and_nothing_changed():
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 8)])
    layers.train()
    x = torch.randn(4, 16)
    rng, stats = torch.get_rng_state(), layers[1].running_mean.clone()
    sizes = measure_layers(enumerate(layers, start=3), layers, x)
    # the layer before the first gets what the stage receives; a Linear saves its input (4 x 16 floats) and
    # outputs 4 x 32; the batch norm saves its input, mean and inverse deviation; dropout its mask
    assert sizes[2] == (0, 4 * 16 * 4)
    assert sizes[3] == (4 * 16 * 4, 4 * 32 * 4)
    assert sizes[4][0] >= 4 * 32 * 4 and sizes[4][1] == 4 * 32 * 4
    assert sizes[5] == (4 * 32 * 4, 4 * 32 * 4)
    assert sizes[6] == (4 * 32 * 4, 4 * 8 * 4)
    # the random stream (dropout's) and the batch norm's running statistics are as they were: the step that
    # follows computes what it would have
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(layers[1].running_mean, stats)
    assert all(p.grad is None for p in layers.parameters())
