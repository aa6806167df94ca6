"""Per-layer checkpoints: one file per layer (weights + optimizer state), a manifest written last.

A checkpoint is a directory::

    path/
      layer-0000.pt ... layer-NNNN.pt   {"weights": {name: tensor}, "optimizer": {name: {"state": ..., "group": g}}}
      rng-00000.pt ... rng-WWWWW.pt     RNG states (torch, numpy, python random) of each process
      meta.pt                           Lightning's checkpoint dict without weights, plus {"bamboo": {...}}

Saving has two phases: :func:`take_shard` copies a process's part to host memory (its layers,
its RNG states, on rank 0 the serialised manifest) and :func:`write_shard` puts it on disk, so
the second phase can run on a background thread (see ``callbacks.AsyncCheckpoint``).

Parameter names are relative to their layer (``"tok.weight"`` of layer 0), so a checkpoint
saved with one layout (stages x pipelines) loads into any other. ``meta.pt`` is written last
and the whole directory is renamed into place, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_bamboo.errors import BambooError

FORMAT_VERSION = 1
META = "meta.pt"


class CheckpointError(BambooError, ValueError):
    """A checkpoint is missing, incomplete or does not fit the model."""


class CheckpointAbandoned(CheckpointError):
    """A checkpoint in flight was given up on purpose (the processes that write it changed); not a failure."""


def layer_file(path: str | os.PathLike[str], layer: int) -> Path:
    return Path(path) / f"layer-{layer:04d}.pt"


def rng_file(path: str | os.PathLike[str], rank: int) -> Path:
    return Path(path) / f"rng-{rank:05d}.pt"


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` (or, for ``bytes``, a plain write) to a temporary file, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def serialize(obj: Any) -> bytes:
    """``torch.save`` into memory: a snapshot that later changes of ``obj`` cannot reach."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


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


def _host_copy(tensor: torch.Tensor, reuse: Any = None, copy: bool = True) -> torch.Tensor:
    """A host-memory copy of ``tensor``, written into ``reuse`` when that is a CPU tensor of the same shape and dtype.

    Reusing the buffers of the previous snapshot spares the page faults of fresh allocations,
    which cost more than the copy itself on large models. Without ``copy`` a tensor already in host memory is
    returned as it is (detached: the same storage).
    """
    tensor = tensor.detach()
    if not copy and tensor.device.type == "cpu":
        return tensor
    if torch.is_tensor(reuse) and reuse.device.type == "cpu" and reuse.shape == tensor.shape and reuse.dtype == tensor.dtype:
        return reuse.copy_(tensor)
    return tensor.to("cpu", copy=True)


def layer_states(
    stage: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    layers: Iterable[int],
    reuse: Mapping[int, dict[str, Any]] | None = None,
    copy: bool = True,
) -> dict[int, dict[str, Any]]:
    """Weights and optimizer state of ``layers`` of ``stage`` (a module whose children are named by layer).

    Every layer gets an entry, also one without parameters, so a reader can tell it was saved.
    ``reuse``: an earlier result nobody reads any more; its tensors are overwritten instead of allocating new ones.
    Without ``copy`` the tensors in host memory are the stage's and the optimizer's own (no second copy of a CPU
    stage): for a caller that reads them before anything changes them.
    """
    reuse = reuse or {}
    states: dict[int, dict[str, Any]] = {layer: {"weights": {}, "optimizer": {}} for layer in layers}
    for name, tensor in stage.state_dict().items():
        layer, rest = split_name(name)
        old = reuse.get(layer, {}).get("weights", {}).get(rest)
        states[layer]["weights"][rest] = _host_copy(tensor, old, copy)
    if optimizer is not None:
        names = {id(p): n for n, p in stage.named_parameters()}
        packed = optimizer.state_dict()
        index = 0
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                param_name = names.get(id(param))
                if param_name is not None:
                    layer, rest = split_name(param_name)
                    state = packed["state"].get(index, {})
                    old = reuse.get(layer, {}).get("optimizer", {}).get(rest, {}).get("state", {})
                    states[layer]["optimizer"][rest] = {
                        "state": {k: (_host_copy(v, old.get(k), copy) if torch.is_tensor(v) else v)
                                  for k, v in state.items()},
                        "group": group_index,
                    }
                index += 1
    return states


