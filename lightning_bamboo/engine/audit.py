"""Replica audit: every replica compared with its owner's live state, bit for bit, through digests.

Each node digests its own stage and its replica (weights and every optimizer state tensor, one
hash per tensor over its dtype, shape and bytes); the digests are gathered on every node, and every
node finds the same mismatches, so all stop together with the same error. Only the digests travel.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_bamboo.errors import BambooError

#: one layer's digest: ``"weights/NAME"`` or ``"optimizer/PARAM/KEY"`` (and ``"optimizer/PARAM/group"``) -> hash
LayerDigest = dict[str, str]


class ReplicaAuditError(BambooError):
    """A replica differs from the stage it covers: a failover would train on wrong weights."""


def _hash(value: Any) -> str:
    if torch.is_tensor(value):
        tensor = value.detach().cpu().contiguous()
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
    return repr(value)


def digest(states: Mapping[int, dict[str, Any]]) -> dict[int, LayerDigest]:
    """Per layer of ``states`` (``checkpoint.layer_states``' form): a hash of every weight and optimizer state entry."""
    out: dict[int, LayerDigest] = {}
    for layer, state in states.items():
        entries = {f"weights/{name}": _hash(tensor) for name, tensor in state["weights"].items()}
        for param, saved in state["optimizer"].items():
            entries[f"optimizer/{param}/group"] = repr(saved.get("group"))
            entries.update({f"optimizer/{param}/{key}": _hash(value) for key, value in saved["state"].items()})
        out[int(layer)] = entries
    return out


@dataclass(frozen=True)
class NodeDigest:
    """What one node reports: where it runs, its own stage's digest, and its replica's (if it holds one)."""

    node: str
    stage: int
    pipeline: int
    own: dict[int, LayerDigest]
    replica_stage: int | None
    replica: dict[int, LayerDigest]


def mismatches(reports: Sequence[NodeDigest], step: int, when: str,
               kept: Sequence[bool] | None = None) -> list[str]:
    """Every difference between a replica and the live stage it covers, one line each, naming layer, step and node;
    with ``kept`` (per stage: whether its replica is kept, ``topology.replicas.kept_replicas``), also every kept
    replica that no node holds and every replica held of a stage that keeps none."""
    problems: list[str] = []
    owners = {(r.pipeline, r.stage): r for r in reports}
    if kept is not None:
        held = {(r.pipeline, r.replica_stage) for r in reports if r.replica_stage is not None}
        for report in reports:
            if kept[report.stage] and (report.pipeline, report.stage) not in held:
                problems.append(f"{when} step {step}: no node holds the replica of stage {report.stage} of pipeline "
                                f"{report.pipeline} (run by {report.node}), which the layout keeps")
    for holder in reports:
        if holder.replica_stage is None:
            continue
        if kept is not None and not kept[holder.replica_stage]:
            problems.append(f"{when} step {step}: {holder.node} holds a replica of stage {holder.replica_stage} of "
                            f"pipeline {holder.pipeline}, which the layout keeps none of")
            continue
        owner = owners.get((holder.pipeline, holder.replica_stage))
        if owner is None:
            problems.append(f"{when} step {step}: {holder.node} holds a replica of stage {holder.replica_stage} of "
                            f"pipeline {holder.pipeline}, which no node runs")
            continue
        where = f"{when} step {step}: {holder.node}'s replica of stage {holder.replica_stage} (run by {owner.node})"
        if sorted(holder.replica) != sorted(owner.own):
            problems.append(f"{where} holds layers {sorted(holder.replica)}, the stage has {sorted(owner.own)}")
            continue
        for layer in sorted(owner.own):
            mine, theirs = holder.replica[layer], owner.own[layer]
            for key in sorted(set(mine) | set(theirs)):
                if mine.get(key) != theirs.get(key):
                    state = "missing" if key not in mine else "extra" if key not in theirs else "differs"
                    problems.append(f"{where}: layer {layer} {key} {state}")
    return problems


def check(reports: Sequence[NodeDigest], step: int, when: str, kept: Sequence[bool] | None = None) -> None:
    """Raise ``ReplicaAuditError`` naming every mismatch (the first 20) if any replica differs from its stage, or
    (with ``kept``) a kept replica is missing or one not kept is held."""
    problems = mismatches(reports, step, when, kept)
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ReplicaAuditError(
            "replica audit failed: a replica differs from the stage it covers, so a failover would train on "
            "wrong weights:\n  " + "\n  ".join(shown)
        )
