"""Typed records the session keeps in the store: a reconfiguration (which admits standby nodes), as frozen data."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

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