def param_group_hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    if optimizer is None:
        return []
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.state_dict()["param_groups"]]


def write_layers(
    path: str | os.PathLike[str], states: Mapping[int, dict[str, Any]], progress: Callable[[Path], None] | None = None
) -> None:
    for layer, state in states.items():
        atomic_save(state, layer_file(path, layer))
        if progress is not None:
            progress(layer_file(path, layer))


def write_meta(path: str | os.PathLike[str], meta: dict[str, Any] | bytes) -> None:
    atomic_save(meta, Path(path) / META)


# ---------------------------------------------------------------------- random number generators
def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch (CPU, and CUDA when initialised), numpy, python ``random``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's wheels
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Undo :func:`capture_rng`: the next random numbers equal those drawn after the capture."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_rng(path: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    file = rng_file(path, rank)
    # trusted: a checkpoint is code, as Lightning's are (random states hold numpy arrays): load only your own
    return torch.load(file, map_location="cpu", weights_only=False) if file.exists() else None  # trusted: own checkpoint


# ---------------------------------------------------------------------- two-phase saving
@dataclass
class Shard:
    """One process's part of a checkpoint, already copied to host memory (nothing in it aliases training state)."""

    rank: int
    layers: dict[int, dict[str, Any]] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    meta: bytes | None = None  # rank 0: the serialised manifest, written after every shard is on disk
    #: rank 0: called with a description just before the commit; raises to refuse it (a node that may
    #: have been declared lost must not swap a checkpoint in: ``membership.fence``)
    fence: Callable[[str], None] | None = None


def take_shard(
    rank: int,
    stage: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    layers: Iterable[int],
    *,
    writes_layers: bool,
    meta: Callable[[], dict[str, Any]] | None = None,
    reuse: Shard | None = None,
) -> Shard:
    """The snapshot phase (training thread): copy this process's layers, RNG states and (rank 0) manifest.

    ``reuse``: a shard already written, whose buffers the copy may overwrite.
    """
    return Shard(
        rank=rank,
        layers=layer_states(stage, optimizer, layers, reuse.layers if reuse is not None else None) if writes_layers else {},
        rng=capture_rng(),
        meta=serialize(meta()) if meta is not None else None,
    )


def write_shard(path: str | os.PathLike[str], shard: Shard, progress: Callable[[Path], None] | None = None) -> None:
    """The write phase: this process's layer files and RNG file into directory ``path`` (not the manifest)."""
    write_layers(path, shard.layers, progress)
    if shard.rng is not None:
        atomic_save(shard.rng, rng_file(path, shard.rank))


def marker_file(path: str | os.PathLike[str], rank: int) -> Path:
    return Path(path) / f".done-{rank:05d}"


def mark_done(path: str | os.PathLike[str], rank: int) -> None:
    """Record that process ``rank`` has written all its files into ``path`` (after they were fsynced)."""
    atomic_save(b"", marker_file(path, rank))


def wait_for_markers(
    path: str | os.PathLike[str],
    world_size: int,
    timeout: float,
    poll: float = 0.02,
    cancelled: threading.Event | None = None,
) -> None:
    """Block until every process's done marker is in ``path``; a bounded wait that names the missing ranks.

    Setting ``cancelled`` ends the wait at once with :class:`CheckpointAbandoned`.
    """
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in range(world_size) if not marker_file(path, r).exists()]
        if not missing:
            return
        if cancelled is not None and cancelled.is_set():
            raise CheckpointAbandoned(f"checkpoint {path} abandoned while processes {missing[:16]} had not finished")
        if time.monotonic() >= deadline:
            raise CheckpointError(
                f"checkpoint {path} is incomplete after waiting {timeout:g} s: processes {missing[:16]} of "
                f"{world_size} have not finished writing their layers; check their logs for write errors, or "
                f"raise the commit timeout if the file system is this slow"
            )
        time.sleep(poll)


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


