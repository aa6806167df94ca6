"""The simulator's model of ``lightning-bamboo demo`` (demo scale), for validating the simulator.

The cluster policies of :mod:`lightning_bamboo.sim.policies` describe a cluster of many pipelines
with a fluid rate. The demo differs in ways that matter at 20-60 steps, so it gets its own replay:

* one pipeline of at most ``stages`` nodes; every other live node waits as standby;
* with replicas, a lost node's stage moves to its replica holder (the pipeline gets one node
  shorter, replicas are rebuilt around the new ring) and the step in flight is redone; at the start
  of the next step the demo's ``RebalanceCallback`` reconfigures (a ``reconfigure_seconds`` pause):
  standby nodes that are up take the pipeline back towards ``stages``, else the layers are evened
  out over the survivors; a node that joins is started at once if fewer than ``stages + 1``
  processes run (else when a place frees: standby processes share the demo's cores), is up
  ``join_seconds`` later and is admitted the same way at the next step start while the pipeline
  is shorter than ``stages``; each such start-up while the demo trains costs the training
  ``standby_start_seconds`` (a Python, torch and DeepSpeed start-up on the same cores); losses that
  :func:`lightning_bamboo.topology.failover.plan_failover` calls fatal (a node and its replica
  holder together, or the last node of a one-node pipeline) restart from the last checkpoint;
* without replicas (``--no-redundancy``) every loss of a running node restarts the job from the
  last checkpoint with the first ``stages`` live nodes, and so does a node joining while the
  pipeline is shorter than ``stages`` (scale-up by restart, as torchelastic and Varuna do);
* a node lost while a restart starts: the others start without it (``Session.start_without``,
  one stage fewer, no extra time) if enough are left (two with replicas, one without), else that
  generation waits ``startup_timeout_seconds``, fails and starts again;
* a checkpoint is saved after every ``checkpoint_every`` steps (a synchronous pause);
* step times are measured per pipeline depth (on 2 cores they follow the number of processes,
  not the 1F1B formula), in whole steps: a step cut by a loss is lost.

Time 0 is the end of the first step (the demo's clock starts there), so the replay starts with
one step done. Every time and parameter is in demo seconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_bamboo.demo.events import ClusterEvent
from lightning_bamboo.demo.shape import DEMO_LAYERS, STANDBY_PROCESSES
from lightning_bamboo.errors import FatalLoss
from lightning_bamboo.sim.params import DEFAULT_PATH, DemoParams, ParamError
from lightning_bamboo.topology.failover import plan_failover
from lightning_bamboo.topology.layout import even_parts


def load_demo_params(path: str | os.PathLike[str] = DEFAULT_PATH, **overrides: Any) -> DemoParams:
    """The ``demo`` section of the parameter file (written by ``benchmarks/sim_calibrate.py``)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    section = data.get("demo", {}).get("params") if isinstance(data.get("demo"), dict) else None
    if not isinstance(section, dict):
        raise ParamError(
            f"{str(path)!r} has no 'demo' section; run benchmarks/sim_calibrate.py on the machine that runs the demo"
        )
    values = {k: v["value"] for k, v in section.items()}
    values.update(overrides)
    try:
        return DemoParams(**values)
    except TypeError as exc:
        raise ParamError(f"demo section of {str(path)!r} does not match DemoParams: {exc}") from None


@dataclass
class DemoPrediction:
    """What the replay predicts for one demo run."""

    seconds: float  # demo wall time: first step done -> end of the run (incl. end_seconds)
    steps_completed: int
    samples_per_second: float
    preemptions: int = 0
    recoveries: dict[str, int] = field(
        default_factory=lambda: {"redundant": 0, "checkpoint": 0, "restart": 0}
    )
    recomputed_steps: int = 0
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (seconds, what happened)


