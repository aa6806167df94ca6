"""The successor's stage that a node keeps, and how its update is applied.

The gradients it is updated with come from ``lightning_bamboo.engine.exchange``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.engine import heap
from lightning_bamboo.engine.layer_rng import StepKeys, run_layers
from lightning_bamboo.engine.replica_location import copy_to_device, must_fit

log = logging.getLogger(__name__)


class StageContainer(nn.Module):
    """The layers of one stage: module children named by global layer index (like a pipeline stage),
    and ``forward`` running every layer in order, plain callables included (like ``PipelineModule``)."""

    def __init__(self, layers: Mapping[int, Any]) -> None:
        super().__init__()
        self._calls: list[Any] = []
        self.indices = sorted(layers)  # every layer's global index, plain callables included
        for index in sorted(layers):
            layer = layers[index]
            if isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
            self._calls.append(layer)

    def forward(self, inputs: Any) -> Any:
        return self.run(inputs)

    def calls(self) -> list[tuple[int, Any]]:
        """Every layer with its global index, in order (plain callables included)."""
        return list(zip(self.indices, self._calls, strict=True))

    def run(self, inputs: Any, keys: StepKeys | None = None, micro_batch: int = 0) -> Any:
        """``forward``; with ``keys``, each layer draws its random numbers as on the stage that owns it
        (``layer_rng``), for local micro-batch ``micro_batch``."""
        return run_layers(zip(self.indices, self._calls, strict=True), inputs, keys, micro_batch)


def _on_device(value: Any, device: torch.device) -> Any:
    """An optimizer state entry on ``device``: tensors of a parameter's shape; a step count (a 0-d tensor)
    stays where it is, as the owner's does."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    return value.to(device, non_blocking=True)


def _at_home(value: Any, home: Any) -> Any:
    """An optimizer state entry back in pinned host memory: into ``home``, its host tensor, if it had one."""
    if not torch.is_tensor(value) or value.dim() == 0 or value.device.type == "cpu":
        return value
    if home is None or not torch.is_tensor(home) or home.shape != value.shape or home.device.type != "cpu":
        home = torch.empty_like(value, device="cpu", pin_memory=True)
    return home.copy_(value)


