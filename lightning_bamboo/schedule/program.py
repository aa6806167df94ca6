"""``Schedule``: one training step of one pipeline, the actions of every rank step by step, and its table."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_bamboo.schedule.action import REDUNDANCY_MODES, Action, Kind, ScheduleError
from lightning_bamboo.schedule.placement import buffer_id

#: the actions of one rank at one step, in order
Tick = tuple[Action, ...]


@dataclass(frozen=True)
class Schedule:
    """One training step of one pipeline: ``programs[rank][step]`` is the tuple of actions of that step.

    Steps are DeepSpeed's: ``2 * (micro_batches + stages - 1)`` of them on every live rank, and the actions of
    step ``t`` on two neighbours are each other's partners (a barrier between steps cannot deadlock).
    Rank ``r`` is node ``r`` of the pipeline; ``layout[stage]`` is the rank that runs the stage;
    ``replicas[rank]`` is the stage whose replica the rank holds (None: none); ``dead`` is the failed rank of
    a failover step (its program is empty); ``reuse_rf`` the micro-batches of the dead stage whose RF the
    holder had finished before the failure (their forward is not recomputed and their backward is RB).
    """

    stages: int
    micro_batches: int
    redundancy: str
    programs: tuple[tuple[Tick, ...], ...]
    layout: tuple[int, ...]
    replicas: tuple[int | None, ...]
    dead: int | None = None
    reuse_rf: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        check_shape(self.stages, self.micro_batches, self.redundancy)
        p = self.stages
        for name, seq in (("programs", self.programs), ("replicas", self.replicas), ("layout", self.layout)):
            if len(seq) != p:
                raise ScheduleError(f"Schedule.{name} needs one entry per stage/rank ({p}), got {len(seq)}")
        if self.dead is not None and not 0 <= self.dead < p:
            raise ScheduleError(f"dead rank must be in [0, {p}), got {self.dead}")
        for stage, rank in enumerate(self.layout):
            if not 0 <= rank < p or rank == self.dead:
                raise ScheduleError(f"layout[{stage}] = {rank} is not a live rank in [0, {p}) (dead: {self.dead})")
        if self.dead is not None and self.programs[self.dead]:
            raise ScheduleError(f"dead rank {self.dead} must have an empty program")
        bad = sorted(k for k in self.reuse_rf if not 0 <= k < self.micro_batches)
        if bad:
            raise ScheduleError(f"reuse_rf micro-batches {bad} are outside [0, {self.micro_batches})")

    @property
    def mode(self) -> str:
        """``"off"``, ``"lazy"``, ``"eager"`` or ``"failover"``."""
        return "failover" if self.dead is not None else self.redundancy

    @property
    def num_steps(self) -> int:
        return max(len(program) for program in self.programs)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs (two on the rank that took over a dead successor)."""
        return tuple(s for s, r in enumerate(self.layout) if r == rank)

    def actions(self, rank: int) -> list[tuple[int, Action]]:
        """``rank``'s actions in execution order, each with its step."""
        return [(step, action) for step, tick in enumerate(self.programs[rank]) for action in tick]

    def buffer_id(self, action: Action) -> int | None:
        """The buffer DeepSpeed would use for ``action``: per stage for L/F/B/A/G (each stage of a merged
        rank keeps its own buffers), the micro-batch itself for RF/RB (kept until the step commits), None for
        rank-wide actions and sync."""
        if action.kind in (Kind.REDUNDANT_FORWARD, Kind.REDUNDANT_BACKWARD):
            return action.micro_batch
        if action.micro_batch is None or action.stage is None:
            return None
        return buffer_id(action.stage, action.micro_batch, self.stages, self.micro_batches)

    def redundant_forwards(self, rank: int, before_step: int | None = None) -> frozenset[int]:
        """Micro-batches whose RF ``rank`` has finished before ``before_step`` (all steps when None): pass it
        as ``reuse_rf`` of the failover step when ``rank``'s successor dies at that step."""
        return frozenset(a.micro_batch for step, a in self.actions(rank)
                         if a.kind is Kind.REDUNDANT_FORWARD and (before_step is None or step < before_step)
                         and a.micro_batch is not None)

    def __str__(self) -> str:
        return format_table(self)


def check_shape(stages: object, micro_batches: object, redundancy: object) -> None:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ScheduleError(f"stages must be an int >= 1, got {stages!r}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ScheduleError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if redundancy not in REDUNDANCY_MODES:
        raise ScheduleError(f"redundancy must be one of {REDUNDANCY_MODES}, got {redundancy!r}")
    if redundancy != "off" and stages < 2:
        raise ScheduleError(f"redundancy={redundancy!r} needs >= 2 stages (a replica of the successor), got "
                            f"stages={stages}; use redundancy='off' or more stages")


def format_table(schedule: Schedule, error_at: int | None = None) -> str:
    """Step x Rank table: one row per DeepSpeed step, one column per rank, a cell lists that step's actions
    in order; a dead rank's column is headed ``(dead)``; row ``error_at`` ends with ``<-- ERROR HERE``."""
    p, steps = schedule.stages, schedule.num_steps
    width = len(str(max(steps - 1, 0)))
    labels = [f"Step {str(t).zfill(width)}" for t in range(steps)]
    heads = [f"Rank {r}" + (" (dead)" if r == schedule.dead else "") for r in range(p)]
    cells = [[" ".join(map(str, prog[t])) if t < len(prog) else "" for prog in schedule.programs]
             for t in range(steps)]
    widths = [max([len(heads[r])] + [len(row[r]) for row in cells]) for r in range(p)]
    lead = len(labels[0]) + 2 if labels else 6
    lines = [(" " * lead + " | ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))).rstrip()]
    for t, (label, row) in enumerate(zip(labels, cells, strict=True)):
        line = (f"{label}: " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))).rstrip()
        if error_at == t:
            line += "  <-- ERROR HERE"
        lines.append(line)
    return "\n".join(lines) + "\n"
