"""Reduced precision that a replica follows bit for bit: fp32 master weights, bf16 or fp16 compute.

Every parameter stays an fp32 *master* weight; the layers run under ``torch.autocast`` in bf16 or
fp16 (matrix products in the low precision, reductions such as norms and losses in fp32), and each
micro-batch's gradient lands on the fp32 parameter, so gradients accumulate in fp32. That is the
arithmetic of DeepSpeed's ``torch_autocast`` section and of Lightning's ``"bf16-mixed"``; the
``bf16``/``fp16`` sections of a DeepSpeed config and Lightning's ``"bf16-true"``/``"16-true"`` run
the same way here (see ``docs/precision.md`` for what differs from DeepSpeed's own bf16 optimizer).

Why not DeepSpeed's ``BF16_Optimizer``/``FP16_Optimizer``: they keep their masters and fp32
gradients in flat buffers of their own, partitioned across the data-parallel pipelines, with the
model's ``p.grad`` zeroed between micro-batches. A replica (``engine.replica``) must hold exactly
what its owner's optimizer holds and apply exactly the update the owner applies; with the masters
being the parameters, the replica's state, the gradients shipped to it, the per-layer checkpoint and
``consolidate_checkpoint`` are all the fp32 masters, unchanged from fp32 training.

What the step adds (:class:`StepFinish`, run by the engine where DeepSpeed's ``OptimizerStep`` is):
fp16's dynamic loss scale (the loss is multiplied by the scale before its backward, the gradients
divided by it before the update, a step with an inf or nan gradient anywhere is skipped everywhere
and the scale lowered, as DeepSpeed's ``DynamicLossScaler`` does), and clipping by the global norm.
The norm is summed from per-layer squared norms in layer order (an all-reduce in which each layer's
value is contributed once, by the first pipeline, and zeros elsewhere: exact), so every process and
every layout (a stage merged with its successor's after a failover) finds the same norm and the same
clip coefficient. The owner clips before it ships its gradients: the replica receives the clipped
gradients the owner's optimizer consumes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_bamboo.errors import BambooConfigError

#: precision name -> the autocast dtype (None: fp32)
DTYPES: dict[str, torch.dtype | None] = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}

#: Lightning's precision flags -> our precision names (as Lightning's DeepSpeedStrategy maps them to DeepSpeed's
#: bf16/fp16 sections: "-true" and "-mixed" give the same engine)
LIGHTNING_PRECISIONS = {
    "32-true": "32", "32": "32",
    "bf16-mixed": "bf16", "bf16-true": "bf16", "bf16": "bf16",
    "16-mixed": "16", "16-true": "16", "16": "16",
}

_TORCH_DTYPE_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "torch.bfloat16": "bf16",
                      "float16": "16", "fp16": "16", "half": "16", "torch.float16": "16"}

#: the fp16 section's keys (DeepSpeed's names) and what they set
_FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
              "consecutive_hysteresis", "auto_cast"}
_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow"}


@dataclass(frozen=True)
class LossScaling:
    """fp16's loss scale, with DeepSpeed's ``fp16`` options and defaults: ``loss_scale`` > 0 is a static scale;
    0 is dynamic, starting at ``2 ** initial_scale_power``, halved (not below ``min_loss_scale``) at an overflow once
    ``hysteresis`` overflows were absorbed, doubled after each ``loss_scale_window`` steps without one (DeepSpeed's
    ``DynamicLossScaler`` rule; at ``min_loss_scale`` the step is skipped and the scale stays, where DeepSpeed stops)."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False


