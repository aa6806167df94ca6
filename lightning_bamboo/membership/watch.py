"""Watching a job's membership in the store: a key's arrival (``wait_for_key``), the membership as it is
(``read_membership``) and as it changes (``wait_for_membership_change``), and ``LossDetector``, the thread that
reports peers that stop being live. What a node writes there is ``membership/lease.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from lightning_bamboo.membership.keys import job_prefix
from lightning_bamboo.membership.members import Membership
from lightning_bamboo.membership.protocol import KeyValue, Snapshot, Store

_MEMBERSHIP_KINDS = ("leaving", "lost", "nodes")


def wait_for_key(store: Store, key: str, timeout: float, abort: Callable[[], bool] = lambda: False) -> KeyValue | None:
    """``key``'s entry once it is in the store; None after ``timeout`` seconds, or as soon as ``abort()``
    is true (asked at least once a second while the key is missing)."""
    deadline = time.monotonic() + timeout
    revision = 0
    while (kv := store.get(key)) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or abort():
            return None
        revision = store.wait_for_change(key, revision, timeout=min(remaining, 1.0)).revision
    return kv


def read_membership(store: Store, job: str, *, timeout: float | None = None) -> Membership:
    """``job``'s membership: its ``nodes/``, ``lost/`` and ``leaving/`` keys.

    Three prefix reads, not one of the whole job: the job's other keys (step commits, barriers)
    grow with every step, and a read of them all on every membership change made each step
    slower than the last. The snapshot takes the revision of the first read, so a change that
    lands between the reads is seen again by ``wait_for_membership_change`` (never missed).
    """
    base = job_prefix(job)
    snaps = [store.get_prefix(f"{base}{kind}/", timeout=timeout) for kind in _MEMBERSHIP_KINDS]
    kvs = tuple(kv for snap in snaps for kv in snap.kvs)
    return Membership.from_snapshot(job, Snapshot(kvs, snaps[0].revision))


def wait_for_membership_change(store: Store, job: str, after: Membership, timeout: float) -> Membership:
    """Wait at most ``timeout`` s for any change to ``job``'s nodes, losses or notices after ``after``.

    Returns the new membership (re-read), or ``after`` itself if nothing changed in time.
    Barrier keys under the job do not count as changes.
    """
    now, _ = wait_relevant(store, job, after.revision, timeout)
    return after if now is None else now


def wait_relevant(store: Store, job: str, revision: int, timeout: float) -> tuple[Membership | None, int]:
    """Wait for a membership change after ``revision``: (the new membership or None, the revision seen up to).

    A caller that waits again passes the returned revision, so the job's other keys (a commit per
    node per step) are looked at once, not again on every wait.
    """
    deadline = time.monotonic() + timeout
    base = job_prefix(job)
    rev = revision
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, rev
        change = store.wait_for_change(base, rev, remaining)
        if change.timed_out:
            return None, max(rev, change.revision)
        relevant = change.compacted or any(
            e.key[len(base) :].split("/", 1)[0] in ("nodes", "lost", "leaving") for e in change.events
        )
        if relevant:
            return read_membership(store, job), change.revision  # the store's bound, not what is left of a poll
        rev = change.revision


class LossDetector:
    """A thread that watches the membership and reports, once each, peers that stop being live.

    ``peers``: the ids to watch (None: every node live at ``start``; a listed peer that is not
    live at ``start`` is reported lost at once). After ``start`` returns,
    every loss of a watched peer — lease expiry, a loss notice, or a leave notice if
    ``notice_counts`` — sets ``event`` and adds the id to ``lost`` within the time the store
    needs to show it plus ``poll`` seconds; ``on_loss`` (if given) is called from the thread.
    ``error`` holds the last store error (the thread keeps retrying). ``stop`` returns within
    ``poll`` + the store's call timeout.
    """

    def __init__(
        self,
        store: Store,
        job: str,
        peers: Collection[str] | None = None,
        *,
        on_loss: Callable[[tuple[str, ...], Membership], None] | None = None,
        notice_counts: bool = True,
        poll: float = 1.0,
    ) -> None:
        self.store, self.job, self.poll = store, job, poll
        self._peers = None if peers is None else set(peers)
        self._on_loss = on_loss
        self._notice_counts = notice_counts
        self.event = threading.Event()
        self.lost: set[str] = set()
        self.membership: Membership | None = None
        self.error: Exception | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, *, timeout: float | None = None) -> LossDetector:
        m = read_membership(self.store, self.job, timeout=timeout)
        if self._peers is None:
            self._peers = set(m.live)
        self.membership = m
        self._check(m, m)
        self._thread = threading.Thread(target=self._run, name="bamboo-loss-detector", daemon=True)
        self._thread.start()
        return self

    def _down(self, m: Membership) -> set[str]:
        assert self._peers is not None
        down = {p for p in self._peers if p not in m.live}
        if self._notice_counts:
            down |= {p for p in self._peers if p in m.leaving}
        return down

    def _check(self, before: Membership, now: Membership) -> None:
        assert self._peers is not None
        down = self._down(now)
        # A peer that came back as a new incarnation was lost in between.
        down |= {
            p
            for p in self._peers
            if p in before.live and p in now.live and before.nodes[p].incarnation != now.nodes[p].incarnation
        }
        with self._lock:
            new = tuple(sorted(down - self.lost))
            self.lost |= set(new)
        if new:
            self.event.set()
            if self._on_loss is not None:
                try:
                    self._on_loss(new, now)
                except Exception as e:  # a failing callback must not stop detection
                    self.error = e

    def _run(self) -> None:
        assert self.membership is not None
        m = self.membership
        seen = m.revision
        while not self._stop.is_set():
            try:
                now, seen = wait_relevant(self.store, self.job, max(seen, m.revision), self.poll)
            except Exception as e:  # noqa: BLE001 - a watcher that dies silently is worse than any error
                self.error = e
                self._stop.wait(self.poll)
                continue
            self.error = None
            if now is not None:
                self._check(m, now)
                self.membership = m = now

    def watch(self, peers: Collection[str]) -> None:
        """Replace the watched set (after a reconfiguration); forgets earlier losses and clears ``event``."""
        with self._lock:
            self._peers = set(peers)
            self.lost = set()
            self.event.clear()
        if self.membership is not None:
            self._check(self.membership, self.membership)

    def stop(self, wait: bool = True) -> None:
        """Stop watching. ``wait``: until the thread has ended (up to a poll, as it may be inside a store call);
        without, it ends by itself within a poll, and what it sees meanwhile goes to this object alone (a
        reconfiguration's new detector takes over at once)."""
        self._stop.set()
        if self._thread is not None:
            if wait:
                self._thread.join(self.poll + 10.0)
            self._thread = None

    def __enter__(self) -> LossDetector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