@dataclass
class _Run:
    """Mutable state of one replay."""

    alive: list[str]
    running: list[str]
    parts: tuple[int, ...]
    done: int = 1
    checkpoint: int = 0  # step of the last complete checkpoint (0: none)
    pending: tuple[int, float] | None = None  # (step, time its save completes) of a save in progress
    start: float = 0.0  # when the next step starts (after a pause) or the step in flight started
    restart_until: float = -1.0  # the job is restarting (no process group to fail over in) until then
    respawn_at: float | None = None  # a restart that lost a worker while starting fails and respawns then
    ready: dict[str, float] = field(default_factory=dict)  # joined nodes started live -> when they stand by
    waiting: list[str] = field(default_factory=list)  # joined nodes not started yet (no place for a process)
    rebalance_due: bool = False  # a failover happened: the next step start reconfigures


def replay_demo(
    events: Sequence[ClusterEvent],
    nodes: Sequence[str],
    params: DemoParams,
    steps: int,
    *,
    redundancy: bool = True,
    checkpoint_every: int = 4,
    stages: int | None = None,
) -> DemoPrediction:
    """Replay the demo's cluster ``events`` (from :func:`lightning_bamboo.demo.events.events_from_trace`,
    times in demo seconds from the end of the first step) until ``steps`` steps are done.

    The final checkpoint of a run is part of ``end_seconds``, so give ``steps`` as a multiple of
    ``checkpoint_every`` like the calibration runs.
    """
    if any(e.at_seconds is None for e in events):
        raise ParamError(
            "replay_demo needs timed events (a trace); step-triggered --preempt events are not replayed"
        )
    if steps < 1 or checkpoint_every < 1:
        raise ParamError(f"steps and checkpoint_every must be >= 1 (got {steps}, {checkpoint_every})")
    stages = stages or len(nodes)
    run = _Run(
        alive=list(nodes),
        running=list(nodes[:stages]),
        parts=even_parts(DEMO_LAYERS, min(stages, len(nodes))),
    )
    out = DemoPrediction(0.0, 1, 0.0)
    pending = sorted(events, key=lambda e: float(e.at_seconds or 0.0))
    i = 0
    while run.done < steps:
        finish = run.start + params.step_time(len(run.running), redundancy)
        upcoming = float(pending[i].at_seconds or 0.0) if i < len(pending) else float("inf")
        if run.respawn_at is not None and run.respawn_at <= upcoming:
            _respawn(run, params, stages, out)
            continue
        if upcoming < finish:
            now = float(pending[i].at_seconds or 0.0)
            batch = []
            while i < len(pending) and float(pending[i].at_seconds or 0.0) == now:
                batch.append(pending[i])
                i += 1
            _apply(batch, now, run, params, redundancy, stages, out)
            continue
        run.done += 1
        run.start = finish
        if run.done % checkpoint_every == 0 and run.done < steps:
            if run.pending is not None:  # the save before this one ended before the steps since then began
                run.checkpoint = run.pending[0]
            run.start = finish + params.checkpoint_save_seconds
            run.pending = (run.done, run.start)
        if redundancy and run.done < steps:
            _step_start(run, params, stages, out)
    out.steps_completed = run.done
    out.seconds = run.start + params.end_seconds
    out.samples_per_second = steps * params.samples_per_step / out.seconds if out.seconds > 0 else 0.0
    return out