@dataclass
class ScaleState:
    """The loss scale's state: the same on every process (every change follows a step all of them committed)."""

    scale: float
    iteration: int = 0
    last_overflow: int = -1
    hysteresis_left: int = 1
    skipped: int = 0

    def update(self, overflow: bool, scaling: LossScaling) -> None:
        """After a committed step: lower the scale at an overflow, raise it after a window without one."""
        if scaling.loss_scale > 0:
            self.skipped += int(overflow)
            self.iteration += 1
            return
        if overflow:
            self.skipped += 1
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2, scaling.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if scaling.consecutive_hysteresis:
                self.hysteresis_left = scaling.hysteresis
            clean_steps = self.iteration - self.last_overflow - 1  # before this one, since the last overflow
            if clean_steps > 0 and clean_steps % scaling.loss_scale_window == 0:
                self.hysteresis_left = scaling.hysteresis
                self.scale *= 2
        self.iteration += 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Precision:
    """How a job computes: ``name`` "32", "bf16" or "16"; fp16's ``scaling``; ``gradient_clipping`` by the global norm
    (0: off). ``state``: fp16's loss scale, shared by every engine this process builds (it outlives failovers)."""

    name: str = "32"
    scaling: LossScaling | None = None
    gradient_clipping: float = 0.0
    state: ScaleState | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.name not in DTYPES:
            raise BambooConfigError(f"precision must be one of {sorted(DTYPES)} (precision: {self.name!r})")
        if self.name == "16" and self.scaling is None:
            self.scaling = LossScaling()
        if self.scaling is not None and self.state is None:
            scale = self.scaling.loss_scale or 2.0 ** self.scaling.initial_scale_power
            self.state = ScaleState(scale=float(scale), hysteresis_left=self.scaling.hysteresis)
        if self.gradient_clipping < 0 or not math.isfinite(self.gradient_clipping):
            raise BambooConfigError(f"gradient clipping must be a norm >= 0 (gradient_clip_val: {self.gradient_clipping!r})")

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES[self.name]

    @property
    def reduced(self) -> bool:
        return self.dtype is not None

    @property
    def finishes_step(self) -> bool:
        """Whether the step needs :class:`StepFinish` (a loss scale or clipping): a collective over every process."""
        return self.scaling is not None or self.gradient_clipping > 0

    @property
    def loss_scale(self) -> float:
        return self.state.scale if self.state is not None else 1.0

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The context the layers (and the loss) run in: autocast to ``dtype`` on ``device``'s type, or nothing."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)

    def describe(self) -> str:
        if self.dtype is None:
            return "fp32"
        text = f"{'bf16' if self.name == 'bf16' else 'fp16'} compute, fp32 master weights and gradients"
        if self.scaling is not None:
            text += (f", static loss scale {self.scaling.loss_scale:g}" if self.scaling.loss_scale
                     else f", dynamic loss scale from 2^{self.scaling.initial_scale_power}")
        return text


