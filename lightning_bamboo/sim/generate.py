"""Synthetic spot traces for what-if studies, from a small documented stochastic model.

The model (:class:`SpotModel`):

* ``nodes`` nodes start at time 0 (requested capacity).
* Every node lives for a random time drawn from a Weibull distribution with mean
  ``1 / preemption_rate`` hours and shape ``lifetime_shape`` (1: exponential, i.e. memoryless
  preemptions at a constant rate; < 1: many short lives and a few long ones; > 1: wear-out).
* Preemptions are correlated: each one takes ``burst - 1`` more live nodes with it at the same
  instant with probability ``burst_probability`` (capacity reclaimed in bulk, as in the AWS traces).
* A removal comes with a notice (``notice_seconds``) with probability ``notice_fraction``.
* Every removed node is replaced by a new one after an exponential delay of mean
  ``replacement_delay_seconds`` (the cluster asks for its capacity back), keeping at most ``nodes``.
* The trace ends after ``hours``.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.sim.trace import Trace, TraceEvent


@dataclass(frozen=True)
class SpotModel:
    """Parameters of the synthetic trace; see the module docstring for the model."""

    nodes: int = 48
    hours: float = 12.0
    preemption_rate: float = 0.3  # per node-hour (mean lifetime 1/rate hours)
    lifetime_shape: float = 1.0
    burst: int = 1
    burst_probability: float = 0.0
    notice_fraction: float = 0.0
    notice_seconds: float = 30.0
    replacement_delay_seconds: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.nodes >= 1, "nodes >= 1"),
            (self.hours > 0, "hours > 0"),
            (self.preemption_rate > 0, "preemption_rate > 0 (per node-hour)"),
            (self.lifetime_shape > 0, "lifetime_shape > 0"),
            (self.burst >= 1, "burst >= 1"),
            (0 <= self.burst_probability <= 1, "0 <= burst_probability <= 1"),
            (0 <= self.notice_fraction <= 1, "0 <= notice_fraction <= 1"),
            (self.notice_seconds >= 0, "notice_seconds >= 0"),
            (self.replacement_delay_seconds >= 0, "replacement_delay_seconds >= 0"),
        ]
        for ok, rule in checks:
            if not ok:
                raise BambooConfigError(f"spot model needs {rule} (got {self!r}); fix that field")

    def lifetime_seconds(self, rng: random.Random) -> float:
        mean = 3600.0 / self.preemption_rate
        scale = mean / math.gamma(1.0 + 1.0 / self.lifetime_shape)
        return rng.weibullvariate(scale, self.lifetime_shape)


def generate_trace(model: SpotModel) -> Trace:
    """A trace drawn from ``model`` (same seed, same trace)."""
    rng = random.Random(model.seed)
    end_ms = int(model.hours * 3_600_000)
    events: list[TraceEvent] = []
    queue: list[tuple[int, int, str, str]] = []  # (ms, seq, kind, node)
    live: set[str] = set()
    counter = 0
    seq = 0

    def add(ms: int) -> None:
        nonlocal counter, seq
        counter += 1
        name = f"node{counter}"
        live.add(name)
        events.append(TraceEvent(ms, "add", name))
        death = ms + max(1, int(model.lifetime_seconds(rng) * 1000))
        heapq.heappush(queue, (death, seq, "remove", name))
        seq += 1

    def replace_later(ms: int) -> None:
        nonlocal seq
        heapq.heappush(
            queue, (ms + int(rng.expovariate(1.0) * model.replacement_delay_seconds * 1000), seq, "add", "")
        )
        seq += 1

    for _ in range(model.nodes):
        add(0)
    while queue and queue[0][0] <= end_ms:
        ms, _, kind, node = heapq.heappop(queue)
        if kind == "add":
            if len(live) < model.nodes:
                add(ms)
            continue
        if node not in live:
            continue  # already taken by a burst
        victims = [node]
        if model.burst > 1 and rng.random() < model.burst_probability:
            others = sorted(live - {node})
            victims += rng.sample(others, min(model.burst - 1, len(others)))
        for victim in victims:
            notice = model.notice_seconds if rng.random() < model.notice_fraction else 0.0
            live.discard(victim)
            events.append(TraceEvent(ms, "remove", victim, notice))
            replace_later(ms)
    return Trace(tuple(events), f"generated({model})")