def _apply(
    batch: list[ClusterEvent],
    now: float,
    run: _Run,
    params: DemoParams,
    redundancy: bool,
    stages: int,
    out: DemoPrediction,
) -> None:
    """Events of one instant: joins wait as standby; standby losses vanish; running losses recover."""
    if run.pending is not None and run.pending[1] <= now:
        run.checkpoint, run.pending = run.pending[0], None
    lost = []
    rescale = False
    for e in batch:
        if e.kind == "join":
            run.alive.append(e.node)
            if redundancy:
                run.waiting.append(e.node)
            elif len(run.running) < stages:
                rescale = True  # checkpoint-restart takes a new node in by restarting (torchelastic, Varuna)
        elif e.node in run.alive:
            run.alive.remove(e.node)
            run.ready.pop(e.node, None)
            if e.node in run.waiting:
                run.waiting.remove(e.node)
            if e.node in run.running:
                lost.append(e.node)
    _start_standby(run, now, params, stages)
    if not lost:
        if rescale and run.respawn_at is None and now >= run.restart_until:
            _restart(now, [], run, params, stages, out, redundancy)
        return
    out.preemptions += len(lost)
    if run.respawn_at is not None:  # this generation already failed: it only waits to be replaced
        return
    if now < run.restart_until:
        _lost_while_starting(now, lost, run, params, out, min_nodes=2 if redundancy else 1)
        return
    plan = None
    if redundancy and len(run.running) > 1:
        try:
            plan = plan_failover(run.running, run.parts, lost)
        except FatalLoss:
            plan = None
    if plan is None:
        _restart(now, lost, run, params, stages, out, redundancy)
        return
    out.recoveries["redundant"] += 1
    run.running, run.parts = list(plan.order), plan.parts
    run.rebalance_due = True
    if run.pending is not None:  # a save was cut: it runs again after the failover
        run.start = now + params.failover_seconds + params.checkpoint_save_seconds
        run.pending = (run.pending[0], run.start)
    elif run.start <= now:  # the step in flight is redone on the shorter pipeline
        out.recomputed_steps += 1
        run.start = now + params.failover_seconds
    else:  # already paused (an earlier failover): the pause runs on from now
        run.start = max(run.start, now + params.failover_seconds)
    _start_standby(run, now, params, stages)  # a place freed: the next waiting node starts
    out.timeline.append((now, f"lost {lost}: failover to {len(run.running)} stages"))


def _start_standby(run: _Run, now: float, params: DemoParams, stages: int, training: bool = True) -> None:
    """Start waiting joined nodes while fewer than ``stages + STANDBY_PROCESSES`` processes run; each
    start-up while the pipeline trains delays it by ``standby_start_seconds``."""
    while run.waiting and len(run.running) + len(run.ready) < stages + STANDBY_PROCESSES:
        run.ready[run.waiting.pop(0)] = now + params.join_seconds
        if training:
            run.start += params.standby_start_seconds


def _step_start(run: _Run, params: DemoParams, stages: int, out: DemoPrediction) -> None:
    """RebalanceCallback at the start of a step: admit standby nodes that are up, or even out the layers."""
    up = [n for n, t in run.ready.items() if t <= run.start and n not in run.running]
    admitted = up[: max(0, stages - len(run.running))]
    if not admitted and not run.rebalance_due:
        return
    for node in admitted:
        run.running.append(node)
        del run.ready[node]
    run.parts = even_parts(DEMO_LAYERS, len(run.running))
    run.rebalance_due = False
    run.start += params.reconfigure_seconds
    out.timeline.append((run.start, f"reconfigure to {len(run.running)} stages" + (f" (admit {admitted})" if admitted else "")))


def _restart(
    now: float, lost: list[str], run: _Run, params: DemoParams, stages: int, out: DemoPrediction, redundancy: bool
) -> None:
    """No replica to take over (or no replicas at all): every worker restarts from the last checkpoint.

    With replicas, two or more survivors of the pipeline restart in their running processes
    (``restart_in_place_seconds``) and the other live nodes join that pipeline as standby nodes.
    """
    if not run.alive:
        raise ParamError(f"at {now:.1f} s every node is gone and none joined: the demo stops (lost {lost})")
    run.pending = None  # a save cut short is not a checkpoint
    out.recoveries["checkpoint" if run.checkpoint else "restart"] += 1
    out.recomputed_steps += run.done - run.checkpoint
    run.done = run.checkpoint
    kept = [n for n in run.running if n not in lost and n in run.alive] if redundancy and lost else []
    in_place = len(kept) >= 2
    run.running = kept[:stages] if in_place else run.alive[:stages]
    run.ready.clear()  # every live node restarts as a worker or waits to be started as a standby
    run.waiting = [n for n in run.alive if n not in run.running] if len(run.running) > 1 else []
    run.rebalance_due = False
    run.parts = even_parts(DEMO_LAYERS, len(run.running))
    pause = params.restart_in_place_seconds if in_place and params.restart_in_place_seconds is not None else params.restart_seconds
    run.start = run.restart_until = now + pause
    # standby nodes start with the restarted workers (in the pause), or while the kept ones train
    _start_standby(run, now, params, stages, training=in_place)
    if in_place:
        _step_start(run, params, stages, out)  # the restarted job's first step admits standby nodes already up
    out.timeline.append((now, f"lost {lost}: restart {len(run.running)} stages from step {run.checkpoint}"
                         + (" in their processes" if in_place else "")))


