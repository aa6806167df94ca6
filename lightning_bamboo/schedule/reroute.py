"""A rerouted step, timed: the lost nodes' micro-batches run on the same stage of the other pipelines.

ReCycle's idea for a damaged pipeline among several (issue 63, ``docs/sim.md``): no pipeline is dropped; the
micro-batches that a lost node ``(pipeline q, stage s)`` would have computed go to the live nodes of stage ``s`` in the
other pipelines, which hold the same layers (data-parallel copies), spread over them in turn. The damaged pipeline's
other nodes send to and receive from those nodes instead.

How long such a step takes is not the 1F1B formula with the extra work dropped into the bubbles: a rerouted
micro-batch reaches stage ``s`` when the same micro-batch of the helper's own pipeline does (the pipelines run the same
schedule), so much of its work competes with the helper's own; the idle slots of stage ``s`` are where no micro-batch
of any pipeline has arrived yet (the fill) or is left (the drain). :func:`rerouted_step` times the step with every
dependency kept (a stage's forward after the previous stage's, a backward after its forward and the next stage's
backward; ``costs.send`` for each transfer between two nodes) by list scheduling its graph: whenever a node can start
work, it runs, of what it can start then, the action with the longest path to the step's end. No fixed order binds a
node (nor its memory: it may run forwards well ahead), so the model places the borrowed work more freely than programs
of DeepSpeed's 1F1B order could (at 4 pipelines of 12 stages, 1.09-1.17x against 1.17-1.52x when each node keeps its
own and each borrowed stream in 1F1B order): it favours rerouting. What it leaves out
favours rerouting too: ReCycle splits a backward into its input and its weight gradient and defers the latter into the
drain, which DeepSpeed's engine does not do (a backward runs whole here).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache

from lightning_bamboo.schedule.action import ScheduleError
from lightning_bamboo.schedule.costs import Costs

#: a task of the step: (pipeline, stage, micro-batch, "F" or "B")
_Task = tuple[int, int, int, str]


@dataclass(frozen=True)
class ReroutedStep:
    """The timed step: ``makespan`` of the rerouted step, ``healthy`` of the same layout with no node lost, and per
    live node ``(pipeline, stage)`` its busy time (its own actions and the borrowed ones)."""

    makespan: float
    healthy: float
    busy: tuple[tuple[tuple[int, int], float], ...]

    @property
    def slowdown(self) -> float:
        """Step-time factor of the rerouted step against the healthy one (1 for a step with no micro-batch)."""
        return self.makespan / self.healthy if self.healthy else 1.0


def _check(stages: int, micro_batches: Sequence[int], lost: Collection[tuple[int, int]]) -> None:
    pipelines = len(micro_batches)
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ScheduleError(f"stages must be an int >= 1, got {stages!r}")
    if pipelines < 1 or any(not isinstance(m, int) or isinstance(m, bool) or m < 0 for m in micro_batches):
        raise ScheduleError(f"micro_batches names each pipeline's micro-batches (ints >= 0), got {list(micro_batches)}")
    outside = sorted(p for p in lost if not (0 <= p[0] < pipelines and 0 <= p[1] < stages))
    if outside:
        raise ScheduleError(f"lost positions {outside} are outside {pipelines} pipeline(s) x {stages} stage(s); name "
                            "each as (pipeline, stage)")


def rerouted_step(stages: int, micro_batches: Sequence[int], lost: Collection[tuple[int, int]] = (),
                  costs: Costs | None = None) -> ReroutedStep:
    """Time one step of ``len(micro_batches)`` pipelines of ``stages`` stages (pipeline ``q`` runs
    ``micro_batches[q]`` micro-batches) with the nodes at ``lost`` ``(pipeline, stage)`` positions gone and their
    micro-batches rerouted (see the module docstring). ``ScheduleError`` when a stage has no live node left (the step
    cannot run: nothing holds its layers)."""
    _check(stages, micro_batches, lost)
    ms = tuple(micro_batches)
    names = {q: q for q in range(len(ms))}
    if len(set(ms)) == 1:  # pipelines of one size are alike: number them by their first loss (fewer to time)
        first = list(dict.fromkeys(q for q, _ in sorted(lost, key=lambda p: (p[1], p[0]))))
        names = dict(zip(first + [q for q in range(len(ms)) if q not in first], range(len(ms)), strict=True))
    step = _timed(stages, ms, frozenset((names[q], s) for q, s in lost), costs or Costs())
    named = {new: q for q, new in names.items()}
    return ReroutedStep(step.makespan, step.healthy, tuple(sorted(((named[q], s), t) for (q, s), t in step.busy)))


@lru_cache(maxsize=4096)
def _timed(stages: int, micro_batches: tuple[int, ...], lost: frozenset[tuple[int, int]], costs: Costs) -> ReroutedStep:
    makespan, busy = _list_schedule(stages, micro_batches, lost, costs)
    healthy = makespan if not lost else _list_schedule(stages, micro_batches, frozenset(), costs)[0]
    return ReroutedStep(makespan, healthy, tuple(sorted(busy.items())))


def _list_schedule(stages: int, micro_batches: tuple[int, ...], lost: frozenset[tuple[int, int]],
                   costs: Costs) -> tuple[float, dict[tuple[int, int], float]]:
    """List scheduling of the step's graph: whenever a node can start, it runs, of the actions it can start then, the
    one with the longest path to the step's end (ties: the lower micro-batch, its own pipeline first)."""
    pipelines = len(micro_batches)
    runs: dict[tuple[int, int, int], tuple[int, int]] = {}  # (pipeline, stage, micro-batch) -> the node that runs it
    for stage in range(stages):
        live = [q for q in range(pipelines) if (q, stage) not in lost]
        if not live:
            raise ScheduleError(f"stage {stage} has no live node left (lost: {sorted(lost)}); a rerouted step needs a "
                                "copy of every stage, else the job restarts from its checkpoint")
        dead = sorted(q for q in range(pipelines) if (q, stage) in lost)
        for q in range(pipelines):
            turn = dead.index(q) if q in dead else 0  # two lost nodes of a stage do not load the same helper first
            for k in range(micro_batches[q]):
                runs[(q, stage, k)] = (q, stage) if q not in dead else (live[(k + turn) % len(live)], stage)
    cost = {"F": costs.forward, "B": costs.backward}

    def after(task: _Task) -> list[_Task]:
        q, s, k, kind = task
        if kind == "F":
            return [(q, s, k, "B")] + ([(q, s + 1, k, "F")] if s < stages - 1 else [])
        return [(q, s - 1, k, "B")] if s > 0 else []

    tasks = [(q, s, k, kind) for q in range(pipelines) for s in range(stages) for k in range(micro_batches[q])
             for kind in ("F", "B")]
    # the longest path from each action to the step's end, its own cost included (in reverse topological order:
    # a backward's successors are on lower stages, a forward's on higher ones or its own backward)
    tail: dict[_Task, float] = {}
    order = sorted(tasks, key=lambda t: (t[3] == "F", -t[1] if t[3] == "F" else t[1]))
    for task in order:
        tail[task] = cost[task[3]] + max((tail[u] for u in after(task)), default=0.0)
    waiting = {t: 0 for t in tasks}
    for task in tasks:
        for u in after(task):
            waiting[u] += 1
    arrives: dict[_Task, float] = {t: 0.0 for t in tasks if not waiting[t]}  # ready actions: when their inputs are in
    latest: dict[_Task, float] = {}  # actions with inputs still to come: when those in so far arrived
    free: dict[tuple[int, int], float] = {}
    busy: dict[tuple[int, int], float] = {}
    finish = 0.0
    while arrives:
        best: tuple[float, float, int, bool, _Task] | None = None
        for task, at in arrives.items():
            node = runs[task[:3]]
            key = (max(at, free.get(node, 0.0)), -tail[task], task[2], task[0] != node[0], task)
            if best is None or key < best:
                best = key
        assert best is not None
        start, task = best[0], best[4]
        del arrives[task]
        node = runs[task[:3]]
        end = free[node] = start + cost[task[3]]
        busy[node] = busy.get(node, 0.0) + cost[task[3]]
        finish = max(finish, end)
        for u in after(task):
            moved = costs.send if runs[u[:3]] != node else 0.0
            latest[u] = max(latest.get(u, 0.0), end + moved)
            waiting[u] -= 1
            if not waiting[u]:
                arrives[u] = latest.pop(u)
    return finish, busy