def commit(path: str | os.PathLike[str], staging: str | os.PathLike[str] | None = None) -> None:
    """Move the finished ``staging`` directory (default: the ``.partial`` one) to ``path``, replacing an older checkpoint.

    One process calls it.
    """
    path = Path(path)
    tmp = Path(staging) if staging is not None else partial_dir(path)
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


# ---------------------------------------------------------------------- a directory of step checkpoints
def step_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir(path: str | os.PathLike[str], token: str) -> Path:
    """Where the shards of ``path`` are gathered; ``token`` (one per run) keeps a dead run's files out."""
    path = Path(path)
    return path.with_name(f"{path.name}.partial-{token}")


def persist(
    path: str | os.PathLike[str],
    shard: Shard,
    *,
    world_size: int,
    token: str,
    timeout: float,
    keep_last: int | None = None,
    progress: Callable[[Path], None] | None = None,
    cancelled: threading.Event | None = None,
) -> None:
    """The write phase of one process, with no collective: every process may run it on a background thread.

    Each process writes its files into the staging directory and then a done marker; rank 0
    (the one whose shard holds the manifest) waits, bounded by ``timeout``, for every marker,
    writes ``meta.pt`` last, renames the directory to ``path`` and keeps the newest
    ``keep_last`` checkpoints of the directory. A crash at any point leaves the older ones intact.
    ``cancelled`` gives up (on rank 0) before the commit, e.g. when a failover changed the processes.
    """
    path = Path(path)
    staging = staging_dir(path, token)
    staging.mkdir(parents=True, exist_ok=True)
    write_shard(staging, shard, progress)
    mark_done(staging, shard.rank)
    if shard.meta is None:
        return
    wait_for_markers(staging, world_size, timeout, cancelled=cancelled)
    for rank in range(world_size):
        marker_file(staging, rank).unlink()
    write_meta(staging, shard.meta)
    if shard.fence is not None:
        shard.fence(f"commit checkpoint {path}")
    commit(path, staging)
    if keep_last is not None:
        prune(path.parent, keep_last, token)


def complete_checkpoints(dirpath: str | os.PathLike[str]) -> list[Path]:
    """The complete ``step-*`` checkpoints in ``dirpath``, oldest commit first."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    found = [p for p in dirpath.glob("step-*") if p.is_dir() and "." not in p.name and (p / META).exists()]
    return sorted(found, key=lambda p: ((p / META).stat().st_mtime_ns, p.name))


def latest_checkpoint(dirpath: str | os.PathLike[str]) -> Path | None:
    """The most recently committed complete checkpoint in ``dirpath`` (``None`` if there is none)."""
    found = complete_checkpoints(dirpath)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it is a checkpoint; the latest complete checkpoint in it if it is a directory of them."""
    path = Path(path)
    if not (path / META).exists():
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
    return path


