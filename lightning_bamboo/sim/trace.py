"""Spot-instance traces in Bamboo's CSV format: ``milliseconds,add|remove,nodeNAME`` per line."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_bamboo.errors import BambooConfigError

FORMAT = "milliseconds,add|remove,nodeNAME (e.g. '60000,remove,node3')"
KINDS = ("add", "remove")


class TraceError(BambooConfigError):
    """A trace file or a trace breaks the format or its rules."""


@dataclass(frozen=True)
class TraceEvent:
    """One membership change: node ``node`` is added or removed at ``ms`` milliseconds."""

    ms: int
    kind: str  # "add" | "remove"
    node: str
    notice_seconds: float = 0.0  # warning before a removal (not stored in the CSV format)

    def __post_init__(self) -> None:
        if not isinstance(self.ms, int) or self.ms < 0:
            raise TraceError(f"event time must be a whole number of milliseconds >= 0 (got {self.ms!r})")
        if self.kind not in KINDS:
            raise TraceError(f"event kind must be one of {KINDS} (got {self.kind!r})")
        if not self.node or any(c in self.node for c in ", \t\r\n"):
            raise TraceError(f"node name must be non-empty without commas or spaces (got {self.node!r})")
        if self.notice_seconds < 0 or (self.notice_seconds and self.kind != "remove"):
            raise TraceError(
                f"notice_seconds must be >= 0 and only on removals (got {self.notice_seconds} on {self.kind})"
            )

    @property
    def seconds(self) -> float:
        return self.ms / 1000.0


@dataclass(frozen=True)
class Trace:
    """An ordered list of membership changes, checked: a node is added before it is removed."""

    events: tuple[TraceEvent, ...]
    source: str = "<memory>"

    def __post_init__(self) -> None:
        live: set[str] = set()
        seen: set[str] = set()
        last = 0
        for i, e in enumerate(self.events):
            where = f"{self.source}: event {i + 1} ({e.ms},{e.kind},{e.node})"
            if e.ms < last:
                raise TraceError(
                    f"{where}: times must not decrease (previous event at {last} ms); sort the trace"
                )
            last = e.ms
            if e.kind == "add":
                if e.node in seen:
                    raise TraceError(
                        f"{where}: node {e.node!r} was already added; every node is added once "
                        "(a replacement needs a new name)"
                    )
                seen.add(e.node)
                live.add(e.node)
            else:
                if e.node not in live:
                    raise TraceError(f"{where}: node {e.node!r} is removed but is not live; add it first")
                live.discard(e.node)
        if not seen:
            raise TraceError(
                f"{self.source}: the trace has no nodes (no 'add' event); a trace needs lines like '0,add,node1'"
            )

    @property
    def duration_seconds(self) -> float:
        return self.events[-1].seconds

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node name, in the order of its first addition."""
        return tuple(e.node for e in self.events if e.kind == "add")

    @property
    def removals(self) -> int:
        return sum(e.kind == "remove" for e in self.events)

    @property
    def peak_nodes(self) -> int:
        return max(n for _, n in self.node_counts())

    def node_counts(self) -> list[tuple[float, int]]:
        """``(seconds, live nodes)`` after each distinct event time."""
        out: list[tuple[float, int]] = []
        live = 0
        for e in self.events:
            live += 1 if e.kind == "add" else -1
            if out and out[-1][0] == e.seconds:
                out[-1] = (e.seconds, live)
            else:
                out.append((e.seconds, live))
        return out

    def live_at(self, seconds: float) -> frozenset[str]:
        """Nodes live just after every event at or before ``seconds``."""
        live: set[str] = set()
        for e in self.events:
            if e.seconds > seconds:
                break
            (live.add if e.kind == "add" else live.discard)(e.node)
        return frozenset(live)


