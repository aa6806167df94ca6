"""Event-driven replay of a trace under each policy."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from lightning_bamboo.sim.designs import BambooInPipeline
from lightning_bamboo.sim.ledger import Ledger
from lightning_bamboo.sim.model import young_interval
from lightning_bamboo.sim.params import ParamError, SimParams, describe_inputs
from lightning_bamboo.sim.policies import (
    Bamboo,
    BambooAuto,
    CheckpointOracle,
    CheckpointRestart,
    ElasticRestart,
    OnDemand,
    Policy,
)
from lightning_bamboo.sim.report import PolicyResult, SimReport
from lightning_bamboo.sim.successors import Parcae, Recycle
from lightning_bamboo.sim.trace import Trace, TraceEvent, scale_trace

#: every policy the simulator replays, by name
POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (OnDemand, CheckpointRestart, CheckpointOracle, ElasticRestart, Bamboo, BambooAuto,
                        BambooInPipeline, Recycle, Parcae)
}


def prepare(trace: Trace, params: SimParams) -> tuple[Trace, float]:
    """The trace actually replayed (scaled when ``params.nodes``) and the end time in seconds."""
    if params.nodes:
        trace = scale_trace(trace, params.nodes)
    end = params.hours * 3600.0 if params.hours else trace.duration_seconds
    if end <= 0:
        raise ParamError(
            f"nothing to simulate: the trace {trace.source!r} ends at {trace.duration_seconds} s and hours=0; "
            "pass --param hours=H for how long to run"
        )
    return trace, end


def on_demand_nodes(trace: Trace, params: SimParams) -> int:
    """``params.on_demand_nodes`` or the trace's peak rounded down to whole pipelines."""
    if params.on_demand_nodes:
        return params.on_demand_nodes
    peak = trace.peak_nodes
    return max(peak // params.stages * params.stages, min(peak, params.stages))


def checkpoint_interval(trace: Trace, end: float, params: SimParams) -> float:
    """The oracle's interval: the parameter, or Young's optimum for the whole trace's removals (which
    no running job knows: ``checkpoint_oracle`` only)."""
    if params.checkpoint_interval_seconds:
        return params.checkpoint_interval_seconds
    if params.checkpoint_save_seconds <= 0:
        return params.step_seconds  # free checkpoints: save after every step
    removals = sum(e.kind == "remove" and e.seconds <= end for e in trace.events)
    return young_interval(params.checkpoint_save_seconds, end / removals if removals else float("inf"))


def run_policy(name: str, trace: Trace, params: SimParams, end: float) -> tuple[PolicyResult, Policy]:
    """Replay ``trace`` until ``end`` seconds under policy ``name``."""
    if name not in POLICIES:
        raise ParamError(f"unknown policy {name!r}; use one of {sorted(POLICIES)}")
    if name == "on_demand":
        count = on_demand_nodes(trace, params)
        events: Iterable[TraceEvent] = [TraceEvent(0, "add", f"od{i + 1}") for i in range(count)]
        ledger = Ledger(params.on_demand_price)
    elif name == "checkpoint_oracle":
        events = trace.events
        ledger = Ledger(
            params.spot_price, checkpoint_interval(trace, end, params), params.checkpoint_save_seconds
        )
    elif name in ("checkpoint", "elastic"):
        events = trace.events
        ledger = Ledger(params.spot_price, params.checkpoint_interval_seconds, params.checkpoint_save_seconds)
    else:
        events = trace.events
        ledger = Ledger(params.spot_price, params.bamboo_checkpoint_interval_seconds, params.snapshot_seconds)
    policy = POLICIES[name](params, ledger)
    queue: list[tuple[float, int, str, TraceEvent]] = []
    for seq, e in enumerate(events):
        queue.append((e.seconds, seq, e.kind, e))
    heapq.heapify(queue)
    seq = len(queue)
    alive: set[str] = set()
    while queue and queue[0][0] <= end:
        now = queue[0][0]
        ledger.advance(now)
        while queue and queue[0][0] == now:
            _, _, kind, e = heapq.heappop(queue)
            if kind == "add":
                alive.add(e.node)
                ledger.nodes = len(alive)
                policy.on_add(e)
                heapq.heappush(queue, (now + params.node_ready_seconds, seq, "ready", e))
                seq += 1
            elif kind == "remove":
                alive.discard(e.node)
                ledger.nodes = len(alive)
                policy.on_remove(e)
                for node in policy.restarting:  # released alive: a standby process again after a restart
                    heapq.heappush(queue, (now + params.rejoin_seconds, seq, "ready", TraceEvent(e.ms, "add", node)))
                    seq += 1
                policy.restarting.clear()
            elif e.node in alive:  # ready, unless removed while starting
                policy.on_ready(e.node)
        policy.settle()
        ledger.mark()
    ledger.advance(end)
    return PolicyResult.from_ledger(name, ledger, end), policy


def simulate(
    trace: Trace,
    params: SimParams | None = None,
    policies: Iterable[str] = ("on_demand", "checkpoint", "bamboo"),
    sources: Mapping[str, str] | None = None,
) -> SimReport:
    """Replay ``trace`` under every policy and compare them.

    ``sources``: where the caller's values come from (``"kind: text"``, e.g. a scenario's
    citations); the report's ``inputs`` gives every input's value, kind and source.
    """
    params = params or SimParams()
    replayed, end = prepare(trace, params)
    results = {name: run_policy(name, replayed, params, end)[0] for name in policies}
    return SimReport(results, params, trace_summary(replayed, end), describe_inputs(params, sources))


def trace_summary(trace: Trace, end: float) -> dict[str, object]:
    return {
        "source": trace.source,
        "hours": end / 3600.0,
        "nodes": len(trace.nodes),
        "peak_nodes": trace.peak_nodes,
        "removals": sum(e.kind == "remove" and e.seconds <= end for e in trace.events),
    }
