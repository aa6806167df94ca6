"""Process groups of a changing pipeline: a free port, and re-forming the group through the membership store."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta
from typing import Any

from lightning_bamboo.engine.comm_process import BACKEND, CommAborted, abort_generation, open_generation
from lightning_bamboo.errors import BambooError, PeerLost
from lightning_bamboo.membership.address import free_port
from lightning_bamboo.membership.keys import JobKeys
from lightning_bamboo.membership.node import node_address
from lightning_bamboo.membership.watch import wait_for_key


def reset_group_names() -> None:
    """Let the next process groups of this process be named as a new process's would be.

    torch names a group it makes by a process-wide count, which only destroying the default group
    resets, and a group that failed to form (a member lost or late while it formed) counted too. Groups
    form by name: a process that ran a job before, or a failover that tries again, would name the next
    generation's groups apart from a new process's, and they would never form (the survivors of a
    restart waited out the connect timeout, failed, and restarted again, without end). Called with no
    process group left (after ``destroy_process_group``)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not dist.is_initialized():
        c10d._world.group_count = 0


#: seconds one try to connect to the new rank 0's store may take: a connection to a machine that vanished (no
#: refusal, no answer) would otherwise hold the node for the whole rendezvous timeout, while its loss is known
CONNECT_TRY_SECONDS = 1.0


def _connect_store(host: str, port: int, world: int, timeout: float, gone: Callable[[], Collection[str]]) -> Any:
    """A client of the store the new rank 0 hosts at ``host:port``: tries of ``CONNECT_TRY_SECONDS`` until ``timeout``,
    giving up with ``PeerLost`` as soon as a node of the new group is known lost (its host may be the one gone); the
    client's operations then wait up to ``timeout``, as the group's."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while True:
        seconds = max(0.1, min(CONNECT_TRY_SECONDS, deadline - time.monotonic()))
        try:
            tcp = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=seconds))
        except RuntimeError as err:  # DistNetworkError: refused, reset or timed out
            if lost := gone():
                raise PeerLost(f"{sorted(lost)} lost before the new process group formed (its store at {host}:{port} "
                               "did not answer)", lost) from err
            if time.monotonic() >= deadline:
                raise BambooError(f"the new process group's store at {host}:{port} did not answer within {timeout} s "
                                  f"({err})") from err
            continue
        tcp.set_timeout(timedelta(seconds=timeout))
        return tcp


def reform_process_group(
    store: Any, job: str, generation: int, order: Sequence[str], me: str, timeout: float, tag: str = "",
    gone: Callable[[], Collection[str]] = lambda: (), backend: str = BACKEND,
) -> tuple[int, int, Any]:
    """Destroy the current process group and join a new one of ``order`` (rank = position).

    The new rank 0 hosts a fresh ``TCPStore`` (the old one may have died with its host) and
    publishes its address in the membership store; everyone else waits for it (bounded).
    With the abortable ``backend`` (the default) the old generation's communication process is
    aborted first, so nothing of it can block, and the new one's groups form in a new one.
    Returns ``(rank, world_size, tcp_store)``; keep the store object alive on rank 0.
    """
    import torch.distributed as dist

    rank, world = order.index(me), len(order)
    key = JobKeys(job).process_group(generation, tag)
    host = node_address()  # the new rank 0 hosts the group's store where its peers reach it
    if rank == 0:
        port = free_port(host)
        tcp = dist.TCPStore(host, port, world, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
        store.put(key, json.dumps({"host": host, "port": port}))
    else:
        kv = wait_for_key(store, key, timeout, abort=lambda: bool(gone()))
        if kv is None and gone():
            raise PeerLost(f"{sorted(gone())} lost before the new process group formed", gone())
        if kv is None:
            raise BambooError(f"no process group address for generation {generation} within {timeout} s ({key})")
        address = json.loads(kv.value)
        tcp = _connect_store(address["host"], address["port"], world, timeout, gone)
    abort_generation()
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_group_names()
    prefix = f"bamboo{generation}{tag}"
    try:
        if backend == BACKEND:  # (its communication process may not come up if a peer is lost meanwhile)
            open_generation(address["host"] if rank else host, tcp.port, prefix, timeout, abort_if=lambda: bool(gone()))
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, tcp), rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
    except CommAborted as err:
        if gone():
            raise PeerLost(f"{sorted(gone())} lost while the new process group formed", gone()) from err
        raise
    return rank, world, tcp
