"""Fencing: a node that may have been declared lost writes nothing the job acts on, even after its network heals.

A node is declared lost when its lease expires in the store (a partition, a frozen machine) or when
the survivors put it in the lost set of the next generation (``decision/<generation>``). The
survivors then fail over without it. When its network comes back it still runs the old step and
would go on writing: commits, a grown lost set, collective parts, checkpoints. ``FencedStore``
wraps the store a node's runtime writes through. Every write first asks ``Registry.lease_may_have_expired``,
a local check with no round trip: the last keep-alive that succeeded was sent a TTL ago or more, or
the store has said the lease is gone. Once that holds, every write raises ``Fenced`` and reads go
on. The store keeps a lease for at least a TTL after the keep-alive that renewed it was sent, so
this node stops writing no later than the moment its peers can see it lost.

The store checks too: every write carries the node's membership as its guard (``nodes/<id>`` held
by its lease, see ``Store``), and the store applies the write only while that holds, in the same
atomic step. So a write that was already in flight when the lease ended, or that a node sends
after its network heals, is refused by the store itself (``Fenced``): nothing of it lands.
Checkpoint commits ask the store the same way first (:meth:`FencedStore.confirm`).
"""

from __future__ import annotations

from typing import Any

from lightning_bamboo.membership.protocol import Fenced, Guard

__all__ = ["Fenced", "FencedStore"]


class FencedStore:
    """A ``Store`` whose writes are refused once ``registry``'s lease may have expired (see the module docstring).

    Reads, leases and waits pass through unchanged, so a fenced node can still see what the
    others decided (and learn that it was declared lost).
    """

    _WRITES = frozenset({"put", "delete", "delete_prefix", "put_if_absent", "compare_and_put"})

    def __init__(self, store: Any, registry: Any) -> None:
        self._store, self._registry = store, registry

    @property
    def fenced(self) -> bool:
        return bool(self._registry.lease_may_have_expired())

    def check(self, what: str = "write") -> None:
        """Raise ``Fenced`` if this node may have been declared lost."""
        if self.fenced:
            node, ttl = self._registry.node_id, self._registry.ttl
            raise Fenced(f"{node} refuses to {what}: its lease may have expired (no keep-alive succeeded for "
                         f"{ttl:g} s, or the store dropped it), so its peers may have declared it lost and "
                         "failed over; it stops, and can join the job again as a new standby node")

    def guard(self) -> Guard | None:
        """This node's membership as a write guard (None before it joined)."""
        lease = self._registry.lease_id
        return (self._registry.node_key(self._registry.node_id), lease) if lease else None

    def confirm(self, key: str, what: str) -> None:
        """Raise ``Fenced`` unless the store itself still counts this node as a member, by a guarded
        write of ``what`` to ``key``: the last check before an act outside the store (a checkpoint
        commit)."""
        self.check(what)
        self._store.put(key, what, guard=self.guard())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in self._WRITES:
            return attr

        def fenced_write(key: str, *args: Any, **kwargs: Any) -> Any:
            self.check(f"{name} {key}")
            return attr(key, *args, guard=self.guard(), **kwargs)

        return fenced_write
