"""The membership store contract: a small key/value Protocol with revisions, leases, bounded waits and CAS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from lightning_bamboo.errors import BambooConfigError, BambooError

#: Every call that talks to a server takes ``timeout`` (seconds); ``None`` means the client's ``request_timeout``,
#: this unless it was connected with another (a node's session: its detection timeout, see ``request_timeout_for``).
DEFAULT_TIMEOUT = 5.0
#: An answer later than this (after what a wait is held for) is logged as a slow store: it is still waited for,
#: up to the request's timeout.
SLOW_ANSWER_SECONDS = 2.0


class StoreError(BambooError):
    """A membership store call failed; the message names the store URL and the fix."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The store could not be reached (or did not answer) within the call's timeout."""


class StoreTimeoutError(StoreUnavailableError, TimeoutError):
    """The store accepted the connection but did not answer within the call's timeout."""


class Fenced(BambooError):
    """A write refused because its writer's membership may have ended: its lease lapsed or the store
    dropped it, so its peers may have declared it lost (see ``membership.fence``)."""


#: a write's guard ``(key, lease)``: the store applies the write only while ``key`` exists with ``lease``
#: attached (the writer's membership key), and refuses it with :class:`Fenced` otherwise
Guard = tuple[str, int]


class LeaseExpiredError(StoreError):
    """A key was attached to, or a keep-alive sent for, a lease the store no longer holds."""


class StoreURLError(BambooConfigError):
    """A store URL is malformed or names an unknown backend."""


class StoreCredentialsError(StoreError, BambooConfigError):
    """The store refused this process's credentials (a token, a certificate, a user and password), or they are
    missing: a configuration to fix, said in one line before any worker starts."""


class StorePermissionError(StoreError):
    """The store refused an operation the credentials are not allowed (an etcd role without write access to the
    key); nothing was changed."""


@dataclass(frozen=True)
class KeyValue:
    """One key as stored. ``create_revision`` and ``mod_revision`` are store revisions; ``lease`` 0 = none."""

    key: str
    value: str
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True)
class Snapshot:
    """The keys under a prefix (sorted by key) as of store revision ``revision``."""

    kvs: tuple[KeyValue, ...]
    revision: int

    def as_dict(self) -> dict[str, str]:
        return {kv.key: kv.value for kv in self.kvs}


@dataclass(frozen=True)
class Event:
    """One change: ``put`` (value set) or ``delete`` (explicit, or because the key's lease expired)."""

    kind: Literal["put", "delete"]
    key: str
    value: str
    revision: int


@dataclass(frozen=True)
class Change:
    """Result of a bounded wait: the events under the prefix with ``after < revision <= self.revision``.

    ``events`` is empty when the wait timed out (then ``revision`` >= the ``after`` asked for). ``revision`` is the value to pass as
    ``after_revision`` to the next wait so that no event is missed or seen twice.
    ``compacted`` is True when the store no longer holds history that old: events may be
    missing, so re-read the prefix with ``get_prefix`` and wait after its revision.
    """

    events: tuple[Event, ...]
    revision: int
    compacted: bool = False

    @property
    def timed_out(self) -> bool:
        return not self.events and not self.compacted


@dataclass(frozen=True)
class Lease:
    """A lease as granted: ``ttl`` is what the server granted (etcd rounds up to whole seconds)."""

    id: int
    ttl: float