def _lost_while_starting(
    now: float, lost: list[str], run: _Run, params: DemoParams, out: DemoPrediction, min_nodes: int
) -> None:
    """A worker of a restarting generation died: the others start without it, one stage fewer and at
    the same time (the loss is seen at their first rendezvous; modelled as if it always were). With
    fewer than ``min_nodes`` left they wait for it until the rendezvous times out
    (``startup_timeout_seconds``), fail, and the job restarts again."""
    left = [n for n in run.running if n not in lost]
    if len(left) >= min_nodes:
        run.running, run.parts = left, even_parts(DEMO_LAYERS, len(left))
        out.timeline.append((now, f"lost {lost} while restarting: the others start without it ({len(left)} stages)"))
        return
    out.recoveries["checkpoint" if run.checkpoint else "restart"] += 1
    run.respawn_at = run.restart_until + params.startup_timeout_seconds
    run.start = run.respawn_at + params.restart_seconds
    out.timeline.append(
        (now, f"lost {lost} while restarting: that generation fails at {run.respawn_at:.1f} s")
    )


def _respawn(run: _Run, params: DemoParams, stages: int, out: DemoPrediction) -> None:
    """Start the next generation with the first ``stages`` live nodes (after a failed restart)."""
    assert run.respawn_at is not None
    if not run.alive:
        raise ParamError(f"at {run.respawn_at:.1f} s every node is gone and none joined: the demo stops")
    run.running = run.alive[:stages]
    run.parts = even_parts(DEMO_LAYERS, len(run.running))
    run.start = run.restart_until = run.respawn_at + params.restart_seconds
    out.timeline.append((run.respawn_at, f"respawn {len(run.running)} stages from step {run.checkpoint}"))
    run.respawn_at = None


def run_trace(events: Sequence[ClusterEvent], nodes: Sequence[str], cap: int, ready: float, source: str = "a run's view"):
    """A run's view of cluster ``events`` as the cluster simulator's trace (``lightning_bamboo.sim.simulate``).

    ``nodes`` are added at 0 (usable at ``ready``, the run's first step); every later event comes ``ready``
    seconds after its time from that first step. At most ``cap`` nodes run (the demo's pipelines and its standby
    process; the peer's agents): a node that joins beyond them waits and starts, in order, when a running one is
    lost; a waiting node that is lost never starts.
    """
    from lightning_bamboo.sim.trace import Trace, TraceEvent

    out = [TraceEvent(0, "add", n) for n in nodes]
    running, waiting = set(nodes), []
    for e in events:
        ms = int(round(((e.at_seconds or 0.0) + ready) * 1000))
        if e.kind == "join":
            waiting.append(e.node)
        elif e.node in running:
            running.discard(e.node)
            out.append(TraceEvent(ms, "remove", e.node, e.notice or 0.0))
        elif e.node in waiting:
            waiting.remove(e.node)
        while waiting and len(running) < cap:
            node = waiting.pop(0)
            running.add(node)
            out.append(TraceEvent(ms, "add", node))
    out.sort(key=lambda e: e.ms)
    return Trace(tuple(out), source)
