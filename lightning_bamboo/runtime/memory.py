"""A node's memory, predicted and measured: ``planner.memory``'s model fed with what the stage measured at its first
step, against the process's peak RSS; one log line after the first step of every stage the node builds."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from lightning_bamboo.engine.comm_process import communication_pids
from lightning_bamboo.planner.memory import GiB, LayerMemory, MemorySettings, NodeMemory, node_memory

log = logging.getLogger(__name__)

#: a measured peak this much above the prediction, and by at least ``MATERIAL`` bytes, is logged as a warning (a
#: small model's peak is mostly the interpreter's, which a forked worker shares and measures unevenly)
TOLERANCE = 1.10
MATERIAL = 256 * 2**20


def proc_status(field: str, pid: int | str = "self") -> int:
    """A ``/proc/PID/status`` field in bytes: ``VmRSS`` (resident now), ``VmHWM`` (the peak), ``RssShmem`` (its shared
    memory); 0 when the process is gone or has no such field."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """This process's resident memory now (RSS)."""
    return proc_status("VmRSS")


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far (``VmHWM``)."""
    return proc_status("VmHWM")


def communication_bytes() -> int:
    """What this worker's communication processes hold that it does not: their anonymous memory, each page counted
    once between them (``Pss_Anon``; the transfer buffers they share with the worker are in its RSS)."""
    total = 0
    for pid in communication_pids():
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss_Anon:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _largest(module: torch.nn.Module) -> dict[int, int]:
    """Per layer (children named by global index), the elements of its largest trainable parameter."""
    return {int(name): max((p.numel() for p in child.parameters() if p.requires_grad), default=0)
            for name, child in module.named_children() if name.isdigit()}


def _settings(engine: Any, baseline: int, own_params: int) -> MemorySettings:
    """The optimizer's state per parameter (as it holds it after a step) and its update's temporaries: torch's
    single-tensor Adam(W) two tensors of the largest parameter, a fused one none; the exchange's transport."""
    optimizer = engine.optimizer
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    defaults = getattr(optimizer, "defaults", {})
    temporaries = 0 if defaults.get("fused") else 2 if "adam" in type(optimizer).__name__.lower() else 1
    exchange = engine.exchange if engine.replica is not None or engine.replica_peers[0] is not None else None
    shared = exchange is None or exchange.through_shared_memory or (
        exchange.holder is not None and exchange.holder.owner_writes_shared)
    return MemorySettings(optimizer_bytes_per_param=round(state / own_params) if own_params else 0,
                          optimizer_temporaries=temporaries, exchange="shared" if shared else "network",
                          baseline_bytes=baseline)


def predict(engine: Any, layout: Any, rank: int, param_counts: list[int], baseline: int,
            checkpoint_every: int) -> NodeMemory:
    """The model's memory of this node: its layout, its layers' parameters, what one micro-batch of its layers held
    at the engine's first step (``engine.layer_memory``), its optimizer and exchange as they ran."""
    largest = _largest(engine.module)
    if engine.replica is not None:
        largest.update(_largest(engine.replica.module))
    tie_of = {i: key for key, indices in (getattr(engine.module, "ties", None) or {}).items() for i in indices}
    sizes = engine.layer_memory
    layers = [LayerMemory(params=count, largest=min(largest.get(i, 0), count), activation_bytes=sizes.get(i, (0, 0))[0],
                          output_bytes=sizes.get(i, (0, 0))[1], tie=tie_of.get(i, ""))
              for i, count in enumerate(param_counts)]
    stage = layout.stage_of_rank(rank)
    own = sum(param_counts[i] for i in layout.layers_of_stage(stage))
    return node_memory(layers, layout.parts, stage, int(engine.micro_batches), redundancy=engine.redundancy,
                       pipelines=layout.pipelines, checkpoint_every=checkpoint_every,
                       eager_forwards=engine.redundant_forwards_run, settings=_settings(engine, baseline, own))


def report(node: str, why: str, predicted: NodeMemory) -> tuple[int, str]:
    """The log level and line of a node's predicted and measured memory."""
    peak, comm = peak_resident_bytes(), communication_bytes()
    owners = ", ".join(f"{owner} {value / GiB:.2f}" for owner, value in predicted.by_owner().items())
    line = (f"{node}: memory after {why}: predicted peak {predicted.total_bytes / GiB:.2f} GiB ({owners}; the worker "
            f"{predicted.peak_bytes / GiB:.2f} GiB at its {predicted.peak.name}), measured {peak / GiB:.2f} GiB (the "
            f"worker's peak RSS so far) + {comm / GiB:.2f} GiB (its communication processes)")
    if peak > TOLERANCE * predicted.peak_bytes and peak - predicted.peak_bytes >= MATERIAL:
        return logging.WARNING, (f"{line}: {peak / predicted.peak_bytes:.2f}x the prediction, more than the model "
                                 "accounts for (docs/memory.md says what it counts); size the machine by the measured "
                                 "peak")
    return logging.INFO, line
