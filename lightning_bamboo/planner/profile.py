"""Measure each layer on deep copies: forward/backward time, activation and state bytes, update time."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.planner.costmodel import LayerCost, LayerProfile, ModelProfile
from lightning_bamboo.planner.memory import LayerMemory

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _timed_forward(layer: nn.Module, inp: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    _sync(device)
    start = time.perf_counter()
    out = layer(inp)
    _sync(device)
    return time.perf_counter() - start, out


def _timed_backward(out: torch.Tensor, device: torch.device) -> float:
    grad = torch.ones_like(out) / out.numel()
    _sync(device)
    start = time.perf_counter()
    torch.autograd.backward(out, grad)
    _sync(device)
    return time.perf_counter() - start


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def _batch(sample: torch.Tensor | Callable[[int], torch.Tensor], size: int, device: torch.device) -> torch.Tensor:
    """``size`` rows: from the callable, or the sample's rows repeated in order."""
    if callable(sample):
        return sample(size).to(device)
    rows = torch.arange(size) % sample.shape[0]
    return sample[rows].to(device)


def _saved_bytes(layer: nn.Module, inp: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run a forward and count the bytes autograd keeps for backward (not parameters, each storage once)."""
    return _saved_bytes_of(layer, inp, list(layer.parameters()))


def profile_layers(
    layers: Sequence[nn.Module],
    sample: torch.Tensor | Callable[[int], torch.Tensor],
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    *,
    device: str | torch.device | None = None,
    repeats: int = 3,
    warmup: int = 1,
    optimizer: OptimizerFactory | None = None,
    threads: int | None = None,
) -> ModelProfile:
    """Per-layer costs of training ``layers`` in order, at every micro-batch size.

    ``sample`` is an input batch for the first layer (its rows are repeated to make each
    micro-batch) or a function ``size -> batch``. Times are medians of ``repeats`` runs after
    ``warmup`` runs; optimizer state and update time come from one ``optimizer`` (default Adam)
    per layer. ``threads`` sets torch's CPU threads while measuring (use what each worker will
    run with: CPU workers sharing a host contend for cores, and oversubscribed threads make
    timings swing by 100x); None keeps the current setting. The layers themselves, their mode,
    their gradients, the global RNG and the thread count are left as they were: everything runs
    on deep copies, inside ``torch.random.fork_rng``.
    """
    sizes = sorted(set(int(s) for s in micro_batch_sizes))
    if not layers or not sizes or sizes[0] < 1 or repeats < 1 or warmup < 0:
        raise BambooConfigError(
            f"profiling needs layers, micro-batch sizes >= 1, repeats >= 1 and warmup >= 0 (got {len(layers)} "
            f"layers, sizes {list(micro_batch_sizes)}, repeats {repeats}, warmup {warmup})"
        )
    dev = torch.device(device) if device is not None else torch.device("cpu")
    make_optimizer = optimizer or (lambda params: torch.optim.Adam(params))
    if threads is not None and threads < 1:
        raise BambooConfigError(f"threads must be >= 1 or None (threads: {threads}); use 1 per CPU worker")
    rng_devices = [dev.index or 0] if dev.type == "cuda" else []
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        static, per_size = _measure(layers, sample, sizes, dev, rng_devices, make_optimizer, repeats, warmup)
    finally:
        torch.set_num_threads(threads_before)
    profiles = []
    for i, layer in enumerate(layers):
        param_bytes, grad_bytes, opt_bytes, update, largest = static[i]
        profiles.append(
            LayerProfile(
                name=f"{i}:{type(layer).__name__}",
                param_bytes=param_bytes,
                grad_bytes=grad_bytes,
                optimizer_bytes=opt_bytes,
                update_seconds=update,
                costs=tuple((size, per_size[size][i]) for size in sizes),
                largest_param_bytes=largest,
            )
        )
    return ModelProfile(tuple(profiles), device=str(dev))


def _measure(
    layers: Sequence[nn.Module],
    sample: torch.Tensor | Callable[[int], torch.Tensor],
    sizes: list[int],
    dev: torch.device,
    rng_devices: list[int],
    make_optimizer: OptimizerFactory,
    repeats: int,
    warmup: int,
) -> tuple[list[tuple[int, int, int, float, int]], dict[int, list[LayerCost]]]:
    """Everything that runs the layers: on deep copies, with the caller's RNG streams restored after."""
    with torch.random.fork_rng(devices=rng_devices), torch.enable_grad():
        copies = []
        for layer in layers:
            twin = copy.deepcopy(layer).to(dev)
            twin.train()
            for p in twin.parameters():
                p.grad = None
            copies.append(twin)
        static = [_static(twin, make_optimizer, dev, repeats, warmup) for twin in copies]
        per_size = {size: _costs(copies, _batch(sample, size, dev), dev, repeats, warmup) for size in sizes}
        del copies
    return static, per_size


