"""Fatal pairs on machines: which two nodes lost together leave a stage without any copy, and layouts that keep
every such pair on two machines (pure, no torch).

A machine is one failure domain: a preemption takes all its workers at once. Two nodes of one pipeline are a
*fatal pair* when the failover planner cannot serve every stage after losing both (``fatal_stage_pairs``, asked of
``plan_failover`` itself): a node and its replica holder, and stage 0's node and stage ``S - 2``'s (stage 0's
holder, the last node, hands its own stage to ``S - 2``). Each data-parallel pipeline is its own ring: a machine's
loss takes nodes of several pipelines, and a pipeline must then fail over on its own. A set of losses holding no
fatal pair of a ring is always served (``tests/test_fatal_pairs.py`` checks every set up to 9 stages), so with no
fatal pair on one machine, losing one machine is never fatal.

How much a machine may hold: a ring of ``S >= 3`` stages is a cycle with the chord (0, S - 2), so one machine holds
at most ``S // 2`` of its nodes and two machines at most ``S - 1`` (they would alternate round the ring and meet on
the chord); ``S = 2``: one node each. Those bounds are concave in the number of machines (a polymatroid), so
:func:`apart_possible` decides whether machines holding ``c_1 >= c_2 >= ..`` usable nodes can run ``P`` pipelines
with every fatal pair apart by counting alone: for the ``t`` largest machines, ``P * most(t) + c_(t+1) + .. >= P * S``.
:func:`place_apart` builds such a layout, or where none exists the one with the fewest fatal pairs on one machine,
and keeps nodes on the stage they hold where it can (what stays in place moves no state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lightning_bamboo.topology.failover import fatal_stage_pairs
from lightning_bamboo.topology.layout import machine_of

Grid = tuple[tuple[str, ...], ...]
Machine = Callable[[str], str]


def rows_of(order: Sequence[str], stages: int) -> Grid:
    """The pipelines of a rank order (rank ``r`` runs stage ``r // P`` of pipeline ``r % P``), one row each."""
    pipelines = len(order) // stages
    return tuple(tuple(order[s * pipelines + p] for s in range(stages)) for p in range(pipelines))


def order_of(grid: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The rank order of ``grid`` (its rows are the pipelines): the inverse of :func:`rows_of`."""
    return tuple(row[s] for s in range(len(grid[0])) for row in grid) if grid else ()


def fatal_pairs(grid: Sequence[Sequence[str]], kept: Sequence[bool] | None = None) -> tuple[tuple[str, str], ...]:
    """Every pair of nodes of ``grid`` (rows: pipelines, each a ring) whose joint loss is fatal, stage order
    (``kept``: per stage, whether its replica is kept, ``replicas.kept_replicas``; None: every one)."""
    flags = tuple(kept) if kept is not None else None
    return tuple((row[a], row[b]) for row in grid for a, b in fatal_stage_pairs(len(row), flags))


def shared_pairs(grid: Sequence[Sequence[str]], machine: Machine = machine_of,
                 kept: Sequence[bool] | None = None) -> tuple[tuple[str, str, str], ...]:
    """``(node, node, machine)`` for every fatal pair of ``grid`` whose two nodes run on one machine."""
    return tuple((a, b, machine(a)) for a, b in fatal_pairs(grid, kept) if machine(a) == machine(b))


def most_on(machines: int, stages: int) -> int:
    """The most nodes of one ring of ``stages`` stages that ``machines`` machines can hold, fatal pairs apart."""
    if stages < 2 or machines >= 3:
        return stages * (machines > 0)
    if machines == 2:
        return stages if stages == 2 else stages - 1
    return machines * (stages // 2)


def apart_possible(capacities: Sequence[int], pipelines: int, stages: int) -> bool:
    """Whether machines with ``capacities`` usable nodes can run ``pipelines`` pipelines of ``stages`` stages with
    no fatal pair on one machine (the counting rule of the module's docstring; exact, as the tests check)."""
    caps = sorted((c for c in capacities if c > 0), reverse=True)
    need = pipelines * stages
    return all(pipelines * most_on(t, stages) + sum(caps[t:]) >= need for t in range(len(caps) + 1))


def place_apart(grid: Sequence[Sequence[str]], spare: Sequence[str] = (), machine: Machine = machine_of,
                holds: Mapping[str, int] | None = None) -> Grid:
    """``grid`` (rows: pipelines) with every fatal pair on two machines, using ``spare`` nodes as well where that
    helps; where the machines cannot do it, the layout with the fewest fatal pairs on one machine.

    ``grid`` itself when it already keeps every pair apart. Else a layout built from the machines' counts (each
    machine gives its nodes up to a common level, dealt evenly over the pipelines, then laid round each ring so that
    no pair meets where the counts allow: the fewest pairs on one machine, ``tests/test_fatal_pairs.py`` checks it
    against every layout of small fleets), or, where ``holds`` (node -> the stage whose layers it holds) keeps more
    nodes in place with as few pairs, ``grid`` repaired by the swaps that remove the most pairs.
    """
    rows = [list(row) for row in grid]
    if not rows or not shared_pairs(rows, machine):
        return tuple(tuple(row) for row in rows)
    holds = holds or {}
    built = _build([n for row in rows for n in row] + list(spare), len(rows), len(rows[0]), machine, holds)
    if not holds:  # no node holds a stage yet: nothing to keep in place
        return tuple(tuple(row) for row in built)
    repaired = _repair(rows, list(spare), machine, holds)

    def score(candidate: list[list[str]]) -> tuple[int, int]:
        return len(shared_pairs(candidate, machine)), _off_stage(candidate, holds)

    best = min((repaired, built), key=score)  # the repaired grid on a tie: it keeps the caller's order
    return tuple(tuple(row) for row in best)


def _off_stage(rows: Sequence[Sequence[str]], holds: Mapping[str, int]) -> int:
    return sum(holds.get(n) != s for row in rows for s, n in enumerate(row))


def _repair(rows: list[list[str]], spare: list[str], machine: Machine, holds: Mapping[str, int]) -> list[list[str]]:
    """Swap two placed nodes, or a placed node for a spare one, as long as that removes pairs from one machine: the
    swap that removes the most, then moves the fewest nodes off their stage, first."""
    rows, spare = [list(r) for r in rows], list(spare)
    stages = len(rows[0])
    partners: dict[int, list[int]] = {s: [] for s in range(stages)}
    for a, b in fatal_stage_pairs(stages):
        partners[a].append(b)
        partners[b].append(a)
    slots = [(p, s) for p in range(len(rows)) for s in range(stages)]

    def clashes(p: int, s: int) -> int:
        m = machine(rows[p][s])
        return sum(machine(rows[p][t]) == m for t in partners[s])

    def local(a: tuple[int, int], b: tuple[int, int] | None) -> int:
        count = clashes(*a) + (clashes(*b) if b is not None else 0)
        if b is not None and a[0] == b[0] and b[1] in partners[a[1]] and machine(rows[a[0]][a[1]]) == machine(
                rows[b[0]][b[1]]):
            count -= 1  # the pair of a and b, counted from both ends
        return count

    def moved(node: str, s: int) -> int:
        return int(holds.get(node) != s)

    while True:
        best: tuple[int, int, int, int] | None = None  # (pairs removed, nodes moved, slot a, other: slot or spare)
        for i, (p, s) in enumerate(slots):
            if not clashes(p, s):
                continue
            x = rows[p][s]
            for j, (q, t) in enumerate(slots):
                if j == i or machine(rows[q][t]) == machine(x):
                    continue
                y = rows[q][t]
                before = local((p, s), (q, t))
                rows[p][s], rows[q][t] = y, x
                gain = before - local((p, s), (q, t))
                rows[p][s], rows[q][t] = x, y
                cost = moved(y, s) + moved(x, t) - moved(x, s) - moved(y, t)
                if gain > 0 and (best is None or (-gain, cost) < (-best[0], best[1])):
                    best = (gain, cost, i, j)
            for k, y in enumerate(spare):
                before = local((p, s), None)
                rows[p][s] = y
                gain = before - local((p, s), None)
                rows[p][s] = x
                cost = moved(y, s) - moved(x, s)
                if gain > 0 and (best is None or (-gain, cost) < (-best[0], best[1])):
                    best = (gain, cost, i, len(slots) + k)
        if best is None:
            return rows
        (p, s), other = slots[best[2]], best[3]
        if other < len(slots):
            q, t = slots[other]
            rows[p][s], rows[q][t] = rows[q][t], rows[p][s]
        else:
            rows[p][s], spare[other - len(slots)] = spare[other - len(slots)], rows[p][s]


def _counts(capacities: dict[str, int], pipelines: int, stages: int) -> list[dict[str, int]]:
    """How many nodes of each ring each machine gives. Each machine gives ``min(c, L)`` in all, at the lowest level
    ``L`` that gives enough (the spare nodes stay on the largest machines), and the rings share a machine's nodes
    evenly: its nodes are dealt round the rings in turn, machine after machine, the largest first."""
    need = pipelines * stages
    level = next(v for v in range(max(capacities.values(), default=0) + 1)
                 if sum(min(c, v) for c in capacities.values()) >= need)
    given = {m: min(c, level) for m, c in capacities.items()}
    for m in reversed(list(given)):  # too many at the level: the last machines at it give one less
        if sum(given.values()) == need:
            break
        if given[m] == level:
            given[m] -= 1
    dealt = [m for m in sorted(given, key=lambda m: -given[m]) for _ in range(given[m])]
    rings: list[dict[str, int]] = [{} for _ in range(pipelines)]
    for i, m in enumerate(dealt):
        rings[i % pipelines][m] = rings[i % pipelines].get(m, 0) + 1
    return rings


def _arrange(counts: dict[str, int], stages: int) -> list[str]:
    """The machine of each stage of a ring with ``counts`` nodes per machine: the largest machine first on every
    other place round the ring (0, 2, 4, .., then 1, 3, ..), so that neighbours differ wherever the counts allow, then
    turned so that the chord (stage 0, stage S - 2) joins two machines where any three consecutive places do."""
    ranked = sorted((m for m in counts if counts[m]), key=lambda m: -counts[m])
    flat = [m for m in ranked for _ in range(counts[m])]
    places = list(range(0, stages, 2)) + list(range(1, stages, 2))
    ring = [""] * stages
    for place, m in zip(places, flat, strict=True):
        ring[place] = m
    if stages < 4:
        return ring
    x = next((x for x in range(stages) if ring[x] != ring[(x + 2) % stages]), 0)
    return [ring[(stage + x + 2) % stages] for stage in range(stages)]  # place x is stage S - 2, x + 2 stage 0


def _build(nodes: list[str], pipelines: int, stages: int, machine: Machine,
           holds: Mapping[str, int]) -> list[list[str]]:
    """A layout of ``pipelines`` rings made from the machines' counts of ``nodes``; each machine's nodes go first to
    the stages they hold, then in ``nodes`` order (placed nodes before spare ones)."""
    by_machine: dict[str, list[str]] = {}
    for n in nodes:
        by_machine.setdefault(machine(n), []).append(n)
    pattern = [_arrange(counts, stages) for counts in _counts({m: len(ns) for m, ns in by_machine.items()},
                                                               pipelines, stages)]
    rows: list[list[str | None]] = [[None] * stages for _ in range(pipelines)]
    for p in range(pipelines):
        for s in range(stages):
            pool = by_machine[pattern[p][s]]
            if (keep := next((n for n in pool if holds.get(n) == s), None)) is not None:
                rows[p][s] = keep
                pool.remove(keep)
    for p in range(pipelines):
        for s in range(stages):
            if rows[p][s] is None:
                rows[p][s] = by_machine[pattern[p][s]].pop(0)
    return [[n for n in row if n is not None] for row in rows]


def apart_warning(grid: Sequence[Sequence[str]], available: Sequence[str] = (), machine: Machine = machine_of,
                  where: str = "the layout", fix: str | None = None, kept: Sequence[bool] | None = None) -> str | None:
    """One line for a log's WARNING when ``grid`` puts a fatal pair on one machine (None when it does not): the
    pairs and their machine, whether the ``available`` nodes (placed ones included) could keep them apart (``fix``:
    how, where they can), and, where they cannot, the rule and what would. ``where``: which layout. ``kept``: the
    stages whose replicas the layout keeps (``redundancy="auto"``; None: every one): only their pairs count."""
    shared = shared_pairs(grid, machine, kept)
    if not shared:
        return None
    stages, pipelines = len(grid[0]), len(grid)
    position = {n: (p, s) for p, row in enumerate(grid) for s, n in enumerate(row)}

    def name(n: str) -> str:
        p, s = position[n]
        return f"{n} (stage {s}" + (f" of pipeline {p})" if pipelines > 1 else ")")

    listed = "; ".join(f"{name(a)} and {name(b)} on {m}" for a, b, m in shared[:6])
    listed += f"; ... {len(shared) - 6} more" if len(shared) > 6 else ""
    nodes = list(dict.fromkeys([*(n for row in grid for n in row), *available]))
    counts: dict[str, int] = {}
    for n in nodes:
        counts[machine(n)] = counts.get(machine(n), 0) + 1
    machines = ", ".join(f"{m}: {c}" for m, c in sorted(counts.items(), key=lambda mc: -mc[1]))
    head = (f"{where} puts {len(shared)} pair(s) of nodes whose joint loss is fatal on one machine ({listed}); losing "
            f"such a machine restarts the job from its last checkpoint. The {len(nodes)} node(s) on {len(counts)} "
            f"machine(s) ({machines})")
    if apart_possible(list(counts.values()), pipelines, stages):
        return f"{head} can keep every such pair apart: {fix or 'the next reconfiguration re-places them'}"
    depths = [d for d in range(2, len(nodes) + 1)
              if len(nodes) % d == 0 and apart_possible(list(counts.values()), len(nodes) // d, d)]
    return (f"{head} cannot, whatever the placement (rule: a pipeline of {stages} stages has at most "
            f"{most_on(1, stages)} node(s) on one machine and {most_on(2, stages)} on two; {pipelines} such "
            f"pipeline(s) need {pipelines * stages} nodes); fix: more machines"
            + (f", or a depth of {' or '.join(map(str, depths))}" if depths else ""))
