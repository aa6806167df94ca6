"""A layer's random numbers belong to the layer (``engine.layer_rng``): the same wherever it runs, in one process."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lightning_bamboo.engine.layer_rng import StepKeys, layer_seed, run_layers
from lightning_bamboo.engine.module import BambooPipelineModule
from lightning_bamboo.engine.replica import StageContainer


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)) for _ in range(6)]


def _stage(layers: list[nn.Module], start: int, keys: StepKeys | None) -> SimpleNamespace:
    """What BambooPipelineModule.forward reads of its module, for a stage of ``layers`` starting at global ``start``."""
    return SimpleNamespace(precision=None, checkpoint_every=0, splice=None, activation_checkpoint_interval=0, seed_layers=False, _local_start=start,
                           forward_funcs=layers, keys=keys, training=True, forwards=0)


def test_a_layer_draws_the_same_numbers_whichever_stage_runs_it():
    layers, x, keys = _layers(), torch.randn(4, 16), StepKeys(seed=7, step=3, first_micro_batch=2)
    one_stage = _stage(layers, 0, keys)
    two_stages = [_stage(layers[:2], 0, keys), _stage(layers[2:], 2, keys)]
    for micro_batch in range(3):  # each forward of a step is the next micro-batch
        merged = BambooPipelineModule.forward(one_stage, x)
        split = BambooPipelineModule.forward(two_stages[1], BambooPipelineModule.forward(two_stages[0], x))
        # the replica's redundant forward of layers 2..5 draws what the stage that owns them draws
        replica = StageContainer(dict(enumerate(layers))).run(x, keys, micro_batch)
        assert torch.equal(merged, split) and torch.equal(merged, replica)
    assert one_stage.forwards == 3 and [s.forwards for s in two_stages] == [3, 3]


def test_the_masks_change_with_step_micro_batch_and_layer_and_the_process_streams_are_untouched():
    layers, x = _layers(), torch.ones(4, 16)
    drop = nn.Dropout(0.5)

    def mask(keys: StepKeys, micro_batch: int, index: int = 0) -> torch.Tensor:
        return run_layers([(index, drop)], x, keys, micro_batch) != 0

    keys = StepKeys(seed=7, step=3)
    assert torch.equal(mask(keys, 1), mask(keys, 1))
    others = [mask(StepKeys(seed=7, step=4), 1), mask(keys, 2), mask(keys, 1, index=1), mask(StepKeys(seed=8, step=3), 1),
              mask(StepKeys(seed=7, step=3, first_micro_batch=1), 0)]  # global micro-batch 1, as mask(keys, 1)
    assert [torch.equal(mask(keys, 1), other) for other in others] == [False, False, False, False, True]
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    run_layers(list(enumerate(layers)), x, keys, 0)
    assert torch.equal(torch.rand(5), expected)  # the process's stream goes on as if no layer had run


def test_without_keys_the_layers_draw_from_the_process_stream_as_deepspeed_runs_them():
    layers, x = _layers(), torch.ones(4, 16)
    torch.manual_seed(5)
    plain = nn.Sequential(*layers)(x)
    torch.manual_seed(5)
    assert torch.equal(run_layers(list(enumerate(layers)), x, None, 0), plain)


def test_seeds_differ_across_a_grid_of_steps_layers_and_micro_batches():
    seeds = {layer_seed(0, step, layer, micro) for step in range(50) for layer in range(20) for micro in range(20)}
    assert len(seeds) == 50 * 20 * 20 and all(0 <= s < 2**63 for s in seeds)


def test_checkpointed_segments_recompute_the_same_masks_and_keep_fewer_activations():
    """Dropout in every layer: run in checkpointed segments of 1 and 2 layers, the gradients equal the plain run's bit
    for bit (each layer re-seeds its stream in the recompute), and far fewer tensors stay saved for the backward."""
    from lightning_bamboo.engine.layer_rng import run_layers_checkpointed

    keys, x = StepKeys(seed=7, step=3, first_micro_batch=0), torch.randn(64, 16)
    results = {}
    for every in (0, 1, 2):
        layers = _layers()
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_layers_checkpointed(list(enumerate(layers)), x.clone().requires_grad_(), keys, 1, every)
        kept = sum(saved)
        out.square().sum().backward()
        results[every] = ([p.grad.clone() for layer in layers for p in layer.parameters()], kept)
    for every in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(results[every][0], results[0][0], strict=True))
        assert results[every][1] < results[0][1] / 2, (every, results[every][1], results[0][1])
