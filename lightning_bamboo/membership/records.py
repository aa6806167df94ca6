"""Typed records the session keeps in the store, as frozen data: a reconfiguration (which admits standby nodes), a
failover (the survivors of a loss took the lost layers over from their replicas) and a restart (a fatal loss: the
survivors started again from a checkpoint in their running processes)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from lightning_bamboo.errors import BambooConfigError


@dataclass(frozen=True)
class Reconfiguration:
    """A change of layout between two steps, with no loss: the record ``admit/<generation>`` holds when it admits
    standby nodes (they join from it), and ``reconfigurations/<generation>`` for reports (with ``seconds``).

    ``order``/``parts``/``pipelines``: the new layout (nodes by rank, layer boundaries, data-parallel pipelines);
    ``old_*``: the one it leaves. ``sender``: the first node of the new order that ran before it (it sends a
    joining node the training state). ``tag`` names the process group's rendezvous; ``step`` is the step it
    happens before. In the store: JSON of these fields, lists for the tuples (``to_json``/``from_json``).
    """

    generation: int
    order: tuple[str, ...]
    parts: tuple[int, ...]
    old_order: tuple[str, ...]
    old_parts: tuple[int, ...]
    sender: str
    tag: str
    step: int
    reason: str = ""
    pipelines: int = 1
    old_pipelines: int = 1
    #: how long it took (set on the copy recorded for reports)
    seconds: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.sender not in self.order or self.sender not in self.old_order:
            raise BambooConfigError(f"a reconfiguration's sender must run before and after it (sender "
                                    f"{self.sender!r}, old order {list(self.old_order)}, new order {list(self.order)})")
        for name, nodes, pipelines in (("order", self.order, self.pipelines),
                                       ("old_order", self.old_order, self.old_pipelines)):
            if pipelines < 1 or len(nodes) % pipelines:
                raise BambooConfigError(f"a reconfiguration's {name} of {len(nodes)} nodes does not split into "
                                        f"{pipelines} pipeline(s) of equal depth; give nodes = stages x pipelines")

    @property
    def joiners(self) -> tuple[str, ...]:
        """The nodes of the new order that did not run before it (standby nodes it admits)."""
        return tuple(n for n in self.order if n not in self.old_order)

    def to_json(self) -> str:
        record: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if self.seconds is None:
            del record["seconds"]
        return json.dumps(record)

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> Reconfiguration:
        """The record of ``text`` (JSON as ``to_json`` writes it, or its parsed dict)."""
        d = json.loads(text) if isinstance(text, str) else dict(text)
        return cls(
            generation=int(d["generation"]), order=tuple(d["order"]), parts=tuple(int(p) for p in d["parts"]),
            old_order=tuple(d["old_order"]), old_parts=tuple(int(p) for p in d["old_parts"]), sender=str(d["sender"]),
            tag=str(d["tag"]), step=int(d["step"]), reason=str(d.get("reason", "")),
            pipelines=int(d.get("pipelines", 1)), old_pipelines=int(d.get("old_pipelines", 1)),
            seconds=d.get("seconds"),
        )


def _strs(values: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


@dataclass(frozen=True)
class Failover:
    """A failover, as every survivor records it (``Session.failovers``) and the layout's first node puts it at
    ``failovers/<generation>`` (JSON of these fields, lists for the tuples).

    ``step``: the step in flight when the loss was found; ``committed``: whether it had counted everywhere (else it
    is ``redone``: run again in the new layout). ``lost``: the nodes gone; ``released``: the survivors that left the
    layout (the rest of a dropped pipeline, now standby). ``order``/``parts``/``pipelines``: the new layout;
    ``rows``: its pipelines' nodes; ``old_parts``/``old_pipelines``: the layout it left. ``seconds``: how long it took.
    """

    step: int
    lost: tuple[str, ...]
    committed: bool
    seconds: float
    redone: bool
    order: tuple[str, ...]
    parts: tuple[int, ...]
    pipelines: int
    released: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    old_parts: tuple[int, ...]
    old_pipelines: int

    restart: ClassVar[bool] = False

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON's types (lists for tuples): what the store and the demo's report hold."""
        return {"step": self.step, "lost": list(self.lost), "committed": self.committed, "seconds": self.seconds,
                "redone": self.redone, "order": list(self.order), "parts": list(self.parts),
                "pipelines": self.pipelines, "released": list(self.released), "rows": [list(r) for r in self.rows],
                "old_parts": list(self.old_parts), "old_pipelines": self.old_pipelines}

    def to_json(self) -> str:
        return json.dumps(self.as_dict())


@dataclass(frozen=True)
class Restart:
    """A restart after a fatal loss in the running processes (``runtime.restart``): the survivors ``order`` form
    ``stages`` x ``pipelines`` and load the last checkpoint. Kept with the failovers, in the same store keys; its
    JSON says ``"restart": true``. ``reason``: the fatal loss's message; ``step``: the step the loss ended;
    ``checkpoint``: what the job resumed from (None: the job's start, no checkpoint); ``from_step``: its step;
    ``seconds``: from the loss to the resumed stage, checkpoint loaded."""

    lost: tuple[str, ...]
    order: tuple[str, ...]
    stages: int
    pipelines: int
    seconds: float
    reason: str = ""
    step: int = 0
    checkpoint: str | None = None
    from_step: int = 0

    restart: ClassVar[bool] = True

    def as_dict(self) -> dict[str, Any]:
        return {"restart": True, "lost": list(self.lost), "order": list(self.order), "stages": self.stages,
                "pipelines": self.pipelines, "seconds": self.seconds, "reason": self.reason, "step": self.step,
                "checkpoint": self.checkpoint, "from_step": self.from_step}

    def to_json(self) -> str:
        return json.dumps(self.as_dict())


def failover_record(text: str | dict[str, Any]) -> Failover | Restart:
    """The record of ``text`` (JSON as ``Failover.to_json``/``Restart.to_json`` write it, or its parsed dict)."""
    d = json.loads(text) if isinstance(text, str) else dict(text)
    if d.get("restart"):
        checkpoint = d.get("checkpoint")
        return Restart(lost=_strs(d["lost"]), order=_strs(d["order"]), stages=int(d["stages"]),
                       pipelines=int(d["pipelines"]), seconds=float(d["seconds"]), reason=str(d.get("reason", "")),
                       step=int(d.get("step", 0)), checkpoint=None if checkpoint is None else str(checkpoint),
                       from_step=int(d.get("from_step", 0)))
    return Failover(
        step=int(d["step"]), lost=_strs(d["lost"]), committed=bool(d["committed"]), seconds=float(d["seconds"]),
        redone=bool(d["redone"]), order=_strs(d["order"]), parts=tuple(int(p) for p in d["parts"]),
        pipelines=int(d["pipelines"]), released=_strs(d.get("released", ())),
        rows=tuple(_strs(r) for r in d.get("rows", ())), old_parts=tuple(int(p) for p in d["old_parts"]),
        old_pipelines=int(d.get("old_pipelines", 1)),
    )
