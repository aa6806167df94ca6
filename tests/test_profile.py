"""Profiler: sizes match the layers, times are measured, and the model is left exactly as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.models.gpt import GPTConfig, gpt_layers
from lightning_bamboo.planner import Hardware, plan
from lightning_bamboo.planner.profile import profile_layers


def uneven_mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 64), nn.ReLU()), nn.Linear(64, 16), nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 4))]


def test_sizes_follow_the_layers_and_the_micro_batch() -> None:
    layers = uneven_mlp()
    prof = profile_layers(layers, torch.randn(3, 8), micro_batch_sizes=(1, 4), repeats=1, warmup=1)
    assert prof.micro_batch_sizes == (1, 4)
    widths = [64, 16, 4]
    for layer, lp, width in zip(layers, prof.layers, widths, strict=True):
        n_params = sum(p.numel() for p in layer.parameters())
        assert lp.param_bytes == lp.grad_bytes == 4 * n_params
        assert lp.optimizer_bytes >= 2 * lp.param_bytes  # Adam: two moments per parameter
        for size in (1, 4):
            assert lp.at(size).output_bytes == 4 * size * width
            assert lp.at(size).forward_seconds > 0 and lp.at(size).backward_seconds > 0
    # nn.Linear(64, 16) keeps its 64-wide input for backward: 4 bytes x 64 x micro-batch
    assert prof.layers[1].at(1).activation_bytes == 4 * 64
    assert prof.layers[1].at(4).activation_bytes == 4 * 64 * 4


def test_model_mode_gradients_weights_and_rng_are_untouched() -> None:
    layers = uneven_mlp()
    layers[0].eval()
    layers[1].weight.grad = torch.full_like(layers[1].weight, 3.0)
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    modes = [[m.training for m in layer.modules()] for layer in layers]
    sample = torch.randn(2, 8)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    profile_layers(layers, sample, micro_batch_sizes=(2,), repeats=1, warmup=0, threads=threads + 1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads
    assert [[m.training for m in layer.modules()] for layer in layers] == modes
    assert torch.equal(layers[1].weight.grad, torch.full_like(layers[1].weight, 3.0))
    assert layers[0][0].weight.grad is None and layers[2][1].weight.grad is None
    for layer, state in zip(layers, before, strict=True):
        for key, value in layer.state_dict().items():
            assert torch.equal(value, state[key]), key


def test_gpt_with_token_input_profiles_and_plans() -> None:
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)
    layers = gpt_layers(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    prof = profile_layers(layers, tokens, micro_batch_sizes=(1, 2), repeats=1, warmup=0)
    assert prof.num_layers == 4
    assert prof.layers[0].at(2).output_bytes == 4 * 2 * cfg.block_size * cfg.n_embd
    assert prof.layers[-1].at(1).output_bytes == 4 * cfg.block_size * cfg.vocab_size
    chosen = plan(prof, Hardware(memory_bytes=2**30), world_size=2, global_batch=4)
    assert chosen.partition[-1] == 4


def test_callable_sample_and_bad_arguments() -> None:
    seen = []

    def make(size: int) -> torch.Tensor:
        seen.append(size)
        return torch.randn(size, 8)

    profile_layers(uneven_mlp(), make, micro_batch_sizes=(3,), repeats=1, warmup=0)
    assert seen == [3]
    with pytest.raises(BambooConfigError, match="repeats"):
        profile_layers(uneven_mlp(), make, micro_batch_sizes=(1,), repeats=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profiles_on_gpu_and_leaves_the_model_on_cpu() -> None:
    layers = uneven_mlp()
    prof = profile_layers(layers, torch.randn(2, 8), micro_batch_sizes=(1, 2), device="cuda", repeats=2)
    assert prof.device.startswith("cuda")
    assert all(lp.at(2).forward_seconds > 0 for lp in prof.layers)
    assert all(p.device.type == "cpu" for layer in layers for p in layer.parameters())
