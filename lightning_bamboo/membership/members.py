"""A job's membership as read from the store (``nodes/``, ``lost/``, ``leaving/``), and which records count.

A record counts only if it is one the job's own nodes write (``lease.Registry``): JSON with the fields of its
kind, named by its own key; a registration on a lease (a node registers on the lease it keeps alive) that names that
lease and shares it with no earlier registration; a leave notice on the lease of the node it names. Anything else
(a node that never joined, a lease that is not its own, a record that is not one) is ignored, with one log line per
record: the store may be written by others than the job (see ``docs/security.md``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from lightning_bamboo.membership.keys import job_prefix
from lightning_bamboo.membership.protocol import KeyValue, Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeInfo:
    """What a node registers under ``nodes/<node_id>``; ``incarnation`` differs every time a process joins;
    ``lease``: the lease the registration is on (the one the node keeps alive)."""

    node_id: str
    incarnation: str
    address: str = ""
    host: str = ""
    pid: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    revision: int = 0  # the store revision at which this incarnation registered (filled in on read)
    lease: int = 0


@dataclass(frozen=True)
class LossNotice:
    """``lost/<node_id>``: someone saw ``node_id`` (that incarnation) fail; written once, by the first reporter."""

    node_id: str
    incarnation: str
    reporter: str
    reason: str
    revision: int = 0


@dataclass(frozen=True)
class LeaveNotice:
    """``leaving/<node_id>``: the node itself got a preemption notice and will be gone by ``deadline`` (unix s)."""

    node_id: str
    incarnation: str
    deadline: float
    reason: str = "preemption notice"
    revision: int = 0


@dataclass(frozen=True)
class Membership:
    """The job's membership as of store ``revision``.

    ``nodes``: registered incarnations whose lease is alive. ``lost``: loss notices (they stay
    until ``Registry.clear_loss``). ``leaving``: preemption notices of still-registered nodes.
    A node is *live* when registered and no loss notice names its current incarnation.
    """

    revision: int
    nodes: Mapping[str, NodeInfo]
    lost: Mapping[str, LossNotice]
    leaving: Mapping[str, LeaveNotice]

    @property
    def live(self) -> tuple[str, ...]:
        """Sorted ids of live nodes."""
        return tuple(
            sorted(
                n
                for n, info in self.nodes.items()
                if not (n in self.lost and self.lost[n].incarnation == info.incarnation)
            )
        )

    def gone_since(self, before: Membership) -> tuple[str, ...]:
        """Nodes live in ``before`` that are not live now, or that came back as another incarnation."""
        return tuple(
            sorted(
                n
                for n in before.live
                if n not in self.live or self.nodes[n].incarnation != before.nodes[n].incarnation
            )
        )

    def joined_since(self, before: Membership) -> tuple[str, ...]:
        """Nodes live now that were not live (as this incarnation) in ``before``."""
        return tuple(
            sorted(
                n
                for n in self.live
                if n not in before.live or self.nodes[n].incarnation != before.nodes[n].incarnation
            )
        )

    @classmethod
    def from_snapshot(cls, job: str, snap: Snapshot) -> Membership:
        """The membership the records under ``job``'s prefix make; a record that does not count is ignored (one
        log line for it)."""
        base = job_prefix(job)
        nodes: dict[str, NodeInfo] = {}
        lost: dict[str, LossNotice] = {}
        leaving: dict[str, tuple[LeaveNotice, KeyValue]] = {}
        holders: dict[int, str] = {}  # lease -> the node registered on it first
        for kv in sorted(snap.kvs, key=lambda kv: kv.create_revision):
            kind, _, name = kv.key[len(base):].partition("/")
            if kind not in _KINDS or not name or "/" in name:
                continue  # barriers and other sub-trees
            record = _record(kind, name, kv)
            if isinstance(record, NodeInfo):
                if not kv.lease:
                    _ignore(kv, "a registration on no lease: that node never joined (a node registers on its lease)")
                elif record.lease != kv.lease:
                    _ignore(kv, f"a registration that names lease {record.lease} but is on lease {kv.lease}")
                elif kv.lease in holders:
                    _ignore(kv, f"a registration on lease {kv.lease}, which node {holders[kv.lease]} registered on: not "
                                "its own")
                else:
                    holders[kv.lease] = name
                    nodes[name] = record
            elif isinstance(record, LossNotice):
                lost[name] = record
            elif isinstance(record, LeaveNotice):
                leaving[name] = (record, kv)
        kept: dict[str, LeaveNotice] = {}
        for name, (notice, kv) in leaving.items():
            if name not in nodes or nodes[name].incarnation != notice.incarnation:
                continue  # the notice of an incarnation that is gone (it vanishes with that lease)
            if kv.lease != nodes[name].lease:
                _ignore(kv, f"a leave notice on lease {kv.lease}, not on the lease of node {name} ({nodes[name].lease})")
            else:
                kept[name] = notice
        return cls(snap.revision, nodes, lost, kept)


#: the record each kind of key holds, and the key's revision it takes
_KINDS: dict[str, tuple[type, str]] = {"nodes": (NodeInfo, "create_revision"), "lost": (LossNotice, "mod_revision"),
                                       "leaving": (LeaveNotice, "mod_revision")}
#: what a field of a record must be (the others: text)
_NUMBERS: dict[str, type | tuple[type, ...]] = {"pid": int, "lease": int, "deadline": (int, float)}


def _record(kind: str, name: str, kv: KeyValue) -> Any:
    """The record ``kv`` holds, or None (logged) when it is not one the job writes."""
    cls, revision = _KINDS[kind]
    try:
        data = json.loads(kv.value)
    except (ValueError, RecursionError):
        return _ignore(kv, "not JSON")
    if not isinstance(data, dict):
        return _ignore(kv, f"a JSON {type(data).__name__}, not a record")
    names = {f.name for f in fields(cls)} - {"revision"}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    if set(data) - names or required - set(data):
        return _ignore(kv, f"fields {sorted(data)[:8]}, not those of a {cls.__name__} ({sorted(names)})")
    for key, value in data.items():
        kind_of: type | tuple[type, ...] = _NUMBERS.get(key, dict if key == "meta" else str)
        if not isinstance(value, kind_of) or isinstance(value, bool):
            return _ignore(kv, f"its {key} is a {type(value).__name__}")
    if data["node_id"] != name:
        return _ignore(kv, f"it names node {str(data['node_id'])[:40]!r}, not {name!r}")
    return cls(**data, revision=getattr(kv, revision))


#: records already reported (key, revision): each forged record is logged once, not at every read of the membership
_REPORTED: dict[tuple[str, int], None] = {}


def _ignore(kv: KeyValue, why: str) -> None:
    if (kv.key, kv.mod_revision) not in _REPORTED:
        if len(_REPORTED) >= 1024:
            _REPORTED.pop(next(iter(_REPORTED)))
        _REPORTED[(kv.key, kv.mod_revision)] = None
        log.warning("membership: ignored %s (revision %d): %s; only the job's own nodes write these records, so "
                    "something else writes under the job's prefix (docs/security.md)", kv.key[:200],
                    kv.mod_revision, why)
    return None
