"""Rendezvous by count: machines register as they boot; the job forms of the first ones once enough nodes are up.

Every supervisor started with ``--min-nodes N`` puts ``machines/<name>`` (its worker count, on a
lease it keeps alive while it waits) and waits. The first supervisor that sees machines with N
nodes or more registered puts ``roster`` once (``put_if_absent``): the registered machines in the
order they registered, as many as fit in ``--max-nodes``. Every supervisor then reads the same
roster: the machines in it start the job as if given ``--peers`` in that order, and the others
(late, or beyond the maximum) start as standby nodes that a ``RebalanceCallback`` admits. A
machine that arrives after the roster exists never waits for anyone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.membership.protocol import Store

MACHINES_KEY, ROSTER_KEY = "machines/", "roster"
#: the lease of a waiting machine's registration: a machine that dies while waiting drops out within it
REGISTRATION_TTL = 10.0


@dataclass(frozen=True)
class Registered:
    """A machine waiting for the job to form: its name, its workers and when it registered (store revision)."""

    machine: str
    workers: int
    revision: int


def choose_roster(registered: Sequence[Registered], min_nodes: int, max_nodes: int | None = None) -> list[str] | None:
    """The machines that form the job, in registration order; None while fewer than ``min_nodes`` nodes are up.

    Machines are taken in the order they registered while their nodes fit in ``max_nodes``
    (one that does not fit is skipped, a later smaller one may still fit).
    """
    if min_nodes < 1 or (max_nodes is not None and max_nodes < min_nodes):
        raise BambooConfigError(f"need 1 <= --min-nodes <= --max-nodes (got min {min_nodes}, max {max_nodes})")
    roster: list[str] = []
    nodes = 0
    for entry in sorted(registered, key=lambda r: r.revision):
        if max_nodes is not None and nodes + entry.workers > max_nodes:
            continue
        roster.append(entry.machine)
        nodes += entry.workers
    return roster if nodes >= min_nodes else None


def fleet_rendezvous(
    store: Store, base: str, machine: str, workers: int, min_nodes: int, max_nodes: int | None, timeout: float
) -> list[str] | None:
    """Register ``machine`` under ``base`` and wait (at most ``timeout`` s) for the roster; the roster if this
    machine is in it, None if it is to start as a standby node (the job formed without it)."""
    choose_roster([], min_nodes, max_nodes)  # checks the bounds before anything is written
    lease = store.grant_lease(REGISTRATION_TTL)
    store.put(f"{base}{MACHINES_KEY}{machine}", json.dumps({"workers": workers}), lease=lease.id)
    deadline, beat = time.monotonic() + timeout, time.monotonic()
    try:
        while True:
            kv = store.get(f"{base}{ROSTER_KEY}")
            if kv is not None:
                agreed = [str(m) for m in json.loads(kv.value)["machines"]]
                return agreed if machine in agreed else None
            snap = store.get_prefix(f"{base}{MACHINES_KEY}")
            registered = [Registered(k.key[len(base) + len(MACHINES_KEY):], int(json.loads(k.value)["workers"]),
                                     k.create_revision) for k in snap.kvs]
            counts = {r.workers for r in registered}
            if len(counts) > 1:
                raise BambooConfigError(
                    f"machines of one job must run the same --workers (registered: "
                    f"{ {r.machine: r.workers for r in registered} }); start every supervisor with the same --workers")
            proposal = choose_roster(registered, min_nodes, max_nodes)
            if proposal is not None:
                store.put_if_absent(f"{base}{ROSTER_KEY}", json.dumps({"machines": proposal, "by": machine}))
                continue  # read back whichever roster won
            now = time.monotonic()
            if now > deadline:
                nodes = sum(r.workers for r in registered)
                raise BambooConfigError(
                    f"the job did not form within {timeout:g} s: {nodes} node(s) registered "
                    f"({sorted(r.machine for r in registered)}), --min-nodes {min_nodes}; start more machines, "
                    "lower --min-nodes or raise --timeout")
            if now - beat > REGISTRATION_TTL / 3:
                store.keep_alive(lease.id)
                beat = now
            store.wait_for_change(base, snap.revision, timeout=min(1.0, max(0.05, deadline - now)))
    finally:
        store.revoke_lease(lease.id)  # registered or not, the roster (or the error) is what counts now