def prune(dirpath: str | os.PathLike[str], keep_last: int, token: str | None = None) -> None:
    """Delete all but the newest ``keep_last`` checkpoints, and staging directories of runs other than ``token``'s."""
    complete = complete_checkpoints(dirpath)
    for old in complete[: max(0, len(complete) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
    newest = complete[-1].name if complete else None
    for stale in Path(dirpath).glob("step-*.partial-*"):
        step, _, owner = stale.name.partition(".partial-")
        # a dead run's (another token), or one of this run's that was abandoned before the newest commit
        if token is not None and (owner != token or (newest is not None and step < newest)):
            shutil.rmtree(stale, ignore_errors=True)


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
    rank: int | None = None,
    fence: Callable[[str], None] | None = None,
) -> None:
    """Collective save: every process calls it; one process per stage writes its layers.

    Rank 0 prepares the directory, writes ``meta()`` after all layers are on disk, and swaps
    the finished directory into place; a crash at any point leaves the previous checkpoint.
    With ``rank`` given, every process also writes its RNG states. ``fence`` is asked (on rank 0)
    just before the commit and raises to refuse it.
    """
    if is_global_zero:
        begin(path)
    barrier("bamboo_checkpoint_begin")
    if writes_layers:
        write_layers(partial_dir(path), layer_states(stage, optimizer, layers))
    if rank is not None:
        atomic_save(capture_rng(), rng_file(partial_dir(path), rank))
    barrier("bamboo_checkpoint_layers")
    if is_global_zero:
        write_meta(partial_dir(path), meta())
        if fence is not None:
            fence(f"commit checkpoint {path}")
        commit(path)
    barrier("bamboo_checkpoint_commit")


def bamboo_meta(num_layers: int, parts: Sequence[int], pipelines: int, optimizer: torch.optim.Optimizer | None,
                ties: Mapping[str, Sequence[int]] | None = None, **extra: Any) -> dict[str, Any]:
    """The ``"bamboo"`` entry of ``meta.pt``: what a reader needs to load the layers into any layout.

    ``ties``: the model's tied layers (``TiedLayerSpec`` key -> layer indices), each of which has a file of its
    own copy; ``consolidate_checkpoint`` keeps the first.
    """
    return {
        "format": FORMAT_VERSION,
        "num_layers": num_layers,
        "stages": len(parts) - 1,
        "pipelines": pipelines,
        "parts": list(parts),
        "param_groups": param_group_hyperparameters(optimizer),
        **({"ties": {str(key): [int(i) for i in layers] for key, layers in ties.items()}} if ties else {}),
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
    meta = torch.load(meta_file, map_location="cpu", weights_only=False)  # trusted: own checkpoint (Lightning's dict)
    if meta.get("bamboo", {}).get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_file} has checkpoint format {meta.get('bamboo', {}).get('format')}, expected {FORMAT_VERSION}")
    return meta


def read_layers(path: str | os.PathLike[str], layers: Iterable[int]) -> dict[int, dict[str, Any]]:
    out = {}
    for layer in layers:
        file = layer_file(path, layer)
        if not file.exists():
            raise CheckpointError(f"checkpoint {path} has no file for layer {layer} ({file.name})")
        out[layer] = torch.load(file, map_location="cpu", weights_only=False)  # trusted: own checkpoint
    return out


def load_weights(stage: nn.Module, states: Mapping[int, dict[str, Any]], strict: bool = True) -> None:
    """Load per-layer weights into ``stage``, whose children are named by global layer index."""
    flat = {f"{layer}.{name}": t for layer, state in states.items() for name, t in state["weights"].items()}
    missing, unexpected = stage.load_state_dict(flat, strict=False)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint does not fit the model: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]} "
            f"(layers in the checkpoint: {sorted(states)}; in the model: {[n for n, _ in stage.named_children()]}); "
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

    Keys are those of ``nn.Sequential(*model.configure_pipeline()).state_dict()``. A tied module (``TiedLayerSpec``s
    of one key) is there once, at its first layer (its copies at the later layers are equal to it).
    """
    meta = read_meta(path)
    num_layers = meta["bamboo"]["num_layers"]
    copies = {i for layers in meta["bamboo"].get("ties", {}).values() for i in layers[1:]}
    out: dict[str, torch.Tensor] = {}
    for layer, state in read_layers(path, [i for i in range(num_layers) if i not in copies]).items():
        for name, tensor in state["weights"].items():
            out[f"{layer}.{name}"] = tensor.float() if tensor.is_floating_point() else tensor
    return out
