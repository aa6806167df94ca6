"""Failover: which survivor serves which layers (pure), and re-forming the process group through the store."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_bamboo.errors import BambooError
from lightning_bamboo.schedule import replica_holder

log = logging.getLogger(__name__)


class FatalLoss(BambooError):
    """A lost stage has no live replica (a node and its replica holder were lost together)."""


#: exit status of a process that stops on a FatalLoss: "start the job again from its last checkpoint
#: with the nodes that are up" (EX_TEMPFAIL; the demo's driver does that on seeing it)
FATAL_EXIT_CODE = 75


@dataclass(frozen=True)
class Segment:
    """Layers ``start..stop-1`` (old stage ``stage``) served by ``node`` from its ``source`` copy."""

    stage: int
    node: str
    source: str  # "own" or "replica"


@dataclass(frozen=True)
class FailoverPlan:
    """The pipeline after a loss: ``order[i]`` is new rank i, serving layers ``parts[i]..parts[i+1]-1``."""

    order: tuple[str, ...]
    parts: tuple[int, ...]
    segments: tuple[Segment, ...]  # every old stage, in layer order

    def segments_of(self, node: str) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.node == node)


def plan_failover(nodes: Sequence[str], parts: Sequence[int], lost: Collection[str]) -> FailoverPlan:
    """Serve every stage of a pipeline from a survivor's own copy or its replica, with no data moved.

    ``nodes[s]`` ran stage ``s`` (layers ``parts[s]..parts[s+1]-1``) and holds the replica of
    stage ``s + 1`` (the ring: the last node holds stage 0's). A lost stage is served by its
    replica holder; the holder then runs two adjacent stages, one contiguous layer range. When
    stage 0 is lost its holder is the last node, whose own stage is not adjacent to stage 0: it
    keeps stage 0 and hands its own last stage to that stage's replica holder. Raises
    ``FatalLoss`` when a lost stage's replica holder is lost too.
    """
    stages = len(nodes)
    lost = set(lost)
    unknown = lost - set(nodes)
    if unknown:
        raise BambooError(f"lost nodes {sorted(unknown)} are not in the pipeline {list(nodes)}")
    serving: list[Segment] = []
    for stage, node in enumerate(nodes):
        if node not in lost:
            serving.append(Segment(stage, node, "own"))
            continue
        holder = nodes[replica_holder(stage, stages)]
        if holder in lost or holder == node:
            raise FatalLoss(
                f"stage {stage} (node {node}) and its replica holder (node {holder}) are both lost "
                f"(lost: {sorted(lost)}); the run must restore its last checkpoint"
            )
        serving.append(Segment(stage, holder, "replica"))
    # A node may now serve two stages that are not neighbours (only stage 0 and stage p-1): move the
    # last stage to its own replica holder.
    first, last = serving[0], serving[-1]
    if stages > 1 and first.node == last.node and any(s.node != first.node for s in serving):
        holder = nodes[replica_holder(stages - 1, stages)]
        if holder in lost:
            raise FatalLoss(
                f"stage {stages - 1} must move to its replica holder {holder} (its node also serves stage 0), "
                f"but {holder} is lost (lost: {sorted(lost)}); the run must restore its last checkpoint"
            )
        serving[-1] = Segment(stages - 1, holder, "replica")
    order: list[str] = []
    new_parts = [0]
    for seg in serving:
        if order and order[-1] == seg.node:
            new_parts[-1] = parts[seg.stage + 1]
            continue
        if seg.node in order:
            raise FatalLoss(f"node {seg.node} would serve two separate layer ranges ({serving}); cannot fail over")
        order.append(seg.node)
        new_parts.append(parts[seg.stage + 1])
    return FailoverPlan(tuple(order), tuple(new_parts), tuple(serving))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reform_process_group(
    store: Any, job: str, generation: int, order: Sequence[str], me: str, timeout: float, tag: str = "",
    gone: Callable[[], Collection[str]] = lambda: (),
) -> tuple[int, int, Any]:
    """Destroy the current process group and join a new one of ``order`` (rank = position).

    The new rank 0 hosts a fresh ``TCPStore`` (the old one may have died with its host) and
    publishes its address in the membership store; everyone else waits for it (bounded).
    Returns ``(rank, world_size, tcp_store)``; keep the store object alive on rank 0.
    """
    import torch.distributed as dist

    from lightning_bamboo.launcher import node_address
    from lightning_bamboo.membership.registry import job_prefix, wait_for_key

    rank, world = order.index(me), len(order)
    key = f"{job_prefix(job)}pg/{generation}/{tag}"
    host = node_address()  # the new rank 0 hosts the group's store where its peers reach it
    if rank == 0:
        port = free_port(host)
        tcp = dist.TCPStore(host, port, world, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
        store.put(key, json.dumps({"host": host, "port": port}))
    else:
        kv = wait_for_key(store, key, timeout, abort=lambda: bool(gone()))
        if kv is None and gone():
            from lightning_bamboo.engine.pipe import PeerLost

            raise PeerLost(f"{sorted(gone())} lost before the new process group formed", gone())
        if kv is None:
            raise BambooError(f"no process group address for generation {generation} within {timeout} s ({key})")
        address = json.loads(kv.value)
        tcp = dist.TCPStore(address["host"], address["port"], world, is_master=False, timeout=timedelta(seconds=timeout))
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"bamboo{generation}{tag}", tcp), rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout),
    )
    return rank, world, tcp
