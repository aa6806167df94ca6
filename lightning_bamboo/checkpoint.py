"""Per-layer checkpoints: one file per layer (weights + optimizer state), a manifest written last.

A checkpoint is a directory::

    path/
      layer-0000.pt ... layer-NNNN.pt   {"weights": {name: tensor}, "optimizer": {name: {"state": ..., "group": g}}}
      meta.pt                           Lightning's checkpoint dict without weights, plus {"bamboo": {...}}

Parameter names are relative to their layer (``"tok.weight"`` of layer 0), so a checkpoint
saved with one layout (stages x pipelines) loads into any other. ``meta.pt`` is written last
and the whole directory is renamed into place, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_bamboo.errors import BambooError

FORMAT_VERSION = 1
META = "meta.pt"


class CheckpointError(BambooError, ValueError):
    """A checkpoint is missing, incomplete or does not fit the model."""


def layer_file(path: str | os.PathLike[str], layer: int) -> Path:
    return Path(path) / f"layer-{layer:04d}.pt"


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def split_name(name: str) -> tuple[int, str]:
    """``"3.ff.0.weight"`` -> ``(3, "ff.0.weight")``: a stage's parameter name is prefixed by its layer."""
    layer, _, rest = name.partition(".")
    return int(layer), rest


def layer_states(
    stage: nn.Module, optimizer: torch.optim.Optimizer | None, layers: Iterable[int]
) -> dict[int, dict[str, Any]]:
    """Weights and optimizer state of ``layers`` of ``stage`` (a module whose children are named by layer).

    Every layer gets an entry, also one without parameters, so a reader can tell it was saved.
    """
    states: dict[int, dict[str, Any]] = {layer: {"weights": {}, "optimizer": {}} for layer in layers}
    for name, tensor in stage.state_dict().items():
        layer, rest = split_name(name)
        states[layer]["weights"][rest] = tensor.detach().cpu().clone()
    if optimizer is not None:
        names = {id(p): n for n, p in stage.named_parameters()}
        packed = optimizer.state_dict()
        index = 0
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                pname = names.get(id(param))
                if pname is not None:
                    layer, rest = split_name(pname)
                    state = packed["state"].get(index, {})
                    states[layer]["optimizer"][rest] = {
                        "state": {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in state.items()},
                        "group": group_index,
                    }
                index += 1
    return states


def param_group_hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    if optimizer is None:
        return []
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.state_dict()["param_groups"]]


def write_layers(path: str | os.PathLike[str], states: Mapping[int, dict[str, Any]]) -> None:
    for layer, state in states.items():
        atomic_save(state, layer_file(path, layer))