def parse_trace(lines: Iterable[str], source: str = "<memory>") -> Trace:
    """Parse trace lines; blank lines and ``#`` comments are skipped."""
    events = []
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        fields = [f.strip() for f in text.split(",")]
        problem = None
        if len(fields) != 3:
            problem = f"{len(fields)} comma-separated fields instead of 3"
        elif not fields[0].isdigit():
            problem = f"time {fields[0]!r} is not a whole number of milliseconds >= 0"
        elif fields[1] not in KINDS:
            problem = f"kind {fields[1]!r} is not 'add' or 'remove'"
        elif not fields[2] or any(c in fields[2] for c in " \t"):
            problem = f"node name {fields[2]!r} is empty or has spaces"
        if problem:
            raise TraceError(f"{source}, line {number}: {text!r}: {problem}; expected {FORMAT}")
        events.append(TraceEvent(int(fields[0]), fields[1], fields[2]))
    if not events:
        raise TraceError(f"{source}: the trace has no nodes (no events at all); expected lines like {FORMAT}")
    return Trace(tuple(events), source)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file; errors name the file, the line, its text and the expected format."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(
            f"cannot read trace {str(p)!r}: {exc.strerror or exc}; pass an existing CSV file"
        ) from exc
    return parse_trace(text.splitlines(), str(p))


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` in the CSV format (notices are not part of the format and are dropped)."""
    Path(path).write_text("".join(f"{e.ms},{e.kind},{e.node}\n" for e in trace.events), encoding="utf-8")


def bundled_trace(name: str = "p3") -> Path:
    """Path of a bundled AWS trace: ``"p3"`` or ``"g4dn"`` (MIT, from Bamboo; see data/LICENSE.bamboo)."""
    files = {"p3": "aws-p3-trace.csv", "g4dn": "aws-g4dn-trace.csv"}
    if name not in files:
        raise TraceError(f"unknown bundled trace {name!r}; use one of {sorted(files)}")
    return Path(__file__).resolve().parent.parent / "data" / files[name]


def scale_trace(trace: Trace, nodes: int) -> Trace:
    """Replicate nodes so that the trace's peak becomes about ``nodes`` (copies share add/remove times).

    Node ``i`` (in order of addition) gets ``floor((i+1)*f) - floor(i*f)`` copies with
    ``f = nodes / peak``, so every event keeps its time and the node count scales by ``f``.
    """
    if nodes < 1:
        raise TraceError(f"the scaled cluster needs >= 1 node (got {nodes}); pass a positive node count")
    factor = nodes / trace.peak_nodes
    copies: dict[str, Sequence[str]] = {}
    for i, name in enumerate(trace.nodes):
        k = int((i + 1) * factor + 1e-9) - int(i * factor + 1e-9)
        copies[name] = [name] + [f"{name}x{j}" for j in range(1, k)] if k else []
    events = tuple(
        TraceEvent(e.ms, e.kind, c, e.notice_seconds) for e in trace.events for c in copies[e.node]
    )
    return Trace(events, f"{trace.source} (scaled x{factor:.3g})")


def slice_trace(trace: Trace, start_seconds: float, end_seconds: float) -> Trace:
    """The part of ``trace`` in ``(start, end]``, shifted to start at 0.

    Nodes live just after ``start`` are added at 0 (in their order of addition); events after
    ``start`` and up to ``end`` keep their order and move by ``-start``. Nodes still live at ``end``
    get no removal. An event at exactly ``start`` belongs to the state at 0.
    """
    if not 0 <= start_seconds < end_seconds:
        raise TraceError(
            f"a trace slice needs 0 <= start < end (got start {start_seconds} s, end {end_seconds} s); "
            f"the trace {trace.source!r} runs to {trace.duration_seconds} s"
        )
    start_ms, end_ms = round(start_seconds * 1000), round(end_seconds * 1000)
    live = trace.live_at(start_ms / 1000.0)
    events = [TraceEvent(0, "add", n) for n in trace.nodes if n in live]
    events += [
        TraceEvent(e.ms - start_ms, e.kind, e.node, e.notice_seconds)
        for e in trace.events
        if start_ms < e.ms <= end_ms
    ]
    if not any(e.kind == "add" for e in events):
        raise TraceError(
            f"the slice {start_seconds}-{end_seconds} s of {trace.source!r} has no nodes; pick a window with nodes live"
        )
    return Trace(tuple(events), f"{trace.source} [{start_seconds:g}-{end_seconds:g} s]")
