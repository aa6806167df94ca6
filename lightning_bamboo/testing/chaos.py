"""Chaos runs, for the tests and the benchmarks alike: the seeded schedules of membership changes that
``benchmarks/chaos.py`` replays with the demo, and the judgements a run with changes gets against a clean run of
the same steps (weights and optimizer state, the samples of every step, and how long a live worker sat idle)."""

from __future__ import annotations

import collections
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_bamboo import checkpoint as ckpt

__all__ = ["CHECKPOINT_EVERY", "IDLE_SECONDS", "INSIDE", "JOIN_LAG", "NODES", "Schedule", "final_checkpoint",
           "idle_spells", "make_schedule", "max_difference", "optimizer_states", "sample_problems", "samples_by_step",
           "start_ups"]

#: the demo's nodes in a chaos run of one pipeline, and its checkpoint interval in steps
NODES = 4
CHECKPOINT_EVERY = 4
#: steps from a join to the new node's first step, at ``--step-delay`` 0.4 s (a process's start-up, on 2 cores)
JOIN_LAG = 12
#: points inside the runtime where a node is killed (``BAMBOO_FAIL_AT``); ``{step}`` is filled in
INSIDE = {"in_failover": "failover", "in_reconfiguration": "reconfigure", "in_checkpoint_save": "save{step}",
          "between_commit_and_apply": "apply{step}"}


@dataclass
class Schedule:
    """One seed's membership changes as demo flags; ``kinds`` counts them by kind."""

    seed: int
    steps: int
    preempt: list[str] = field(default_factory=list)
    join: list[str] = field(default_factory=list)
    freeze: list[str] = field(default_factory=list)  # nodes stopped (SIGSTOP, never continued)
    fail_at: list[str] = field(default_factory=list)
    fail_steps: list[int] = field(default_factory=list)  # the step each ``fail_at`` item was drawn at
    etcd_restarts: list[int] = field(default_factory=list)  # steps at which the etcd server is killed and started again
    kinds: collections.Counter = field(default_factory=collections.Counter)
    changes: int = 0  # nodes lost or joined