def from_lightning(flag: Any) -> str:
    """Our precision name for a Lightning ``precision`` flag; refused when there is none."""
    text = str(flag)
    if text not in LIGHTNING_PRECISIONS:
        raise BambooConfigError(
            f"strategy='bamboo' runs precision '32-true', 'bf16-mixed' or '16-mixed' (and their '-true' forms, the same "
            f"engine here) (precision: {text!r}); use one of {sorted(LIGHTNING_PRECISIONS)}"
        )
    return LIGHTNING_PRECISIONS[text]


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def split_deepspeed_config(config: Mapping[str, Any]) -> tuple[str, LossScaling | None, float | None, dict[str, Any]]:
    """Take the arithmetic out of a DeepSpeed config: ``(precision, fp16 scaling, gradient_clipping or None, the rest)``.

    What changes the arithmetic and cannot be followed exactly by a replica is refused here, before anything
    starts (``docs/precision.md``): ZeRO (any stage, and offload), a gradient accumulation or communication dtype
    other than fp32, apex ``amp``, both fp16 and bf16.
    """
    rest = dict(config)
    fp16, bf16, autocast = rest.pop("fp16", None), rest.pop("bf16", None), rest.pop("torch_autocast", None)
    if "bfloat16" in rest:  # DeepSpeed's older name of the bf16 section
        bf16 = rest.pop("bfloat16") if bf16 is None else bf16
    clipping = rest.pop("gradient_clipping", None)
    _refuse_unsupported(rest)
    chosen = [name for name, section in (("fp16", fp16), ("bf16", bf16)) if _enabled(section)]
    if _enabled(autocast):
        dtype = str(autocast.get("dtype", "bfloat16"))
        if dtype not in _TORCH_DTYPE_NAMES:
            raise BambooConfigError(f'"torch_autocast.dtype" must be bfloat16 or float16 (got {dtype!r})')
        chosen.append("fp16" if _TORCH_DTYPE_NAMES[dtype] == "16" else "bf16")
    if len(set(chosen)) > 1:
        raise BambooConfigError(f"the DeepSpeed config enables both fp16 and bf16 ({', '.join(chosen)}); enable one")
    if not chosen:
        return "32", None, clipping, rest
    if chosen[0] == "bf16":
        extra = sorted(set(bf16 or {}) - _BF16_KEYS)
        if extra:
            raise BambooConfigError(f'unsupported keys in the "bf16" config section: {extra}; supported: {sorted(_BF16_KEYS)}')
        return "bf16", None, clipping, rest
    section = dict(fp16 or {})
    extra = sorted(set(section) - _FP16_KEYS)
    if extra:
        raise BambooConfigError(f'unsupported keys in the "fp16" config section: {extra}; supported: {sorted(_FP16_KEYS)}')
    scaling = LossScaling(
        loss_scale=float(section.get("loss_scale", 0.0)),
        initial_scale_power=int(section.get("initial_scale_power", 16)),
        loss_scale_window=int(section.get("loss_scale_window", 1000)),
        hysteresis=int(section.get("hysteresis", 2)),
        min_loss_scale=float(section.get("min_loss_scale", 1.0)),
        consecutive_hysteresis=bool(section.get("consecutive_hysteresis", False)),
    )
    if scaling.loss_scale < 0 or scaling.loss_scale_window < 1 or scaling.hysteresis < 1 or scaling.min_loss_scale <= 0:
        raise BambooConfigError(f"fp16 loss scaling options out of range ({scaling}); loss_scale >= 0, "
                                "loss_scale_window >= 1, hysteresis >= 1, min_loss_scale > 0")
    return "16", scaling, clipping, rest


def _refuse_unsupported(config: Mapping[str, Any]) -> None:
    zero = config.get("zero_optimization")
    if isinstance(zero, Mapping) and (int(zero.get("stage", 0) or 0) > 0 or zero.get("offload_optimizer")
                                      or zero.get("offload_param")):
        raise BambooConfigError(
            f"ZeRO is not supported with replicas (zero_optimization: {dict(zero)}): a stage's optimizer state "
            "would be sharded over the pipelines, and a replica or a surviving pipeline could not restore a lost "
            "pipeline's shard exactly. Remove \"zero_optimization\" (docs/precision.md gives what ZeRO-1 would save)"
        )
    types = config.get("data_types")
    accum = types.get("grad_accum_dtype") if isinstance(types, Mapping) else None
    if accum not in (None, "fp32", "float32", "float", "torch.float32"):
        raise BambooConfigError(
            f'gradients accumulate in fp32 here (data_types.grad_accum_dtype: {accum!r}); remove it or set "fp32"'
        )
    comm = config.get("communication_data_type")
    if comm not in (None, "fp32", "float32"):
        raise BambooConfigError(
            f'gradients are reduced in fp32 here (communication_data_type: {comm!r}); remove it or set "fp32"'
        )
    if _enabled(config.get("amp")):
        raise BambooConfigError('apex "amp" is not supported; use "bf16": {"enabled": true} or "fp16": {"enabled": true}')


