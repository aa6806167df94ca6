"""Collectives through a Store for nodes that may die mid-way: a barrier, and a gather that fails for all or none."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from lightning_bamboo.membership.keys import check_name
from lightning_bamboo.membership.protocol import Store, StoreError


class BarrierTimeoutError(StoreError, TimeoutError):
    """Not every expected participant reached a barrier in time."""


class GatherFailed(StoreError):
    """A collective through the store (``gather``) failed for every participant: ``lost`` never put its part."""

    def __init__(self, message: str, lost: Collection[str]) -> None:
        super().__init__(message)
        self.lost = tuple(sorted(lost))


def barrier(
    store: Store,
    prefix: str,
    me: str,
    expected: Collection[str],
    timeout: float,
    *,
    value: str = "",
    lease: int = 0,
) -> dict[str, str]:
    """Put ``prefix/me`` and wait until every name in ``expected`` has put its key; returns name -> value.

    Use a fresh prefix per rendezvous round (e.g. ``job_prefix(job) + f"rdzv/{round}"``). With
    ``lease`` the arrival vanishes if we die, so a barrier never counts a dead node. Raises
    ``BarrierTimeoutError`` naming the missing participants after ``timeout`` s.
    """
    base = prefix.rstrip("/") + "/"
    want = set(expected)
    store.put(base + check_name("participant", me), value, lease=lease)
    deadline = time.monotonic() + timeout
    snap = store.get_prefix(base)
    while True:
        got = {kv.key[len(base) :]: kv.value for kv in snap.kvs}
        missing = want - set(got)
        if not missing:
            return {k: v for k, v in got.items() if k in want}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BarrierTimeoutError(
                f"barrier {base} at {store.url}: {len(want) - len(missing)} of {len(want)} arrived within "
                f"{timeout:.1f} s; missing {sorted(missing)}. A missing node is dead or slow: check its "
                "logs, or re-plan without it"
            )
        store.wait_for_change(base, snap.revision, remaining)
        snap = store.get_prefix(base)  # the store's own bound: a short barrier does not make a slow store fail


def gather(
    store: Store,
    prefix: str,
    me: str,
    expected: Sequence[str],
    value: str,
    timeout: float,
    lost: Callable[[], Collection[str]],
    *,
    poll: float = 0.2,
) -> list[str]:
    """Put ``value`` as ``me``'s part of one collective; return every part, in ``expected`` order, or fail for all.

    The outcome is decided once, in the store: the first participant to see every part puts
    ``outcome`` = done; the first to see a part missing from a node that ``lost()`` names puts
    ``outcome`` = failed. Everyone follows that key, so either every survivor returns the same
    parts or every survivor raises ``GatherFailed`` at the same collective; a part put by a node
    that died afterwards still counts. (A gloo collective gives no such guarantee: some ranks can
    finish it while others are still waiting when a peer dies, and after the failover they would
    retry different collectives.) Use a fresh ``prefix`` per collective.
    """
    base = prefix.rstrip("/") + "/"
    parts, outcome_key = base + "n/", base + "outcome"
    store.put(parts + check_name("participant", me), value)
    want = list(expected)
    deadline = time.monotonic() + timeout
    revision = 0
    while True:
        snap = store.get_prefix(base)
        got = {kv.key[len(parts) :]: kv.value for kv in snap.kvs if kv.key.startswith(parts)}
        outcome = next((kv.value for kv in snap.kvs if kv.key == outcome_key), None)
        if outcome is None:
            missing = set(want) - set(got)
            gone = missing & set(lost())
            if not missing:
                outcome = store.put_if_absent(outcome_key, f"done:{me}")[1].value
            elif gone:
                outcome = store.put_if_absent(outcome_key, f"failed:{me}:{','.join(sorted(gone))}")[1].value
        if outcome is not None:
            if outcome.startswith("failed:"):
                names = outcome.split(":", 2)[2].split(",")
                raise GatherFailed(f"collective {base} failed: {', '.join(names)} lost before putting a part", names)
            if set(want) - set(got):  # decided done by someone who saw parts our snapshot predates
                got = {kv.key[len(parts) :]: kv.value for kv in store.get_prefix(parts).kvs}
            return [got[name] for name in want]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BarrierTimeoutError(
                f"collective {base} at {store.url}: {len(want) - len(missing)} of {len(want)} parts within "
                f"{timeout:.1f} s; missing {sorted(missing)} (none of them reported lost). A missing node is "
                "stuck or slow: check its logs"
            )
        change = store.wait_for_change(base, max(revision, snap.revision), min(remaining, poll))
        revision = change.revision
