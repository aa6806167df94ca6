"""Live reconfiguration: moving layers point to point as a ``topology.transfer`` plan says.

Each layer goes with its weights and optimizer state, no disk; replicas are rebuilt afterwards by
the usual ring exchange.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_bamboo.errors import BambooError
from lightning_bamboo.topology.transfer import Move


def move_layers(
    moves: Sequence[Move], me: str, order: Sequence[str], states: Mapping[int, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Execute ``moves`` over the current process group; returns the layer states this node received.

    ``states`` are the layers this node runs now (sent where a move says so); ``order`` is the new
    process group's nodes (rank = position). Every node walks the same list in the same order
    and takes part only in its own moves, so the blocking point-to-point calls cannot deadlock.
    """
    from lightning_bamboo.engine.transfer import exchange_objects

    rank_of = {node: rank for rank, node in enumerate(order)}
    received: dict[int, dict[str, Any]] = {}
    for move in moves:
        if move.src == me:
            missing = [i for i in move.layers if i not in states]
            if missing:
                raise BambooError(f"{me} must send layers {missing} it does not hold")
            for i in move.layers:  # a layer per message: one serialised layer at a time on each end, not a run
                exchange_objects({i: states[i]}, send_to=rank_of[move.dst], recv_from=None)
        elif move.dst == me:
            for _ in move.layers:
                received.update(exchange_objects(None, send_to=None, recv_from=rank_of[move.src]))
    return received