def make_schedule(seed: int, changes: int, nodes: int = NODES, join_lag: int = JOIN_LAG, etcd: bool = False,
                  pipelines: int = 1) -> Schedule:
    """Draw membership changes until there are ``changes`` of them (a node lost or joined is one change).

    The schedule follows who runs by itself (the demo's order: the first nodes, then each joined node
    appended) and names only those as victims, keeping at least two; a joined node counts as running
    ``join_lag`` steps after it joined (its process starts, registers and is admitted meanwhile).
    Neighbours are neighbours in that order, which is the pipeline's until a rebalance reorders it
    (then a "node and holder" pair may be survivable and a "non-neighbours" pair fatal: the report
    says what happened). With ``etcd``, up to two restarts of the etcd server are drawn too (they
    change no membership and do not count as changes). With ``pipelines`` of 2 or more, whole machines
    (``pipelines`` nodes in a row of that order: one stage of every pipeline at the start) are killed
    at once and replacement machines of as many nodes join.
    """
    rng = random.Random(seed)
    alive = [f"node{i}" for i in range(nodes)]
    joining: dict[str, int] = {}  # joined, not yet running: the step from which it runs
    schedule = Schedule(seed, 0)
    step, spares, fatal = 2, 0, 0
    unused = list(INSIDE)

    def kill(name: str, at: int, notice: int | None = None) -> None:
        schedule.preempt.append(f"{name}@{at}" + (f":{notice}" if notice else ""))
        alive.remove(name)
        schedule.changes += 1

    def join(at: int) -> str:
        nonlocal spares
        spares += 1
        schedule.join.append(f"spare{spares}@{at}")
        joining[f"spare{spares}"] = at + join_lag
        schedule.changes += 1
        return f"spare{spares}"

    while schedule.changes < changes:
        step += rng.choice((1, 2, 2, 3))
        for name, ready in list(joining.items()):
            if ready <= step:
                alive.append(name)
                del joining[name]
        weights = {
            "join": 3 if len(alive) + len(joining) <= nodes else 0,
            "kill_after_join": 1 if len(alive) + len(joining) <= nodes and len(alive) >= 3 else 0,
            "kill": 4 if len(alive) > 2 else 0,
            "notice": 2 if len(alive) > 2 else 0,
            "freeze": 1 if len(alive) > 2 and len(schedule.freeze) < 2 else 0,
            "inside": 3 if len(alive) > 2 and unused else 0,
            "two_non_neighbours": 2 if len(alive) >= 4 else 0,
            "node_and_holder": 2 if len(alive) >= 4 and fatal < 2 else 0,
            "etcd_restart": 1 if etcd and len(schedule.etcd_restarts) < 2 else 0,
            "machine": 3 if pipelines > 1 and len(alive) - pipelines >= 2 else 0,
            "machine_join": 2 if pipelines > 1 and len(alive) + len(joining) + pipelines <= nodes else 0,
        }
        if sum(weights.values()) == 0:
            continue  # wait for the joining nodes
        kind = rng.choices(list(weights), weights=list(weights.values()))[0]
        if kind == "join":
            join(step)
        elif kind == "machine":  # a machine of several workers lost whole: a node of every pipeline at once
            first = rng.randrange(len(alive) - pipelines + 1)
            for name in alive[first : first + pipelines]:
                kill(name, step)
        elif kind == "machine_join":  # a replacement machine: its workers join together
            for _ in range(pipelines):
                join(step)
        elif kind == "etcd_restart":
            schedule.etcd_restarts.append(step)
        elif kind == "kill_after_join":  # killed as soon as it has run a step
            name = join(step)
            del joining[name]
            schedule.preempt.append(f"{name}@{step + 1}")
            schedule.changes += 1
        elif kind == "kill":
            kill(rng.choice(alive), step)
        elif kind == "freeze":  # a machine that hangs: found by its lease, its peers' sends to it cut off
            name = rng.choice(alive)
            schedule.freeze.append(f"{name}@{step}")
            alive.remove(name)
            schedule.changes += 1
        elif kind == "notice":
            kill(rng.choice(alive), step, notice=rng.choice((1, 2, 3)))
        elif kind == "two_non_neighbours":
            first = rng.randrange(len(alive))
            for name in [alive[first], alive[(first + 2) % len(alive)]]:
                kill(name, step)
        elif kind == "node_and_holder":  # fatal for the replicas: the checkpoint fallback, then a kill right after
            first = rng.randrange(len(alive) - 1)
            for name in alive[first : first + 2]:
                kill(name, step)
            fatal += 1
            if len(alive) <= 2:  # a node joining now is started with the restarted job (no standby wait)
                alive.append(join(step))
                del joining[alive[-1]]
            step += 2
            kill(rng.choice(alive), step)
            schedule.kinds["kill_after_restart"] += 1
        else:  # a kill at a point inside the runtime
            kind = unused.pop(rng.randrange(len(unused)))
            # a node of the start if one is left: it surely runs by then (a joined node may still be starting)
            name = rng.choice([n for n in alive if n.startswith("node")] or alive)
            at = -(-step // CHECKPOINT_EVERY) * CHECKPOINT_EVERY if kind == "in_checkpoint_save" else step
            schedule.fail_at.append(f"{name}@{INSIDE[kind].format(step=at)}")
            schedule.fail_steps.append(at)
            alive.remove(name)
            schedule.changes += 1
            if kind in ("in_failover", "in_reconfiguration"):
                # reached at the next failover or reconfiguration: a kill now brings both
                kill(rng.choice(alive), step)
        schedule.kinds[kind] += 1
    schedule.steps = max([step, *joining.values()]) + 6
    return schedule




def final_checkpoint(work: Path) -> Path:
    """The final checkpoint of the demo's last job (the run directory with the highest generation)."""
    runs = sorted((p for p in work.glob("run*") if (p / "final.ckpt").exists()), key=lambda p: int(p.name[3:]))
    if not runs:
        raise FileNotFoundError(f"no final.ckpt under {work}")
    return runs[-1] / "final.ckpt"


def optimizer_states(path: Path) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor of the checkpoint at ``path`` (AdamW's moments and step counts), by layer, name
    and key."""
    layers = ckpt.read_layers(path, range(ckpt.read_meta(path)["bamboo"]["num_layers"]))
    return {f"{layer}.{name}.{key}": torch.as_tensor(value) for layer, state in layers.items()
            for name, saved in state["optimizer"].items() for key, value in saved["state"].items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of two sets of named tensors (in float64: exact for float32 values); infinite
    when their names differ."""
    if sorted(a) != sorted(b):
        return float("inf")
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)


def samples_by_step(work: Path) -> dict[int, list[list[int]]]:
    """Every record of which samples a step trained on, from every process of every job."""
    seen: dict[int, list[list[int]]] = collections.defaultdict(list)
    for path in work.glob("run*/samples-*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                seen[int(record["step"])].append(record["samples"])
    return seen


def sample_problems(clean: dict[int, list[list[int]]], chaos: dict[int, list[list[int]]], steps: int) -> list[str]:
    """Steps that no process finished, or that trained on other samples than the clean run's."""
    problems = [f"step {s} never finished" for s in range(1, steps + 1) if s not in chaos]
    for step, records in sorted(chaos.items()):
        expected = clean.get(step, [None])[0]
        problems += [f"step {step} trained on {r[:4]}..., the clean run on {(expected or [])[:4]}..."
                     for r in records if r != expected]
    return problems



IDLE_SECONDS = 2.0  # issue 63: no live node idle for longer than this after any event


def idle_spells(run: dict[str, Any], longer_than: float = IDLE_SECONDS) -> list[tuple[float, str, str]]:
    """``(seconds, node, when)`` for every spell longer than ``longer_than`` in which a live worker trained no step:
    between two of its steps (a failover's pause, a release until its admission), from its start to its first step
    (a worker of a machine that joined: from its script's start, ``run["started_at"]``, where known, else from its
    machine's join: before its process runs it is no node of the job; ``start_ups`` gives that time), and from its last step to the job's last while its machine was up (a worker that never came back).
    A worker is not live once its machine is killed or cut off, or once it was signalled (killed, or told to leave)
    or an armed fault fired (then its spells are not counted past its last step)."""
    times: dict[str, list[tuple[float, int]]] = {}
    for r in run["records"]:
        if "t" in r:
            times.setdefault(r["node"], []).append((float(r["t"]), int(r["step"])))
    if not times:
        return []
    end = max(t for points in times.values() for t, _ in points)
    fired = {item.split("@")[0] for item in run.get("fired", ())}  # the armed faults that fired, by node
    spells = []
    for node, points in times.items():
        points.sort()
        machine = node.split(".")[0]
        stopped = node in run["down_at"] or node in fired
        until = min(run["down_at"].get(machine, end), run["down_at"].get(node, end))
        joined = run.get("started_at", {}).get(node, run["joined_at"].get(machine))
        marks = ([(joined, None)] if machine in run["joined_at"] and joined is not None else []) + points
        if not stopped:
            marks.append((until, None))
        for (a, step_a), (b, _) in zip(marks, marks[1:], strict=False):
            if b - a > longer_than:
                where = "after its join" if step_a is None else f"after step {step_a}"
                spells.append((b - a, node, where))
    return sorted(spells, reverse=True)



def start_ups(run: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    """``(node, to_start, to_step)`` for every worker of a machine that joined: seconds from its machine's join (its
    supervisor started) to its script's start (``run["started_at"]``: the interpreter's start-up and imports, before
    it is a node), and from there to the end of its first step (None: it trained none)."""
    starts = run.get("started_at", {})
    first: dict[str, float] = {}
    for r in run["records"]:
        if "t" in r:
            first[r["node"]] = min(first.get(r["node"], float("inf")), float(r["t"]))
    return sorted((node, starts[node] - at, first[node] - starts[node] if node in first else None)
                  for node in starts for machine, at in run["joined_at"].items() if node.split(".")[0] == machine)
