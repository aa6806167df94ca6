"""What happens to the demo's spot cluster, as data: preemptions at steps, or a trace replayed in time (pure)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bamboo.errors import BambooConfigError

_PREEMPT = re.compile(r"^(?P<node>[A-Za-z0-9_-]+)@(?P<step>\d+)(?::(?P<notice>\d+(?:\.\d+)?))?$")


@dataclass(frozen=True)
class ClusterEvent:
    """``kind`` is "preempt" (the node is killed) or "join" (a new node starts).

    A preemption happens when the node has finished ``step`` steps (``at_step``) or at
    ``at_seconds`` after the start (a trace); with ``notice`` seconds it gets SIGTERM first and
    SIGKILL after the notice, else SIGKILL at once. A ``frozen`` node is stopped instead (SIGSTOP,
    never continued): a machine that hangs without closing its connections.
    """

    kind: str
    node: str
    at_step: int | None = None
    at_seconds: float | None = None
    notice: float | None = None
    frozen: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("preempt", "join"):
            raise BambooConfigError(f"a cluster event is 'preempt' or 'join' (got {self.kind!r})")
        if (self.at_step is None) == (self.at_seconds is None):
            raise BambooConfigError(f"a cluster event happens at a step or at a time, not both or neither ({self})")


def parse_preempt(spec: str, nodes: Sequence[str]) -> list[ClusterEvent]:
    """``node2@7,node3@12:5`` -> preemptions; ``:5`` gives 5 s of notice (SIGTERM, then SIGKILL)."""
    events = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        match = _PREEMPT.match(item)
        if not match:
            raise BambooConfigError(
                f"--preempt entries look like NODE@STEP or NODE@STEP:NOTICE_SECONDS, e.g. node2@7 or node1@5:3 "
                f"(got {item!r})"
            )
        node = match["node"]
        if node not in nodes:
            raise BambooConfigError(
                f"--preempt names {node!r}, which is not a node of this cluster (nodes: {', '.join(nodes)}); "
                f"name one of them or start more with --nodes"
            )
        step = int(match["step"])
        if step < 1:
            raise BambooConfigError(f"--preempt {item!r}: the step must be at least 1 (a node must have trained)")
        notice = float(match["notice"]) if match["notice"] else None
        events.append(ClusterEvent("preempt", node, at_step=step, notice=notice))
    return events


def parse_join(spec: str, nodes: Sequence[str]) -> list[ClusterEvent]:
    """``spare1@9,spare2@15`` -> new nodes started when the job has finished that many steps."""
    events: list[ClusterEvent] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        match = _PREEMPT.match(item)
        if not match or match["notice"]:
            raise BambooConfigError(f"--join entries look like NAME@STEP, e.g. spare1@9 (got {item!r})")
        node, step = match["node"], int(match["step"])
        if node in nodes or any(e.node == node for e in events):
            raise BambooConfigError(
                f"--join {item!r}: {node!r} is already a node of this cluster (nodes: {', '.join(nodes)}); "
                "give the new node a new name, e.g. spare1"
            )
        if step < 1:
            raise BambooConfigError(f"--join {item!r}: the step must be at least 1")
        events.append(ClusterEvent("join", node, at_step=step))
    return events


def events_from_trace(trace, nodes: Sequence[str], time_scale: float) -> list[ClusterEvent]:
    """Replay a Bamboo trace: its first ``len(nodes)`` nodes are ours; later adds start new nodes.

    Trace times are divided by ``time_scale`` (600: ten minutes of trace per second).
    """
    if time_scale <= 0:
        raise BambooConfigError(f"--time-scale must be positive (got {time_scale})")
    events_in = list(trace.events)
    start_ms = min((e.ms for e in events_in if e.kind == "add"), default=0)
    mapping: dict[str, str] = {}
    joined = 0
    out: list[ClusterEvent] = []
    initial = iter(nodes)
    for event in events_in:
        seconds = (event.ms - start_ms) / 1000.0 / time_scale
        if event.kind == "add":
            node = next(initial, None)
            if node is not None and seconds == 0:
                mapping[event.node] = node
            else:
                joined += 1
                mapping[event.node] = f"spare{joined}"
                out.append(ClusterEvent("join", mapping[event.node], at_seconds=seconds))
        elif event.node in mapping:
            notice = event.notice_seconds or None
            out.append(ClusterEvent("preempt", mapping.pop(event.node), at_seconds=seconds, notice=notice))
    return out


def parse_freeze(spec: str, nodes: Sequence[str]) -> list[ClusterEvent]:
    """``node2@7,node1@12`` -> nodes stopped (SIGSTOP, never continued) when they have finished that many steps."""
    events = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        match = _PREEMPT.match(item)
        if not match or match["notice"]:
            raise BambooConfigError(f"--freeze entries look like NODE@STEP, e.g. node2@7 (got {item!r})")
        events += [ClusterEvent("preempt", e.node, at_step=e.at_step, frozen=True) for e in parse_preempt(item, nodes)]
    return events
