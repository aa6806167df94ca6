"""The time model of a schedule: ``Costs`` of each action, in slots."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_bamboo.schedule.action import Action, Kind, ScheduleError


@dataclass(frozen=True)
class Costs:
    """Time of each action in slots; RF costs ``forward``, RB ``backward``; one message costs ``send``; the
    replica's update ``U`` costs ``update``."""

    forward: float = 1
    backward: float = 2
    load: float = 0
    send: float = 0
    sync: float = 0
    reduce: float = 0
    optimizer: float = 0
    update: float = 0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "load", "send", "sync", "reduce", "optimizer", "update"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ScheduleError(f"Costs.{name} must be a number >= 0, got {value!r}")
        if self.forward <= 0:
            raise ScheduleError(f"Costs.forward must be > 0 (it sizes the RF slots), got {self.forward}")

    def of(self, action: Action) -> float:
        kind = action.kind
        if kind in (Kind.FORWARD, Kind.REDUNDANT_FORWARD):
            return self.forward
        if kind in (Kind.BACKWARD, Kind.REDUNDANT_BACKWARD):
            return self.backward
        if kind is Kind.LOAD:
            return self.load
        if kind in (Kind.SEND_SYNC, Kind.RECV_SYNC):
            return self.sync
        if action.is_comm:
            return self.send
        if kind is Kind.OPTIMIZER:
            return self.optimizer
        if kind is Kind.REPLICA_UPDATE:
            return self.update
        return self.reduce
