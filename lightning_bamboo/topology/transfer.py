"""Transfer plans: which layers move from which node to which when a running pipeline changes (pure, no torch).

A reconfiguration changes a pipeline between two steps without a loss: standby nodes join, the
layer split is evened out after a failover left one node with two stages, the pipeline gets
deeper again. Every layer a node must run and does not already run is sent to it by the node
that runs it now; ``transfer_plan`` says which, the engine's ``move_layers`` sends them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bamboo.errors import BambooError


@dataclass(frozen=True)
class Move:
    """Layers ``start..stop-1`` go from node ``src`` (which runs them now) to node ``dst``."""

    src: str
    dst: str
    start: int
    stop: int

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


def _owners(order: Sequence[str], parts: Sequence[int], pipelines: int = 1) -> dict[int, list[str]]:
    """Layer -> the nodes running it, by pipeline (``order`` in rank order: rank ``r`` runs stage ``r // pipelines``)."""
    if (pipelines < 1 or len(order) % pipelines or len(parts) != len(order) // pipelines + 1 or parts[0] != 0
            or any(b <= a for a, b in zip(parts, parts[1:], strict=False))):
        raise BambooError(
            f"a layout of {len(order)} nodes in {pipelines} pipeline(s) needs {len(order) // max(1, pipelines) + 1} "
            f"strictly increasing layer boundaries from 0 (got parts {list(parts)} for nodes {list(order)})"
        )
    stages = len(order) // pipelines
    return {layer: [order[s * pipelines + p] for p in range(pipelines)]
            for s in range(stages) for layer in range(parts[s], parts[s + 1])}


def transfer_plan(
    old_order: Sequence[str], old_parts: Sequence[int], new_order: Sequence[str], new_parts: Sequence[int],
    old_pipelines: int = 1, new_pipelines: int = 1,
) -> tuple[Move, ...]:
    """The moves that turn layout ``(old_order, old_parts)`` into ``(new_order, new_parts)``.

    Orders list nodes by rank (rank ``r`` runs stage ``r // pipelines`` of pipeline ``r % pipelines``).
    Nodes that keep a layer keep it (nothing sent); every other layer of a node's new stage comes
    from a node running it now (data-parallel pipelines hold equal copies: pipeline ``p`` of the new
    layout takes from old pipeline ``p mod old_pipelines``, which spreads the sending), in contiguous
    runs. Moves are ordered by destination rank, then layer, so that every node executes them in
    the same order (no deadlock with blocking sends).
    """
    old, new = _owners(old_order, old_parts, old_pipelines), _owners(new_order, new_parts, new_pipelines)
    if sorted(old) != sorted(new):
        raise BambooError(
            f"the new layout must cover the same layers as the old one (old: {len(old)} layers, new: {len(new)})"
        )
    if dups := sorted({n for n in new_order if list(new_order).count(n) > 1}):
        raise BambooError(f"a node may run one stage only (repeated: {dups})")
    if gone := sorted(set(old_order) - set(new_order)):
        raise BambooError(
            f"a reconfiguration keeps every node that holds layers (missing from the new layout: {gone}); "
            "losses are served by failover first"
        )
    runs: dict[tuple[str, str], list[Move]] = {}  # (src, dst) -> its contiguous runs of layers, in order
    for layer in sorted(new):
        holders = old[layer]
        for p, dst in enumerate(new[layer]):
            if dst in holders:
                continue
            src = holders[p % len(holders)]
            pair = runs.setdefault((src, dst), [])
            if pair and pair[-1].stop == layer:
                pair[-1] = Move(src, dst, pair[-1].start, layer + 1)
            else:
                pair.append(Move(src, dst, layer, layer + 1))
    rank = {n: i for i, n in enumerate(new_order)}
    return tuple(sorted((m for pair in runs.values() for m in pair), key=lambda m: (rank[m.dst], m.start)))
