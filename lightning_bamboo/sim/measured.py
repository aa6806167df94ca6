"""Measured runs as the simulator sees them, for checking its predictions against real ones (``benchmarks/peers.py``):
which of a trace's removals hit a running node, a run's progress against time, a checkpoint-restart run's numbers from
its workers' event lines, the simulator's inputs taken from a run, and the samples the simulator predicts for it."""

from __future__ import annotations

import itertools
import math
import statistics

from lightning_bamboo.demo.shape import GLOBAL_BATCH
from lightning_bamboo.sim.demo import load_demo_params, run_trace
from lightning_bamboo.sim.params import SimParams
from lightning_bamboo.sim.simulate import run_policy

__all__ = ["kills_of_running", "mean", "predict_samples", "progress_at", "sim_inputs", "steps_for", "summarize_peer",
           "young_daly"]


def kills_of_running(events: list, nodes: list[str], width: int, horizon: float) -> int:
    """How many of the slice's removals within ``horizon`` seconds hit a running node, when at most ``width``
    nodes run and a joined node runs at once if there is room, else waits and replaces the next lost one."""
    running, waiting, kills = list(nodes[:width]), list(nodes[width:]), 0
    for event in events:
        if event.at_seconds > horizon:
            break
        if event.kind == "join":
            (running if len(running) < width else waiting).append(event.node)
        elif event.node in running:
            kills += 1
            running.remove(event.node)
            if waiting:
                running.append(waiting.pop(0))
        elif event.node in waiting:
            waiting.remove(event.node)
    return kills


def progress_at(step_times: list, seconds: float) -> int:
    """The most steps a run had finished ``seconds`` after its first step (``[progress, seconds]`` pairs)."""
    return max((int(step) for step, t in step_times if t <= seconds), default=0)


def own_pace_ettr(step_times: list, wall: float) -> float:
    """A run's ETTR at its own pace: the steps it finished in its first ``wall`` seconds (``progress_at``) times its
    own median step (between consecutive steps), over ``wall``: the share of the time it trained at the pace it
    trains at. Against a separate clean run instead, the reference moves with whatever else differs between the two
    runs; on a few shared cores, how many processes are running (a lost node makes the others' steps faster)."""
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(step_times) if b[0] == a[0] + 1]
    if not gaps or wall <= 0:
        return float("nan")
    return progress_at(step_times, wall) * statistics.median(gaps) / wall


def steps_for(wall: float, step_seconds: float) -> int:
    """Steps that keep an undisturbed run going for longer than ``wall`` seconds (a fifth more)."""
    return max(1, math.ceil(1.2 * wall / step_seconds))


def young_daly(save_seconds: float, mtbf: float, step_seconds: float) -> int:
    """Young/Daly's checkpoint interval in steps: sqrt(2 x save time x MTBF) / step time, at least 1."""
    return max(1, round(math.sqrt(2.0 * save_seconds * mtbf) / step_seconds))


def summarize_peer(lines: list[dict], kills: list[tuple[float, str]], steps: int) -> dict:
    """A checkpoint-restart run's numbers from its workers' event lines (``benchmarks/peer_train.py``'s: ``start``,
    ``loading``, ``loaded``, ``step``, ``error``, ``saved``, ``done``, each with its time ``t``, ``pid`` and ``rank``) and
    the kill times: its progress against time, its recoveries, each split into detection, restart, reload and first
    step, and its saves."""
    step_events = [e for e in lines if e["event"] == "step"]
    done = [e for e in lines if e["event"] == "done" and e["rank"] == 0]
    final = max((e["step"] for e in done), default=max((e["step"] for e in step_events), default=0))
    times = sorted(e["t"] for e in step_events)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    intervals = [b["t"] - a["t"] for a, b in itertools.pairwise(step_events) if b["step"] == a["step"] + 1
                 and b["pid"] == a["pid"]]
    step_seconds = statistics.median(intervals) if intervals else float("nan")
    start_of = {e["pid"]: e["t"] for e in lines if e["event"] == "start"}
    per_kill = []
    for at, node in kills:
        before = [e["step"] for e in step_events if e["t"] <= at]
        progress = before[-1] if before else 0
        # the job that recovered: its workers started after the kill; its first finished step ends the recovery
        recovered = next((e for e in step_events if e["t"] > at and start_of.get(e["pid"], 0) > at), None)
        if recovered is None:
            per_kill.append({"node": node, "at": at, "progress": progress, "recovery": None})
            continue
        end = recovered["t"]
        new = [e for e in lines if start_of.get(e["pid"], 0) > at and e["t"] <= end]
        # detected once every survivor's worker failed: the errors before the first new worker started
        first_start = min((start_of[e["pid"]] for e in new), default=end)
        errors = [e["t"] for e in lines if e["event"] == "error" and at < e["t"] < first_start]
        # the job that recovered started with its rank 0 (a job that failed before it is part of the restart)
        began = start_of[recovered["pid"]] - 1.0
        loading = [e["t"] for e in new if e["event"] in ("loading", "loaded") and e["t"] >= began]
        loaded = [e for e in new if e["event"] == "loaded" and e["t"] >= began]
        detected = max(errors) if errors else float("nan")
        load_start = min(loading) if loading else float("nan")
        load_end = max(e["t"] for e in loaded) if loaded else float("nan")
        resumed = min((e["step"] for e in loaded), default=0)
        per_kill.append({
            "node": node, "at": at, "progress": progress, "resumed_at": resumed, "recovery": end - at,
            "detection": detected - at, "restart": load_start - (detected if errors else at),
            "reload": load_end - load_start, "first_step": end - load_end,
            "redone": max(0, progress - resumed), "optimizer": sorted({e["optimizer"] for e in loaded}),
        })
    generations = [e for e in lines if e["event"] == "loaded" and e["rank"] == 0]
    reached, step_times = 0, []  # [progress, seconds since the first step] whenever the progress grew: the demo's
    for e in sorted(step_events, key=lambda e: e["t"]):
        if e["step"] > reached:
            reached = e["step"]
            step_times.append([reached, e["t"] - times[0]])
    return {
        "step_times": step_times,
        "steps_completed": final,
        "samples_per_second": max(0, final - 1) * GLOBAL_BATCH / span if span > 0 else 0.0,
        "span": span,
        "step_seconds": step_seconds,
        "preemptions": len(kills),
        "restarts": max(0, len(generations) - 1),
        "optimizer_resets": sum(1 for e in generations if e["optimizer"] == "reset"),
        "recomputed_steps": max(0, len(step_events) - final),
        "recovery_seconds": [k["recovery"] for k in per_kill if k["recovery"] is not None],
        "per_kill": per_kill,
        "save_seconds": [e["seconds"] for e in lines if e["event"] == "saved"],
        "depths": [e["world"] for e in generations],
    }