def resolve(lightning_flag: Any, deepspeed: Mapping[str, Any], gradient_clip_val: float | None) -> tuple[Precision, dict[str, Any]]:
    """The job's :class:`Precision` from Lightning's flag, the DeepSpeed config and Lightning's ``gradient_clip_val``
    (with the rest of the DeepSpeed config); refused where they disagree."""
    name, scaling, clipping, rest = split_deepspeed_config(deepspeed)
    flag = from_lightning(lightning_flag) if lightning_flag is not None else "32"
    if flag != "32" and name != "32" and flag != name:
        raise BambooConfigError(
            f"Lightning's precision ({lightning_flag!r}) and the DeepSpeed config ({name}) disagree; set one of them"
        )
    if name == "32":
        name = flag
    if clipping and gradient_clip_val and float(clipping) != float(gradient_clip_val):
        raise BambooConfigError(
            f"gradient_clip_val ({gradient_clip_val}) and the DeepSpeed config's gradient_clipping ({clipping}) "
            "disagree; set one of them"
        )
    norm = float(gradient_clip_val or clipping or 0.0)
    return Precision(name, scaling if name == "16" else None, norm), rest


# ---------------------------------------------------------------------------------------------------- the step
def layer_square_norms(module: nn.Module, layers: int, device: torch.device) -> torch.Tensor:
    """Each layer's squared gradient norm (fp64, summed over its parameters in order) at the layer's index of a
    vector of ``layers`` entries; zeros for layers ``module`` does not hold. Children are named by layer index.
    A tied module counts once: at its first layer (its later copies hold the same gradients, ``engine.ties``)."""
    sums: dict[int, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if param.grad is None or getattr(param, "bamboo_tied_copy", False):
            continue
        layer = int(name.partition(".")[0])
        value = param.grad.detach().double().square().sum()
        sums[layer] = value if layer not in sums else sums[layer] + value
    out = torch.zeros(layers, dtype=torch.float64, device=device)
    for layer, value in sums.items():
        out[layer] = value.to(device)
    return out


def total_norm(square_norms: torch.Tensor) -> float:
    """The global norm from per-layer squared norms, summed in layer order (the same on every process)."""
    total = 0.0
    for value in square_norms.cpu().tolist():
        total += value
    return math.sqrt(total) if math.isfinite(total) else float("inf")


def clip_coefficient(norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))


def scale_gradients(module: nn.Module, factor: float) -> None:
    if factor == 1.0:
        return
    for param in module.parameters():
        if param.grad is not None:
            param.grad.mul_(factor)


@dataclass
class StepResult:
    """What :class:`StepFinish` found: the global gradient norm (unscaled, before clipping) and whether to skip."""

    norm: float
    overflow: bool


class StepFinish:
    """Between the gradient reduction and the update: unscale (fp16), find the global norm, clip, decide a skip.

    ``contribute``: whether this process's layers count (the first pipeline's; every pipeline holds the same
    reduced gradients). ``all_reduce`` sums a tensor over every process of the job.
    """

    def __init__(self, precision: Precision) -> None:
        self.precision = precision

    def run(self, module: nn.Module, layers: int, contribute: bool, all_reduce: Any, device: torch.device) -> StepResult:
        square = layer_square_norms(module, layers, device) if contribute else torch.zeros(layers, dtype=torch.float64,
                                                                                            device=device)
        all_reduce(square)
        scale = self.precision.loss_scale
        norm = total_norm(square)
        overflow = not math.isfinite(norm)
        if overflow:
            return StepResult(float("inf"), True)
        norm /= scale
        factor = 1.0 / scale
        if self.precision.gradient_clipping > 0:
            factor *= clip_coefficient(norm, self.precision.gradient_clipping)
        scale_gradients(module, factor)
        return StepResult(norm, False)


def scaled_loss(loss: torch.Tensor, precision: Precision | None) -> torch.Tensor:
    """The loss a backward starts from: multiplied by fp16's loss scale."""
    if precision is None or precision.scaling is None:
        return loss
    return loss * precision.loss_scale
