"""Reduced precision's pieces in one process: the config it takes and refuses, the loss scale against DeepSpeed's own,
and a global norm that does not depend on how the layers are split into stages."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_bamboo.engine.precision import (
    LossScaling,
    Precision,
    StepFinish,
    from_lightning,
    layer_square_norms,
    resolve,
    total_norm,
)
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.runtime.config import BambooConfig


@pytest.mark.parametrize("flag, config, expected", [
    ("bf16-mixed", {}, "bf16"), ("bf16-true", {}, "bf16"), ("32-true", {"bf16": {"enabled": True}}, "bf16"),
    ("32-true", {"fp16": {"enabled": True}}, "16"), ("16-mixed", {}, "16"),
    ("32-true", {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "bf16"),
    ("32-true", {"bf16": {"enabled": False}}, "32"), ("bf16-mixed", {"bf16": {"enabled": True}}, "bf16"),
])
def test_lightning_flags_and_deepspeed_sections_give_one_precision(flag, config, expected):
    precision, rest = resolve(from_lightning(flag), config, None)
    assert precision.name == expected
    assert not {"bf16", "fp16", "torch_autocast"} & set(rest)  # the engine's own, never DeepSpeed's optimizers
    assert (precision.state is not None) == (expected == "16")


@pytest.mark.parametrize("config, rule", [
    ({"zero_optimization": {"stage": 1}}, "ZeRO is not supported with replicas"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "ZeRO is not supported"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "gradients accumulate in fp32"),
    ({"communication_data_type": "fp16"}, "gradients are reduced in fp32"),
    ({"amp": {"enabled": True}}, 'apex "amp" is not supported'),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enables both fp16 and bf16"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, 'unsupported keys in the "fp16"'),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "loss_scale_window >= 1"),
])
def test_what_would_not_be_exact_is_refused_when_the_strategy_is_built(config, rule):
    with pytest.raises(BambooConfigError, match=rule):
        BambooConfig(stages=2, redundancy="lazy", deepspeed=config)


def test_lightning_flag_and_config_that_disagree_are_refused():
    with pytest.raises(BambooConfigError, match="disagree"):
        resolve("bf16", {"fp16": {"enabled": True}}, None)
    with pytest.raises(BambooConfigError, match="gradient_clip_val .* and the DeepSpeed config's gradient_clipping"):
        resolve("32", {"gradient_clipping": 1.0}, 0.5)
    with pytest.raises(BambooConfigError, match="64-true"):
        from_lightning("64-true")
    precision, rest = resolve("32", {"gradient_clipping": 1.0, "steps_per_print": 5}, None)
    assert precision.gradient_clipping == 1.0 and rest == {"steps_per_print": 5}


def test_the_loss_scale_follows_deepspeeds_dynamic_loss_scaler(tmp_path):
    """The same overflow sequence through DeepSpeed's ``DynamicLossScaler`` and ``ScaleState``: the same scale at
    every step, for hysteresis 1 and 2, consecutive or not."""
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from lightning_bamboo.engine.construct import ensure_deepspeed_comm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    ensure_deepspeed_comm("gloo")  # DeepSpeed's scaler logs an overflow with the rank
    try:
        rng = random.Random(3)
        for hysteresis in (1, 2):
            for consecutive in (False, True):
                scaling = LossScaling(initial_scale_power=12, loss_scale_window=3, hysteresis=hysteresis,
                                      min_loss_scale=1.0, consecutive_hysteresis=consecutive)
                ours = Precision("16", scaling).state
                theirs = DynamicLossScaler(2.0 ** 12, 3, 1.0, hysteresis, consecutive, raise_error_at_min_scale=False)
                for _ in range(200):
                    overflow = rng.random() < 0.3
                    ours.update(overflow, scaling)
                    theirs.update_scale(overflow)
                    assert (ours.scale, ours.hysteresis_left) == (theirs.cur_scale, theirs.cur_hysteresis)
    finally:
        ds_comm.cdb = None
        dist.destroy_process_group()


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(5)]


def _stage(layers, indices):
    stage = torch.nn.Module()
    for i in indices:
        stage.add_module(str(i), layers[i])
    return stage


def test_the_global_norm_and_the_clipped_gradients_do_not_depend_on_the_split():
    """Gradients of 5 layers, held as 5 one-layer stages or as stages [0-1] and [2-4]: the summed per-layer norms, and
    the gradients after clipping, are equal bit for bit; the norm agrees with torch's ``clip_grad_norm_``."""
    layers = _layers()
    out = torch.nn.Sequential(*layers)(torch.randn(4, 8))
    out.square().sum().backward()
    grads = [p.grad.clone() for p in torch.nn.Sequential(*layers).parameters()]

    def clipped(splits):
        for p, g in zip(torch.nn.Sequential(*layers).parameters(), grads, strict=True):
            p.grad = g.clone()
        stages = [_stage(layers, s) for s in splits]
        summed = sum(layer_square_norms(s, 5, torch.device("cpu")) for s in stages)
        results = [StepFinish(Precision("32", gradient_clipping=0.1)).run(
            s, 5, True, lambda t, summed=summed: t.copy_(summed), torch.device("cpu")) for s in stages]
        return results, [p.grad.clone() for p in torch.nn.Sequential(*layers).parameters()]

    fine, fine_grads = clipped([[i] for i in range(5)])
    coarse, coarse_grads = clipped([[0, 1], [2, 3, 4]])
    assert len({r.norm for r in fine + coarse}) == 1
    assert all(torch.equal(a, b) for a, b in zip(fine_grads, coarse_grads, strict=True))
    expected = torch.nn.utils.get_total_norm(grads)
    assert fine[0].norm == pytest.approx(float(expected), rel=1e-6) and fine[0].norm > 0.1
    assert total_norm(torch.tensor([1.0, float("inf")], dtype=torch.float64)) == float("inf")


def test_an_fp16_overflow_anywhere_is_found_and_the_gradients_unscaled_otherwise():
    layers = _layers()
    stage = _stage(layers, range(5))
    for p in stage.parameters():
        p.grad = torch.full_like(p, 4.0)
    precision = Precision("16", LossScaling(initial_scale_power=2))
    result = StepFinish(precision).run(stage, 5, True, lambda t: None, torch.device("cpu"))
    assert not result.overflow and all(torch.equal(p.grad, torch.ones_like(p)) for p in stage.parameters())
    next(stage.parameters()).grad[0, 0] = float("inf")
    assert StepFinish(precision).run(stage, 5, True, lambda t: None, torch.device("cpu")).overflow