def mean(xs: list[float]) -> float:
    """The mean of ``xs`` (0 for none)."""
    return sum(xs) / len(xs) if xs else 0.0


def sim_inputs(name: str, result: dict, every: int, step: float, save: float) -> dict:
    """The simulator's inputs for run (a) ``bamboo`` or (b) ``torchrun``, as ``benchmarks/sim_validation.py`` takes
    them: the run's undisturbed step time (a calibration run's), its own mean recovery per kind, its own reconfigurations (the demo's
    report), the save."""
    demo = load_demo_params()
    if name == "torchrun":
        # a restart's own length: the recoveries no other kill interrupted (the simulator adds what a later kill
        # costs itself, as torchrun does: a new rendezvous round)
        kills = [k for k in result["per_kill"] if k["recovery"] is not None]
        alone = [k["recovery"] for k in kills
                 if not any(o is not k and k["at"] < o["at"] < k["at"] + k["recovery"] for o in result["per_kill"])]
        restart = mean(alone) or mean(result["recovery_seconds"])
        return {"policy": "elastic", "min_stages": 1, "failover_seconds": restart, "restart_seconds": restart,
                "reconfigure_seconds": 0.0, "ready": 0.0, "checkpoint_save_seconds": save,
                "checkpoint_interval_seconds": every * step, "step_seconds": step}
    kinds = result.get("recovery_kinds") or ["failover"] * len(result["recovery_seconds"])
    failovers = [s for s, k in zip(result["recovery_seconds"], kinds, strict=False) if k == "failover"]
    restarts = [s for s, k in zip(result["recovery_seconds"], kinds, strict=False) if k != "failover"]
    reconfigurations = [r["seconds"] for r in result.get("reconfigurations", []) if r.get("seconds")]
    restart = mean(restarts) or demo.restart_seconds
    return {"policy": "bamboo", "min_stages": 2,  # the rebalancer's shallowest pipeline: a replica needs a second stage
            "failover_seconds": mean(failovers) or restart, "restart_seconds": restart,
            "reconfigure_seconds": mean(reconfigurations) or demo.reconfigure_seconds, "ready": demo.join_seconds,
            "checkpoint_save_seconds": 0.0, "checkpoint_interval_seconds": every * step, "step_seconds": step}


def predict_samples(inputs: dict, events: list, nodes: int, wall: float, step_delay: float, cap: int) -> float:
    """The samples the simulator's policy has trained ``wall`` seconds after the run's first step (``nodes`` nodes at
    the start, at most ``cap`` running, a pause of ``step_delay`` s in every step), counted as the
    run counts them (the most it had reached by then: a rollback does not take back what the run's clock saw), plus
    the first step's (the runs' clocks start when it is done)."""
    ready, step = inputs["ready"], inputs["step_seconds"]
    params = SimParams(
        stages=nodes, min_stages=inputs["min_stages"], layers=8, micro_batch_size=2, global_micro_batches=4,
        step_seconds=step, step_pipelines=1, single_pipeline_step_seconds=step, step_fixed_seconds=step_delay,
        redundancy_overhead=0.0,
        failover_seconds=inputs["failover_seconds"], restart_seconds=inputs["restart_seconds"],
        reconfigure_seconds=inputs["reconfigure_seconds"], checkpoint_save_seconds=inputs["checkpoint_save_seconds"],
        checkpoint_interval_seconds=inputs["checkpoint_interval_seconds"],
        bamboo_checkpoint_interval_seconds=inputs["checkpoint_interval_seconds"], node_ready_seconds=ready,
        rejoin_seconds=ready, max_overloaded_fraction=0.05,
    )
    trace = run_trace(events, [f"node{i}" for i in range(nodes)], cap, ready)
    end = ready + wall
    result, _ = run_policy(inputs["policy"], trace, params.replace(hours=end / 3600), end)
    # the most reached: the end, or the end of a stretch at a steady rate before a rollback took some back
    points = result.timeline
    ends = (p.samples + p.rate * (q.seconds - p.seconds) for p, q in zip(points, points[1:], strict=False))
    return max(result.samples, *ends) + GLOBAL_BATCH

