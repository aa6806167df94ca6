"""A node's lease in the membership store: ``Registry.join`` registers it under a lease kept alive by heartbeats;
it announces the losses it sees and its own leaving. ``abandon_job`` marks a job a fatal loss ended. What watches
the membership is ``membership/watch.py``."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.membership.keys import JobKeys, check_name, job_prefix
from lightning_bamboo.membership.members import LeaveNotice, LossNotice, Membership, NodeInfo
from lightning_bamboo.membership.protocol import (
    Guard,
    Store,
    StoreError,
    StoreUnavailableError,
)
from lightning_bamboo.membership.watch import read_membership, wait_for_membership_change

log = logging.getLogger(__name__)

#: Lease TTL of a node (seconds). A node that freezes is seen as gone after at most TTL + the store's
#: expiry slack (etcd checks leases every 0.5 s), so 8 s keeps detection under the 10 s target.
DEFAULT_TTL = 8.0


class NodeIdInUseError(StoreError):
    """Another live incarnation already holds this node id."""


def abandon_job(store: Store, job: str, reason: str) -> None:
    """Mark ``job`` as ended by a fatal loss (``keys.ABANDONED_KEY``): its standby nodes stop waiting for an
    admission (``Session.wait_admission`` raises ``FatalLoss``) and may offer their process to the next job."""
    record = {"generation": -1, "order": [], "abandoned": reason}
    store.put(JobKeys(job).abandoned, json.dumps(record))


class Registry:
    """One node's membership: ``join`` registers it under a lease kept alive by a heartbeat thread.

    Call ``join`` once before training; ``leave`` on a clean exit (its keys vanish at once;
    without it they vanish TTL after the last heartbeat). ``lease_lost`` is set if the store
    says our lease expired (we were frozen or cut off longer than the TTL): the others already
    treat us as gone, so the supervisor must stop this incarnation rather than carry on.
    """

    def __init__(
        self,
        store: Store,
        job: str,
        node_id: str,
        *,
        ttl: float = DEFAULT_TTL,
        heartbeat: float | None = None,
        address: str = "",
        meta: Mapping[str, Any] | None = None,
        on_lease_lost: Callable[[str], None] | None = None,
    ) -> None:
        if not ttl > 0:
            raise BambooConfigError(
                f"a node lease needs ttl > 0 seconds (got {ttl}); the default is {DEFAULT_TTL}"
            )
        self.heartbeat = ttl / 3 if heartbeat is None else float(heartbeat)
        if not 0 < self.heartbeat < ttl:
            raise BambooConfigError(
                f"heartbeat must be in (0, ttl) seconds (got heartbeat={heartbeat}, ttl={ttl}); use about ttl/3"
            )
        self.store, self.job, self.ttl = store, job, float(ttl)
        self.node_id = check_name("node id", node_id)
        self.info = NodeInfo(
            node_id=node_id,
            incarnation=uuid.uuid4().hex[:12],
            address=address,
            host=socket.gethostname(),
            pid=os.getpid(),
            meta=dict(meta or {}),
        )
        self.lease_id = 0
        self.lease_lost = threading.Event()
        #: ``time.monotonic()`` when the last keep-alive that succeeded was sent: the store keeps the lease
        #: until at least ``renewed_at + ttl`` (it restarts the countdown when the keep-alive arrives)
        self.renewed_at: float | None = None
        self.last_error: Exception | None = None
        #: ``time.monotonic()`` of the first failed heartbeat of the current run of failures; None when fine.
        self.unreachable_since: float | None = None
        self._on_lease_lost = on_lease_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- keys --
    @property
    def keys(self) -> JobKeys:
        """The key schema of this registry's job (``job`` may be set again: a reporter that follows a new job)."""
        return JobKeys(self.job)

    @property
    def base(self) -> str:
        return job_prefix(self.job)

    def node_key(self, node_id: str) -> str:
        return self.keys.node(node_id)

    def guard(self) -> Guard | None:
        """This node's membership as a write guard (``Store``): its announcements land only while it is a
        member. None while it has not joined (a launcher reporting its workers' deaths)."""
        return (self.node_key(self.node_id), self.lease_id) if self.lease_id else None

    def _info_json(self, info: Any) -> str:
        d = asdict(info)
        d.pop("revision", None)
        return json.dumps(d, sort_keys=True)

    # -- lifecycle --
    def join(self, *, timeout: float | None = None) -> Membership:
        """Register this node (lease + ``nodes/<id>``) and start heartbeats; returns the membership after it.

        Raises ``NodeIdInUseError`` if another incarnation holds the id and its lease is alive.
        """
        if self._thread is not None:
            raise StoreError(f"node {self.node_id!r} already joined job {self.job!r}")
        sent = time.monotonic()
        lease = self.store.grant_lease(self.ttl, timeout=timeout)
        self.lease_id = lease.id
        self.lease_lost.clear()  # a new lease (a standby registering again): the old one's end is not its
        self.info = replace(self.info, lease=lease.id)  # the record names its lease (``members``: else ignored)
        self.renewed_at = sent
        won, kv = self.store.put_if_absent(
            self.node_key(self.node_id), self._info_json(self.info), lease=lease.id, timeout=timeout
        )
        if not won:
            self.store.revoke_lease(lease.id, timeout=timeout)
            other = json.loads(kv.value)
            raise NodeIdInUseError(
                f"node id {self.node_id!r} is already registered in job {self.job!r} by pid {other.get('pid')} on "
                f"{other.get('host')!r} (incarnation {other.get('incarnation')}); give each process its own id, "
                f"or wait up to {self.ttl:.0f} s for the old one's lease to expire"
            )
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat, name=f"bamboo-heartbeat-{self.node_id}", daemon=True
        )
        self._thread.start()
        return read_membership(self.store, self.job, timeout=timeout)

    #: seconds between two tries of a keep-alive that failed
    RETRY_SECONDS = 0.1

    def _beat(self) -> None:
        """Renew the lease every ``heartbeat`` seconds, counted from each send (not from each answer).

        A keep-alive may take what is left of the lease, and one that fails is tried again at once: a store
        or a machine slow for a moment renews the lease late, not never. (A beat given up after one heartbeat
        and tried again a heartbeat later left no time before the TTL ran out: a single keep-alive slower
        than a heartbeat, ttl/3, fenced a live node, and its peers took it for lost.)"""
        next_at = time.monotonic() + self.heartbeat
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            sent = time.monotonic()
            left = (self.renewed_at if self.renewed_at is not None else sent) + self.ttl - sent
            try:
                alive = self.store.keep_alive(self.lease_id, timeout=max(self.heartbeat, left))
            except StoreError as e:
                self.last_error = e
                if self.unreachable_since is None:  # said once a run of failures
                    self.unreachable_since = time.monotonic()
                    log.warning("%s: keep-alive failed after %.2f s (%s); trying again, %.2f s of the lease left",
                                self.node_id, self.unreachable_since - sent, e, left - (self.unreachable_since - sent))
                next_at = time.monotonic() + min(self.heartbeat, self.RETRY_SECONDS)
                continue
            took = time.monotonic() - sent
            if took > self.heartbeat:
                log.warning("%s: keep-alive took %.2f s (heartbeat %.2f s, lease %.2f s)", self.node_id, took,
                            self.heartbeat, self.ttl)
            self.unreachable_since = None
            next_at = sent + self.heartbeat
            if alive:
                self.renewed_at = sent
            else:
                self.lease_lost.set()
                if self._on_lease_lost is not None:
                    self._on_lease_lost(self.node_id)
                return

    def lease_may_have_expired(self) -> bool:
        """True once the store may have let this node's lease expire (and its peers declared it lost): the
        store said so, or no keep-alive has succeeded for a TTL. From then on this node must not act as a
        member (``membership.fence``); it never becomes False again for that lease (only ``join`` takes a new one)."""
        if self.lease_lost.is_set():
            return True
        if self.renewed_at is not None and time.monotonic() - self.renewed_at >= self.ttl:
            self.lease_lost.set()
            return True
        return False

    def leave(self, *, timeout: float | None = None) -> None:
        """Stop heartbeats and revoke the lease: ``nodes/<id>`` and ``leaving/<id>`` vanish now. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl + 5.0)  # a keep-alive in flight may take what was left of the lease
            self._thread = None
        if self.lease_id:
            try:
                self.store.revoke_lease(self.lease_id, timeout=timeout)
            except StoreUnavailableError:
                pass  # the lease expires on its own
            self.lease_id = 0

    def stop_heartbeat(self) -> None:
        """Stop renewing the lease without revoking it (as a frozen node would): keys vanish after the TTL."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl + 5.0)  # a keep-alive in flight may take what was left of the lease
            self._thread = None

    # -- announcements --
    def announce_loss(
        self, node_id: str, reason: str, *, incarnation: str | None = None, timeout: float | None = None
    ) -> bool:
        """Record that ``node_id`` failed (e.g. our recv from it raised). True if we were the first to say so.

        Call it as soon as a communication error names a peer: every other node's
        ``wait_for_membership_change``/``LossDetector`` wakes on it, long before the lease expires.
        ``incarnation`` defaults to the one registered now (so a re-joined node is not hit).
        """
        check_name("node id", node_id)
        if incarnation is None:
            kv = self.store.get(self.node_key(node_id), timeout=timeout)
            incarnation = json.loads(kv.value)["incarnation"] if kv else ""
        notice = LossNotice(node_id=node_id, incarnation=incarnation, reporter=self.node_id, reason=reason)
        key = self.keys.lost(node_id)
        won, kv = self.store.put_if_absent(key, self._info_json(notice), timeout=timeout, guard=self.guard())
        if not won and json.loads(kv.value).get("incarnation") != incarnation:
            # A notice about an older incarnation: replace it with ours (once, by CAS).
            won, _ = self.store.compare_and_put(
                key, self._info_json(notice), expected_revision=kv.mod_revision, timeout=timeout, guard=self.guard()
            )
        return won

    def clear_loss(self, node_id: str, *, timeout: float | None = None) -> bool:
        """Remove ``lost/<node_id>`` once the reconfiguration that handles it is done."""
        return self.store.delete(self.keys.lost(node_id), timeout=timeout, guard=self.guard())

    def announce_leaving(
        self, grace: float, reason: str = "preemption notice", *, timeout: float | None = None
    ) -> None:
        """Say that this node will be gone within ``grace`` s (SIGTERM with notice). Attached to our lease."""
        notice = LeaveNotice(self.node_id, self.info.incarnation, time.time() + grace, reason)
        self.store.put(
            self.keys.leaving(self.node_id),
            self._info_json(notice),
            lease=self.lease_id,
            timeout=timeout,
            guard=self.guard(),
        )

    def members(self, *, timeout: float | None = None) -> Membership:
        return read_membership(self.store, self.job, timeout=timeout)

    def wait_for_change(self, after: Membership, timeout: float) -> Membership:
        return wait_for_membership_change(self.store, self.job, after, timeout)
