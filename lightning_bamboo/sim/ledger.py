"""Time, progress and money of one simulated run: training, pauses, checkpoints and rollbacks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PAUSE_KINDS = ("failover", "reconfigure", "restart", "checkpoint")
RECOVERY_KINDS = ("failover", "reconfigure", "restart", "lost_work")


@dataclass(frozen=True)
class Point:
    """State just after ``seconds``: the rate training goes at (0 when paused or idle), totals so far."""

    seconds: float
    rate: float  # samples/s being made now
    samples: float  # useful progress (drops on a rollback)
    cost: float  # dollars spent so far
    nodes: int  # nodes billed now
    active: int  # nodes in the layout now


@dataclass
class Ledger:
    """Integrates progress and cost between events; pauses run back to back in the order given.

    ``checkpoint_interval``: seconds of training between checkpoints (0: none).
    ``checkpoint_pause``: training pause of a save; 0 makes checkpoints asynchronous (taken at once).
    ``interval_rule``: when given, the interval is ``interval_rule(now)``, asked again before every
    save (a policy that tunes its interval from what it has seen so far).
    """

    price: float  # $/node-hour
    checkpoint_interval: float = 0.0
    checkpoint_pause: float = 0.0
    t: float = 0.0
    samples: float = 0.0
    rate: float = 0.0  # samples/s while training (set by the policy)
    step_rate: float = 0.0  # optimizer steps/s while training (set by the policy)
    steps: float = 0.0
    nodes: int = 0
    active: int = 0
    cost: float = 0.0
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("training", "idle", "lost_work", *PAUSE_KINDS), 0.0)
    )
    recoveries: dict[str, int] = field(
        default_factory=lambda: {"redundant": 0, "checkpoint": 0, "restart": 0}
    )
    reconfigurations: int = 0
    preemptions: int = 0
    checkpoint_samples: float = 0.0
    checkpoint_steps: float = 0.0
    timeline: list[Point] = field(default_factory=list)
    interval_rule: Callable[[float], float] | None = None
    _pauses: list[list] = field(default_factory=list)  # [start, end, kind]
    _since_save: float = 0.0  # training seconds since the last save started
    _since_commit: float = 0.0  # training seconds not covered by the last committed checkpoint
    _pending: tuple[float, float] | None = None  # (samples, steps) of a save in progress

    def mark(self) -> None:
        rate = self.rate if not self._pauses or self._pauses[0][0] > self.t else 0.0
        point = Point(self.t, rate, self.samples, self.cost, self.nodes, self.active)
        if self.timeline and self.timeline[-1].seconds == self.t:
            self.timeline[-1] = point
        else:
            self.timeline.append(point)

    @property
    def paused_until(self) -> float:
        return self._pauses[-1][1] if self._pauses else self.t

    @property
    def restarting(self) -> bool:
        """A restart pause is under way (training has not resumed after it)."""
        return any(kind == "restart" and end > self.t for _, end, kind in self._pauses)

    def pause(self, kind: str, seconds: float, *, restart: bool = False) -> None:
        """Stop training for ``seconds`` after the pauses already queued; ``restart`` drops those first."""
        assert kind in PAUSE_KINDS, kind
        if restart:
            self._pauses.clear()
            self._pending = None
        if seconds > 0:
            start = self.paused_until
            self._pauses.append([start, start + seconds, kind])
        self.mark()

    def rollback(self) -> None:
        """Lose the progress since the last committed checkpoint (a save in progress is lost too)."""
        self.seconds["lost_work"] += self._since_commit
        self._since_commit = 0.0
        self._since_save = 0.0
        self._pending = None
        self.samples = self.checkpoint_samples
        self.steps = self.checkpoint_steps
        self.mark()

    def save(self, seconds: float) -> None:
        """Save the current progress now: training pauses ``seconds`` after the pauses queued, and the
        checkpoint counts once the save is done (a restart before then loses it)."""
        self._since_save = 0.0
        if seconds <= 0:
            self.commit_now()
            return
        self._pending = (self.samples, self.steps)
        self.pause("checkpoint", seconds)

    def commit_now(self) -> None:
        """Checkpoint the current progress at once (e.g. in a preemption's grace period)."""
        self.checkpoint_samples = self.samples
        self.checkpoint_steps = self.steps
        self._since_commit = 0.0

    def advance(self, until: float) -> None:
        """Run from ``t`` to ``until`` with the current rate, pauses and checkpoints."""
        if until < self.t:
            raise ValueError(f"time runs forward (now {self.t}, asked {until})")
        self.cost += self.nodes * self.price * (until - self.t) / 3600.0
        while self.t < until:
            if self._pauses:
                start, end, kind = self._pauses[0]
                stop = min(end, until)
                self.seconds[kind] += stop - self.t
                self.t = stop
                if stop >= end:
                    self._pauses.pop(0)
                    if kind == "checkpoint" and self._pending is not None:
                        (self.checkpoint_samples, self.checkpoint_steps), self._pending = self._pending, None
                        self._since_commit = 0.0
                self.mark()
                continue
            if self.rate <= 0:
                self.seconds["idle"] += until - self.t
                self.t = until
                continue
            span = until - self.t
            interval = self.interval_rule(self.t) if self.interval_rule else self.checkpoint_interval
            due = interval - self._since_save if interval > 0 else None
            if due is not None and due <= span + 1e-9:
                self._train(max(due, 0.0))
                self._since_save = 0.0
                if self.checkpoint_pause > 0:
                    self._pending = (self.samples, self.steps)
                    self.pause("checkpoint", self.checkpoint_pause)
                else:
                    self.commit_now()
                continue
            self._train(span)
        self.mark()

    def _train(self, dt: float) -> None:
        self.samples += self.rate * dt
        self.steps += self.step_rate * dt
        self.seconds["training"] += dt
        self._since_save += dt
        self._since_commit += dt
        self.t += dt