def _static(
    twin: nn.Module, make_optimizer: OptimizerFactory, dev: torch.device, repeats: int, warmup: int
) -> tuple[int, int, int, float, int]:
    """Parameter, gradient and optimizer-state bytes, the optimizer step's median time and the largest trainable
    parameter's bytes."""
    params = list(twin.parameters())
    param_bytes = sum(_nbytes(p) for p in params)
    trainable = [p for p in params if p.requires_grad]
    grad_bytes = sum(_nbytes(p) for p in trainable)
    if not trainable:
        return param_bytes, 0, 0, 0.0, 0
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt = make_optimizer(trainable)
    times = [_timed(opt.step, dev) for _ in range(warmup + repeats)][warmup:]
    opt_bytes = sum(_nbytes(v) for state in opt.state.values() for v in state.values())
    for p in trainable:
        p.grad = None
    del opt
    return param_bytes, grad_bytes, opt_bytes, statistics.median(times), max(_nbytes(p) for p in trainable)


def _costs(
    copies: list[nn.Module], x: torch.Tensor, dev: torch.device, repeats: int, warmup: int
) -> list[LayerCost]:
    """Forward/backward medians and activation sizes of every layer for one micro-batch."""
    out_costs = []
    for twin in copies:
        inp = x.detach()
        if inp.is_floating_point():
            inp.requires_grad_(True)  # a pipeline stage also computes the gradient of its input
        forward_times, backward_times = [], []
        activation = 0
        out: torch.Tensor = inp
        for run in range(warmup + repeats):
            seconds, out = _timed_forward(twin, inp, dev)
            forward_times.append(seconds)
            if not isinstance(out, torch.Tensor):
                raise BambooConfigError(
                    f"a pipeline layer must return one tensor (layer {type(twin).__name__} returned "
                    f"{type(out).__name__}); wrap it so it returns a single tensor"
                )
            if run == 0:
                out, activation = _saved_bytes(twin, inp)
            if out.requires_grad:
                backward_times.append(_timed_backward(out, dev))
            for p in twin.parameters():
                p.grad = None
            inp.grad = None
        out_costs.append(
            LayerCost(
                forward_seconds=statistics.median(forward_times[warmup:]),
                backward_seconds=statistics.median(backward_times[warmup:]) if backward_times[warmup:] else 0.0,
                output_bytes=_nbytes(out),
                activation_bytes=activation,
            )
        )
        x = out.detach()
    return out_costs


def memory_of_layers(layers: Sequence[nn.Module | Callable[[torch.Tensor], torch.Tensor]], sample: torch.Tensor,
                     ties: dict[str, Sequence[int]] | None = None) -> list[LayerMemory]:
    """What ``planner.memory`` needs of each layer for the micro-batch ``sample`` (the first layer's input): its
    trainable parameters, its largest one, the bytes its forward saves for backward and its output's. One forward
    per layer, on the layers themselves, nothing timed and nothing kept; the global random stream is left as it was.
    A plain callable (a tied head: ``functools.partial(tied_logits, embedding)``) is counted with the parameters of
    the module it calls. ``ties``: a ``TiedLayerSpec`` key per group of layer indices."""
    tie_of = {i: key for key, indices in (ties or {}).items() for i in indices}
    out: list[LayerMemory] = []
    x = sample
    with torch.random.fork_rng(), torch.enable_grad():
        for index, layer in enumerate(layers):
            owner = layer if isinstance(layer, nn.Module) else getattr(layer, "args", (None,))[0]
            params = [p for p in owner.parameters() if p.requires_grad] if isinstance(owner, nn.Module) else []
            inp = x.detach().requires_grad_(x.is_floating_point())
            y, saved = _saved_bytes_of(layer, inp, params)
            out.append(LayerMemory(sum(p.numel() for p in params), max((p.numel() for p in params), default=0), saved,
                                   _nbytes(y), tie_of.get(index, "")))
            x = y.detach()
    return out


def _saved_bytes_of(layer: Callable[[torch.Tensor], torch.Tensor], inp: torch.Tensor,
                    params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``_saved_bytes`` for a layer or a plain callable over ``params``."""
    held = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(inp)
    return out, sum(seen.values())