def write_meta(path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
    atomic_save(meta, Path(path) / META)


def partial_dir(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".partial")


def begin(path: str | os.PathLike[str]) -> Path:
    """Create the empty directory that the layer files of ``path`` are written into (one process)."""
    tmp = partial_dir(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(path: str | os.PathLike[str]) -> None:
    """Move the finished ``.partial`` directory to ``path``, replacing an older checkpoint (one process)."""
    path = Path(path)
    tmp = partial_dir(path)
    if not (tmp / META).exists():
        raise CheckpointError(f"cannot commit checkpoint {path}: {tmp / META} was not written")
    fsync_dir(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists() or path.is_symlink():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def save_sharded(
    path: str | os.PathLike[str],
    stage: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    layers: Iterable[int],
    meta: Callable[[], dict[str, Any]],
    *,
    is_global_zero: bool,
    writes_layers: bool,
    barrier: Callable[[str], None],
) -> None:
    """Collective save: every process calls it; one process per stage writes its layers.

    Rank 0 prepares the directory, writes ``meta()`` after all layers are on disk, and swaps
    the finished directory into place; a crash at any point leaves the previous checkpoint.
    """
    if is_global_zero:
        begin(path)
    barrier("bamboo_checkpoint_begin")
    if writes_layers:
        write_layers(partial_dir(path), layer_states(stage, optimizer, layers))
    barrier("bamboo_checkpoint_layers")
    if is_global_zero:
        write_meta(partial_dir(path), meta())
        commit(path)
    barrier("bamboo_checkpoint_commit")


def bamboo_meta(num_layers: int, parts: Sequence[int], pipelines: int, optimizer: torch.optim.Optimizer | None, **extra: Any) -> dict[str, Any]:
    """The ``"bamboo"`` entry of ``meta.pt``: what a reader needs to load the layers into any layout."""
    return {
        "format": FORMAT_VERSION,
        "num_layers": num_layers,
        "stages": len(parts) - 1,
        "pipelines": pipelines,
        "parts": list(parts),
        "param_groups": param_group_hyperparameters(optimizer),
        **extra,
    }


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file, not a lightning_bamboo checkpoint directory; checkpoints saved with "
            f"strategy='bamboo' are directories holding {META} and one file per layer"
        )
    meta_file = path / META
    if not meta_file.exists():
        hint = f" (an unfinished save left {partial_dir(path)})" if partial_dir(path).exists() else ""
        raise CheckpointError(f"{path} is not a complete lightning_bamboo checkpoint: {META} is missing{hint}")
    meta = torch.load(meta_file, map_location="cpu", weights_only=False)
    if meta.get("bamboo", {}).get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_file} has checkpoint format {meta.get('bamboo', {}).get('format')}, expected {FORMAT_VERSION}")
    return meta


def read_layers(path: str | os.PathLike[str], layers: Iterable[int]) -> dict[int, dict[str, Any]]:
    out = {}
    for layer in layers:
        file = layer_file(path, layer)
        if not file.exists():
            raise CheckpointError(f"checkpoint {path} has no file for layer {layer} ({file.name})")
        out[layer] = torch.load(file, map_location="cpu", weights_only=False)
    return out


def load_weights(stage: nn.Module, states: Mapping[int, dict[str, Any]], strict: bool = True) -> None:
    """Load per-layer weights into ``stage``, whose children are named by global layer index."""
    flat = {f"{layer}.{name}": t for layer, state in states.items() for name, t in state["weights"].items()}
    missing, unexpected = stage.load_state_dict(flat, strict=False)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint does not fit the model: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}; "
            f"was it saved from the same configure_pipeline()?"
        )


def load_optimizer(
    stage: nn.Module,
    optimizer: torch.optim.Optimizer,
    states: Mapping[int, dict[str, Any]],
    param_groups: list[dict[str, Any]],
) -> None:
    """Give ``optimizer`` (over ``stage``'s parameters, any layout) the saved per-layer state."""
    names = {id(p): n for n, p in stage.named_parameters()}
    packed = optimizer.state_dict()
    index = 0
    for group_index, group in enumerate(optimizer.param_groups):
        if group_index < len(param_groups):
            packed["param_groups"][group_index].update(param_groups[group_index])
        for param in group["params"]:
            name = names.get(id(param))
            if name is not None:
                layer, rest = split_name(name)
                saved = states.get(layer, {}).get("optimizer", {}).get(rest)
                if saved is None:
                    raise CheckpointError(f"checkpoint has no optimizer state for parameter {name!r}")
                if saved["state"]:
                    packed["state"][index] = saved["state"]
            index += 1
    optimizer.load_state_dict(packed)


def consolidate_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """One fp32 ``state_dict`` of the whole model from a checkpoint saved with any layout.

    Keys are those of ``nn.Sequential(*model.configure_pipeline()).state_dict()``.
    """
    meta = read_meta(path)
    num_layers = meta["bamboo"]["num_layers"]
    out: dict[str, torch.Tensor] = {}
    for layer, state in read_layers(path, range(num_layers)).items():
        for name, tensor in state["weights"].items():
            out[f"{layer}.{name}"] = tensor.float() if tensor.is_floating_point() else tensor
    return out