@runtime_checkable
class Store(Protocol):
    """A membership store. All methods are thread-safe and may be called from any thread.

    Every call is bounded: it returns, or raises ``StoreUnavailableError`` naming the URL and the
    fix, within ``timeout`` seconds (the client's ``request_timeout`` when None) plus a small constant. A
    store that answers late (a loaded or paused server) is slow, not unavailable: a wait's answer may
    come up to ``request_timeout`` after the time it was held for, and a late answer is logged. A call
    that fails because the server is momentarily unreachable is retried inside that bound, so a
    store server that restarts faster than the timeout is invisible to callers.

    Keys and values are text (use JSON for structure). Revisions are the store's global,
    strictly increasing change counter, as in etcd: every put or delete (including the deletes
    caused by an expired lease) gets a new revision.

    Every write takes an optional ``guard=(key, lease)``: the store checks, in the same atomic step
    as the write, that ``key`` exists with ``lease`` attached, and otherwise writes nothing and the
    call raises :class:`Fenced`. A node guards its writes with its own membership key, so once its
    lease has ended (it was declared lost) no write of it lands, however late it arrives.
    """

    url: str

    def put(
        self, key: str, value: str, *, lease: int = 0, timeout: float | None = None, guard: Guard | None = None
    ) -> int:
        """Set ``key`` to ``value``; with ``lease`` the key is deleted when that lease expires or is revoked.

        After it returns, every later ``get`` from any client sees this value (or a later one),
        and the returned revision is the key's ``mod_revision``. Raises ``LeaseExpiredError`` if
        ``lease`` is no longer held.
        """
        ...

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        """The current value of ``key``, or None if absent."""
        ...

    def get_prefix(self, prefix: str, *, timeout: float | None = None) -> Snapshot:
        """All keys starting with ``prefix`` and the store revision they were read at (one consistent read)."""
        ...

    def delete(self, key: str, *, timeout: float | None = None, guard: Guard | None = None) -> bool:
        """Delete ``key``; True if it existed. After it returns, no client sees the key."""
        ...

    def delete_prefix(self, prefix: str, *, timeout: float | None = None, guard: Guard | None = None) -> int:
        """Delete every key starting with ``prefix`` (one revision); returns how many existed."""
        ...

    def put_if_absent(
        self, key: str, value: str, *, lease: int = 0, timeout: float | None = None, guard: Guard | None = None
    ) -> tuple[bool, KeyValue]:
        """Create ``key`` only if it does not exist: the decision taken once among concurrent callers.

        Returns ``(won, kv)`` where ``kv`` is the key as stored after the call: ours if we won,
        the winner's otherwise. Exactly one of any set of concurrent callers wins. Give each
        contender a distinct value (e.g. include the node id): if the connection drops after the
        server applied our write, the call decides by reading the key back.
        """
        ...

    def compare_and_put(
        self,
        key: str,
        value: str,
        *,
        expected_revision: int,
        lease: int = 0,
        timeout: float | None = None,
        guard: Guard | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Set ``key`` only if its ``mod_revision`` is ``expected_revision`` (0 = only if absent).

        Returns ``(swapped, kv)`` with ``kv`` the key as stored after the call (None if absent).
        Among concurrent callers holding the same expected revision, exactly one swaps.
        """
        ...

    def grant_lease(self, ttl: float, *, timeout: float | None = None) -> Lease:
        """Grant a lease of ``ttl`` seconds (> 0). It expires unless ``keep_alive`` is called within each TTL."""
        ...

    def keep_alive(self, lease: int, *, timeout: float | None = None) -> bool:
        """Reset ``lease``'s countdown to its full TTL. False if the lease has already expired or was revoked
        (its keys are then gone; grant a new lease and put them again)."""
        ...

    def revoke_lease(self, lease: int, *, timeout: float | None = None) -> None:
        """Revoke ``lease`` now; its keys are deleted (one revision). Revoking an unknown lease is a no-op."""
        ...

    def wait_for_change(self, prefix: str, after_revision: int, timeout: float) -> Change:
        """Wait at most ``timeout`` seconds for changes under ``prefix`` with revision > ``after_revision``.

        Returns at once when such changes already happened (events are kept in history, so a
        change between a ``get_prefix`` and this call is never lost: pass the snapshot's
        revision). On timeout returns a ``Change`` with no events and ``revision`` >=
        ``after_revision`` (the embedded store advances it past changes outside the prefix).
        Changes that do not create a revision (keep-alives) never wake it. Raises
        ``StoreUnavailableError`` only if the store stayed unreachable until the timeout.
        """
        ...

    def close(self) -> None:
        """Release connections. Leases are not revoked (they expire on their own). Idempotent."""
        ...


#: the least time a request gets when its caller's time ran out before its first attempt (a short wait's
#: remainder, or a process that waited for a core): a store is "unavailable" only if it did not answer
FIRST_ATTEMPT_SECONDS = 1.0


def request_timeout_for(detection_timeout: float) -> float:
    """How long a node's store requests may wait for an answer: as long as its lease allows, so a slow store
    delays the node and never fails it (its lease, just below ``detection_timeout``, decides whether it is
    lost). Never below ``DEFAULT_TIMEOUT``: a short detection timeout makes losses seen sooner, not the
    store's answers come sooner."""
    return max(DEFAULT_TIMEOUT, float(detection_timeout))


def deadline_for(timeout: float | None, default: float = DEFAULT_TIMEOUT) -> float:
    """Seconds allowed to a call: ``timeout``, or ``default`` when None; rejects non-positive values."""
    t = default if timeout is None else float(timeout)
    if not t > 0:
        raise BambooConfigError(
            f"a store call needs a timeout > 0 seconds (got {timeout!r}); pass e.g. timeout=5.0"
        )
    return t


def prefix_end(prefix: str) -> str:
    """The smallest string greater than every string starting with ``prefix`` (etcd's range_end)."""
    if not prefix:
        return "\0"
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class PutIfAbsentFromCAS:
    """``put_if_absent`` for a backend that has ``compare_and_put`` (expected revision 0 = absent)."""

    def put_if_absent(
        self, key: str, value: str, *, lease: int = 0, timeout: float | None = None, guard: Guard | None = None
    ) -> tuple[bool, KeyValue]:
        won, kv = self.compare_and_put(  # type: ignore[attr-defined]
            key, value, expected_revision=0, lease=lease, timeout=timeout, guard=guard
        )
        if kv is None:  # created then deleted (e.g. lease revoked) before we looked
            kv = KeyValue(key, value, 0, 0, 0, lease)
        return won, kv


def wait_riding_out(store: Store, prefix: str, after_revision: int, timeout: float, until: float) -> Change:
    """``store.wait_for_change`` for a poll loop that has a deadline of its own (``until``, a
    ``time.monotonic()`` value): a store that does not answer within the short ``timeout`` (an etcd
    restart) counts as no change, until ``until``; then ``StoreUnavailableError`` as before."""
    import time

    try:
        return store.wait_for_change(prefix, after_revision, timeout)
    except StoreUnavailableError:
        if time.monotonic() >= until:
            raise
        return Change((), after_revision)