def _device_of(module: nn.Module) -> torch.device:
    param = next(iter(module.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def copy_hyperparameters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Give ``target`` the current hyperparameters (lr, ...) of ``source``'s groups, as schedulers set them."""
    for src, dst in zip(source.param_groups, target.param_groups, strict=False):
        for key, value in src.items():
            if key != "params" and key in dst:
                dst[key] = value


class Replica:
    """Layers of stage ``stage`` (the successor's) with their own optimizer, held on this node.

    ``device``: where its redundant forwards run (the own stage's device). The layers live there, or,
    on a GPU short of memory (``placement.replica_device``), in pinned host memory: the replica is
    then *hosted*: its update runs on ``device`` a layer at a time (``_step_on_device``) and its forwards
    on a copy of its weights there (``compute_module``).
    """

    def __init__(self, stage: int, module: StageContainer, optimizer: torch.optim.Optimizer,
                 device: torch.device | None = None) -> None:
        self.stage = stage
        self.module = module
        self.optimizer = optimizer
        self.pending = False  # gradients received for the step in flight, not committed yet
        self.due = False  # a committed update taken on, not applied yet (see ``settle``)
        self.device = device if device is not None else _device_of(module)
        #: whether the layers live in host memory while the forwards run on a GPU
        self.hosted = self.device.type == "cuda" and _device_of(module).type == "cpu"
        self._shadow: StageContainer | None = None  # hosted: the layers' copy on ``device``
        self._shadow_fresh = False  # whether that copy holds the layers' current weights

    def compute_module(self) -> StageContainer:
        """The layers on ``device``, for a redundant forward: the replica's own, or (hosted) their copy there,
        refreshed on a side stream after each update or load."""
        self.settle()
        if not self.hosted:
            return self.module
        if self._shadow is None:
            self._shadow = copy.deepcopy(self.module).to(self.device)
        elif not self._shadow_fresh:
            copy_to_device(list(self.module.state_dict().values()), list(self._shadow.state_dict().values()),
                           self.device)
        self._shadow_fresh = True
        return self._shadow

    @property
    def forward_layers(self) -> StageContainer:
        """The layers the redundant forwards of the step in flight ran on (a failover takes them over with
        the forwards' graphs); as they are, nothing settled or refreshed."""
        return self._shadow if self.hosted and self._shadow is not None else self.module

    def changed(self) -> None:
        """The layers' weights were loaded from elsewhere (a checkpoint): a hosted copy is refreshed before use."""
        self._shadow_fresh = False

    @property
    def layers(self) -> range:
        return range(self.module.indices[0], self.module.indices[-1] + 1)

    def states(self, copy: bool = True) -> dict[int, dict[str, Any]]:
        """Weights and optimizer state of the replica's layers, by layer (CPU copies; without ``copy``, the
        tensors of a replica in host memory themselves)."""
        self.settle()
        return ckpt.layer_states(self.module, self.optimizer, self.layers, copy=copy)

    def step(self, own_optimizer: torch.optim.Optimizer | None, defer: bool = False) -> None:
        """Apply the update the owner applies (after the step committed).

        With ``defer`` the update is only taken on (with this step's hyperparameters) and applied by
        ``settle``: the engine calls it where the next step waits for a peer, so the update costs
        idle time instead of the step boundary, and everything that reads or changes the replica
        (states, redundant forwards, the next gradients, a failover) settles it first.
        """
        if own_optimizer is not None:
            copy_hyperparameters(own_optimizer, self.optimizer)  # this step's learning rate, taken now
        self.pending = False
        self.due = True
        if not defer:
            self.settle()

    def settle(self) -> float:
        """Apply the committed update that is due, if any; the seconds it took."""
        if not self.due:
            return 0.0
        started = time.perf_counter()
        with must_fit(f"the update of the replica of stage {self.stage} (layers {self.layers.start}-"
                      f"{self.layers.stop - 1}{', hosted' if self.hosted else ''})", self.device, not self.hosted):
            if self.hosted:
                self._step_on_device()
            else:
                heap.give_back()  # the freed heap and the update's temporaries would add up
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.due = False
        self._shadow_fresh = False
        return time.perf_counter() - started

    def _step_on_device(self) -> None:
        """A hosted replica's update, run on ``device`` a layer at a time: the owner's update runs there, and the
        same update on the CPU would differ in the last bits (the replica would drift from its stage). Each
        layer's weights, gradients and optimizer state go to the GPU, are updated, and come back."""
        grads = {p: p.grad for p in self.module.parameters() if p.grad is not None}
        for p in grads:
            p.grad = None
        state = self.optimizer.state
        for layer in self.module.children():
            params = [p for p in layer.parameters() if p in grads]
            if not params:
                continue
            homes = {p: (p.data, dict(state[p]) if p in state else {}) for p in params}
            for p in params:  # each is updated only while it has a gradient: this layer's
                p.data, p.grad = p.data.to(self.device, non_blocking=True), grads[p].to(self.device, non_blocking=True)
                if p in state:
                    state[p] = {k: _on_device(v, self.device) for k, v in state[p].items()}
            self.optimizer.step()
            for p in params:
                weights, entries = homes[p]
                weights.copy_(p.data)
                p.data, p.grad = weights, None
                state[p] = {k: _at_home(v, entries.get(k)) for k, v in state[p].items()}

    def place(self, on_gpu: bool) -> None:
        """Move the layers and their optimizer state to ``device`` (``on_gpu``) or to pinned host memory; a step's
        memory use decided it (``placement.replica_stays_on_gpu``). The committed update due is applied first, where
        the layers are. Exact: a hosted replica's update runs on ``device`` already, a layer at a time."""
        if self.device.type != "cuda" or on_gpu == (not self.hosted):
            return  # (on CPU, or there already)
        self.settle()
        state = self.optimizer.state
        for p in self.module.parameters():
            if on_gpu:
                p.data = p.data.to(self.device)
                if p in state:
                    state[p] = {k: _on_device(v, self.device) for k, v in state[p].items()}
            else:
                p.data = p.data.to("cpu").pin_memory()
                if p in state:
                    state[p] = {k: _at_home(v, None) for k, v in state[p].items()}
        for b in self.module.buffers():
            b.data = b.data.to(self.device) if on_gpu else b.data.to("cpu").pin_memory()
        torch.cuda.current_stream(self.device).synchronize()  # the copies from pinned memory are done
        self.hosted, self._shadow, self._shadow_fresh = not on_gpu, None, False

    def discard(self) -> None:
        """Forget the gradients of a step that did not commit (a committed update still due is applied first)."""
        self.settle()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = False


def equal_states(a: Mapping[int, dict[str, Any]], b: Mapping[int, dict[str, Any]]) -> list[str]:
    """Differences between two per-layer states (weights and optimizer state), bit for bit."""
    problems: list[str] = []
    if sorted(a) != sorted(b):
        return [f"layers differ: {sorted(a)} vs {sorted(b)}"]
    for layer in a:
        for part in ("weights", "optimizer"):
            left, right = a[layer][part], b[layer][part]
            if sorted(left) != sorted(right):
                problems.append(f"layer {layer} {part}: keys differ")
                continue
            for name in left:
                if not _equal(left[name], right[name]):
                    problems.append(f"layer {layer} {part} {name} differs")
    return problems


def _equal(x: Any, y: Any) -> bool:
    if torch.is_tensor(x) and torch.is_tensor(y):
        return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return sorted(x) == sorted(y) and all(_equal(x[k], y[k]) for k in x)
    return bool(x == y)


def free(modules: Iterable[nn.Module]) -> None:
    for module in modules:
        for param in module.parameters():
            param.grad = None
