"""No machine holds two nodes whose joint loss is fatal (pure): the pairs come from the failover planner, the counting
rule says when machines can keep them apart, and every layout the policy builds does so or says why it cannot.

A *fatal pair* is two nodes of one pipeline that the failover planner cannot lose together. The helpers here work
them out from ``plan_failover`` and search every layout of small fleets by brute force, so the module under test
(``topology.apart``) is checked against the planner and an exhaustive search, not against itself.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from functools import cache

import pytest

from lightning_bamboo.errors import FatalLoss
from lightning_bamboo.launcher import job_nodes
from lightning_bamboo.runtime.rebalance import Rebalancer
from lightning_bamboo.topology import (
    Placement,
    PolicyConfig,
    machine_of,
    plan_failover,
    plan_loss,
    reconfigure,
)

# ---------------------------------------------------------------------- the planner's word, by brute force


@cache
def planner_pairs(stages: int) -> tuple[tuple[int, int], ...]:
    """The stage pairs whose joint loss ``plan_failover`` refuses (FatalLoss)."""
    nodes = [f"n{s}" for s in range(stages)]
    pairs = []
    for a, b in itertools.combinations(range(stages), 2):
        try:
            plan_failover(nodes, range(stages + 1), {nodes[a], nodes[b]})
        except FatalLoss:
            pairs.append((a, b))
    return tuple(pairs)


def on_one_machine(grid: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
    """The fatal pairs of ``grid`` (rows: pipelines) whose two nodes share a machine (``machine_of``)."""
    return [(row[a], row[b]) for row in grid for a, b in planner_pairs(len(row))
            if machine_of(row[a]) == machine_of(row[b])]


@cache
def ring_fewest(counts: tuple[int, ...], stages: int) -> int:
    """The fewest fatal pairs on one machine over every way to lay a ring with ``counts`` nodes per machine."""
    labels = [m for m, c in enumerate(counts) for _ in range(c)]
    return min(sum(ring[a] == ring[b] for a, b in planner_pairs(stages))
               for ring in set(itertools.permutations(labels)))


@cache
def fewest(capacities: tuple[int, ...], pipelines: int, stages: int) -> int:
    """The fewest fatal pairs on one machine over every layout of ``pipelines`` rings on machines with ``capacities``
    usable nodes (every split of each machine's nodes over the rings, every order round each ring)."""
    if pipelines == 0:
        return 0
    best = None
    for take in itertools.product(*(range(min(c, stages) + 1) for c in capacities)):
        if sum(take) != stages:
            continue
        left = tuple(sorted(c - t for c, t in zip(capacities, take, strict=True)))
        cost = ring_fewest(tuple(sorted(t for t in take if t)), stages) + fewest(left, pipelines - 1, stages)
        best = cost if best is None else min(best, cost)
    assert best is not None, (capacities, pipelines, stages)
    return best


def fleet_nodes(capacities: Sequence[int]) -> list[str]:
    return [f"m{i}.{w}" for i, c in enumerate(capacities) for w in range(c)]


# ---------------------------------------------------------------------- the pairs


def test_the_fatal_pairs_are_the_neighbours_and_stage_0_with_stage_s_minus_2():
    from lightning_bamboo.topology import fatal_stage_pairs

    assert fatal_stage_pairs(1) == ()  # one stage: no replica, nothing to keep apart
    assert fatal_stage_pairs(2) == ((0, 1),)
    assert fatal_stage_pairs(3) == ((0, 1), (0, 2), (1, 2))
    assert fatal_stage_pairs(4) == ((0, 1), (0, 2), (0, 3), (1, 2), (2, 3))
    assert fatal_stage_pairs(6) == ((0, 1), (0, 4), (0, 5), (1, 2), (2, 3), (3, 4), (4, 5))
    for stages in range(2, 13):
        assert fatal_stage_pairs(stages) == planner_pairs(stages)
        ring = {tuple(sorted((s, (s + 1) % stages))) for s in range(stages)}
        assert set(fatal_stage_pairs(stages)) == ring | ({(0, stages - 2)} if stages >= 3 else set())


@pytest.mark.parametrize("stages", range(2, 10))
def test_a_loss_without_a_fatal_pair_is_always_served(stages):
    """What keeping the pairs apart buys: a machine's loss (any set of nodes) holding no fatal pair of a pipeline is
    served by the failover planner, every layer once."""
    nodes = [f"n{s}" for s in range(stages)]
    pairs = planner_pairs(stages)
    served = 0
    for k in range(1, stages):
        for lost in itertools.combinations(range(stages), k):
            if any(a in lost and b in lost for a, b in pairs):
                continue
            plan = plan_failover(nodes, range(stages + 1), {nodes[s] for s in lost})
            assert len(plan.order) == stages - k and plan.parts == (*plan.parts[:-1], stages)
            served += 1
    assert served >= stages  # every single loss at least


def test_several_pipelines_survive_a_machine_that_hits_each_of_them_without_a_fatal_pair():
    """Each pipeline is its own ring: m2 holds stages 1 and 3 of pipeline 0 and stage 1 of pipeline 1, no fatal pair
    of either. Losing m2 hits both, so one of them must fail over on its own: pipeline 1, which keeps 3 nodes."""
    grid = [["m0.0", "m2.0", "m1.0", "m2.1"], ["m1.1", "m2.2", "m0.1", "m3.0"]]
    order = [row[s] for s in range(4) for row in grid]
    assert on_one_machine(grid) == []
    plan = plan_loss(order, 2, [0, 2, 4, 6, 8], {"m2.0", "m2.1", "m2.2"})
    assert plan.order == ("m1.1", "m0.1", "m3.0") and plan.released == ("m0.0", "m1.0")
    for machine in ("m0", "m1", "m3"):
        plan_loss(order, 2, [0, 2, 4, 6, 8], {n for n in order if machine_of(n) == machine})  # never FatalLoss


def test_a_failover_that_must_pick_a_pipeline_picks_the_one_whose_new_ring_keeps_the_pairs_apart():
    """Machine m0 held stage 0 of pipeline 0 and stage 2 of pipeline 1; each keeps 3 nodes, in two different layer
    splits, so only one can fail over (with no data moved). Pipeline 0's new ring (m1.1 runs stage 0, m1.0, m2.0) is
    a ring of 3, all of whose pairs are fatal, with two nodes on m1; pipeline 1's has three machines. The planner
    keeps pipeline 1, though pipeline 0 comes first."""
    grid = [["m0.0", "m1.0", "m2.0", "m1.1"], ["m3.0", "m4.0", "m0.1", "m5.0"]]
    order = [row[s] for s in range(4) for row in grid]
    assert on_one_machine(grid) == []  # m1 holds stages 1 and 3 of pipeline 0: not a fatal pair
    plan = plan_loss(order, 2, [0, 2, 4, 6, 8], {"m0.0", "m0.1"})
    assert plan.order == ("m3.0", "m4.0", "m5.0") and plan.rows == (tuple(grid[1]),)
    assert plan.released == ("m1.0", "m2.0", "m1.1")
    assert on_one_machine([plan.order]) == []
    assert plan_failover(grid[0], [0, 2, 4, 6, 8], {"m0.0"}).order == ("m1.1", "m1.0", "m2.0")  # the other one


def test_a_machine_holding_one_stage_of_every_pipeline_leaves_them_all_failing_over_alike():
    """Machine m0 held stage 0 of both pipelines: both fail over to the same layer split, so both train on (two
    pipelines of 3 nodes, nobody released), though pipeline 0's new ring puts a fatal pair on m1: a failover moves no
    data, and a node released would stand idle until a reconfiguration took it back."""
    grid = [["m0.0", "m1.0", "m2.0", "m1.1"], ["m0.1", "m3.0", "m4.0", "m5.0"]]
    order = [row[s] for s in range(4) for row in grid]
    plan = plan_loss(order, 2, [0, 2, 4, 6, 8], {"m0.0", "m0.1"})
    assert plan.order == ("m1.1", "m5.0", "m1.0", "m3.0", "m2.0", "m4.0") and plan.pipelines == 2
    assert plan.parts == (0, 2, 4, 8) and plan.released == () and plan.rows == tuple(map(tuple, grid))


# ---------------------------------------------------------------------- the counting rule and the builder


def small_fleets():
    """Every fleet of 1..4 machines with 1..4 usable nodes each, and every shape of at most 10 nodes it can run."""
    for machines in range(1, 5):
        for capacities in itertools.combinations_with_replacement(range(1, 5), machines):
            total = sum(capacities)
            for stages in range(2, 7):
                for pipelines in range(1, total // stages + 1):
                    if pipelines * stages <= 10:
                        yield tuple(sorted(capacities, reverse=True)), pipelines, stages


def test_apart_possible_is_exactly_what_an_exhaustive_search_finds():
    from lightning_bamboo.topology import apart_possible

    cases = list(small_fleets())
    assert len(cases) > 300
    for capacities, pipelines, stages in cases:
        assert apart_possible(capacities, pipelines, stages) == (fewest(capacities, pipelines, stages) == 0), (
            capacities, pipelines, stages)


def test_place_apart_finds_the_fewest_pairs_on_one_machine_for_every_small_fleet():
    from lightning_bamboo.topology import place_apart

    rng = random.Random(61)
    for capacities, pipelines, stages in small_fleets():
        nodes = fleet_nodes(capacities)
        rng.shuffle(nodes)
        need = pipelines * stages
        grid = [nodes[p * stages:(p + 1) * stages] for p in range(pipelines)]
        placed = place_apart(grid, nodes[need:])
        assert len(placed) == pipelines and all(len(row) == stages for row in placed)
        assert len({n for row in placed for n in row}) == need and {n for row in placed for n in row} <= set(nodes)
        assert len(on_one_machine(placed)) == fewest(capacities, pipelines, stages), (capacities, pipelines, stages)


def test_a_layout_that_keeps_every_pair_apart_is_left_as_it_is():
    from lightning_bamboo.topology import place_apart

    grid = (("m0.0", "m1.0", "m2.0", "m0.1", "m1.1", "m2.1"),)
    assert place_apart(grid, ["m3.0"]) == grid


def test_place_apart_keeps_nodes_on_the_stage_they_hold_and_moves_the_fewest():
    from lightning_bamboo.topology import place_apart

    # a 6-deep ring where m2.0 (stage 0) and m2.1 (stage 4) are a fatal pair on m2; m3.0 stands by
    grid = [["m2.0", "m0.0", "m1.0", "m0.1", "m2.1", "m1.1"]]
    holds = {n: s for s, n in enumerate(grid[0])}
    placed = place_apart(grid, ["m3.0"], holds=holds)
    assert on_one_machine(placed) == []
    assert sum(holds.get(n) != s for s, n in enumerate(placed[0])) == 1  # one node replaced, the others stay


@pytest.mark.parametrize("capacities, pipelines, stages", [((8, 8, 8, 8, 8, 8, 8, 8), 4, 16),
                                                           ((9, 7, 7, 5, 4, 4), 3, 12),
                                                           ((6, 6, 6, 6), 2, 12), ((30, 30, 4), 8, 8)])
def test_large_fleets_keep_every_pair_apart_where_the_counting_rule_allows_and_not_elsewhere(
        capacities, pipelines, stages):
    from lightning_bamboo.topology import apart_possible, place_apart

    nodes = fleet_nodes(capacities)
    random.Random(stages).shuffle(nodes)
    need = pipelines * stages
    placed = place_apart([nodes[p * stages:(p + 1) * stages] for p in range(pipelines)], nodes[need:])
    assert (on_one_machine(placed) == []) == apart_possible(capacities, pipelines, stages)


# ---------------------------------------------------------------------- every layout the policy builds


def usable_counts(nodes: Sequence[str]) -> tuple[int, ...]:
    counts: dict[str, int] = {}
    for n in nodes:
        counts[machine_of(n)] = counts.get(machine_of(n), 0) + 1
    return tuple(sorted(counts.values(), reverse=True))


def small(decision, usable: Sequence[str]) -> bool:
    """Whether an exhaustive search over every layout of ``usable`` is quick for ``decision``'s shape."""
    return decision.layout.pipelines * decision.layout.stages <= 10 and len(usable_counts(usable)) <= 5


def check_layout(decision, usable: Sequence[str]) -> int:
    """A layout the policy built: no fatal pair on one machine, or (a small fleet) no layout of ``usable`` has
    fewer, by exhaustive search. A layout with none survives the loss of any one machine. Returns its pairs on one
    machine."""
    layout = decision.layout
    shared = on_one_machine(layout.grid)
    if shared and small(decision, usable):
        assert len(shared) == fewest(usable_counts(usable), layout.pipelines, layout.stages), (decision, usable)
    for machine in {machine_of(n) for n in layout.nodes} if not shared and layout.stages > 1 else ():
        lost = {n for n in layout.nodes if machine_of(n) == machine}
        plan_loss(layout.order, layout.pipelines, layout.parts, lost)  # never FatalLoss (1 stage: no replica)
    return len(shared)


def check_warning(decision) -> None:
    """The decision's warning names each fatal pair on one machine and the machine, and says no layout avoids it;
    a layout without such a pair has none."""
    shared = on_one_machine(decision.layout.grid)
    if not shared:
        assert decision.warning is None, decision
        return
    assert decision.warning is not None and "cannot, whatever the placement" in decision.warning
    assert decision.warning.startswith(f"the {decision.action} layout puts {len(shared)} pair(s) of nodes whose joint "
                                       "loss is fatal on one machine")
    for a, b in shared:
        assert f"{a} (stage " in decision.warning and f"{b} (stage " in decision.warning
        assert f"on {machine_of(a)}" in decision.warning


def run_policy(seed: int) -> list[tuple[object, list[str]]]:
    """Random machines of K workers, and a run of machine losses, worker losses and machines joining, each followed
    by the policy's decision. Returns every layout it built, with the nodes it could use."""
    rng = random.Random(seed)
    workers = rng.randint(1, 6)
    stages = rng.randint(2, 8)
    config = PolicyConfig(stages=stages, layers=2 * stages, global_micro_batches=rng.choice([1, 2, 4, 8]),
                          min_stages=rng.choice([1, 2]), max_overloaded_fraction=rng.choice([0.05, 0.5, 1.0]))
    machines = [f"host{i}" for i in range(rng.randint(1, 6))]
    alive = job_nodes(machines, workers, None)
    layout: Placement | None = None
    standby = list(alive)
    built = []
    for _event in range(rng.randint(4, 9)):
        if layout is not None:
            lost = [n for n in layout.nodes if n not in alive]
            overloaded = sorted({layout.replica_holder(n) for n in lost} & set(alive))
        else:
            overloaded = []
        live = [*(n for n in (layout.nodes if layout else ()) if n in alive), *standby]
        # the rebalancer passes each node's machine as its failure domain; without domains it is the same
        domains = {n: machine_of(n) for n in live} if seed % 2 == 0 else None
        decision = reconfigure(live, standby, layout, overloaded, config, domains)
        if decision.layout is not None and decision.layout is not layout:
            built.append((decision, live))
        layout = decision.layout
        standby = [n for n in live if layout is None or n not in layout.nodes]
        event = rng.choice(["machine", "worker", "join", "join"] if len(alive) > 1 else ["join"])
        if event == "machine":
            gone = machine_of(rng.choice(alive))
            alive = [n for n in alive if machine_of(n) != gone]
        elif event == "worker":
            alive.remove(rng.choice(alive))
        else:
            machines.append(f"host{len(machines)}")
            alive += [f"{machines[-1]}.{w}" for w in range(workers)]
        standby = [n for n in standby if n in alive] + [n for n in alive if n not in live]
    return built


def test_every_layout_the_policy_builds_keeps_fatal_pairs_apart_or_the_machines_cannot():
    built = [layout for seed in range(400) for layout in run_policy(seed)]
    with_pairs = [(decision, usable) for decision, usable in built if check_layout(decision, usable)]
    assert len(built) > 1000 and 0 < len(with_pairs) < len(built)  # both kinds of fleet came up
    from lightning_bamboo.topology import apart_possible

    for decision, usable in with_pairs:  # larger fleets: the counting rule (checked exhaustively above) says so
        layout = decision.layout
        assert not apart_possible(usable_counts(usable), layout.pipelines, layout.stages), (decision, usable)
    assert any(not small(decision, usable) for decision, usable in with_pairs)
    for decision, _usable in built:
        check_warning(decision)


# ---------------------------------------------------------------------- what the issue saw


def test_three_machines_of_two_after_a_machine_kill_a_join_and_a_depth_change_survive_any_machine_cut():
    """Issue 61 item 3: machines host1, host2, host0 (in the order they registered) of two workers, one pipeline
    of six. host1 is killed (its two workers, stages 1 and 4 of the interleaved order), host3 joins, the
    rebalancer goes back to depth 6. That layout put host2.0 at stage 0 and host2.1 at stage 4: cutting host2 off
    was fatal (stage 0's holder, the last node, had to hand stage 5 to host2.1)."""
    parts = tuple(range(0, 13, 2))
    start = job_nodes(["host1", "host2", "host0"], 2)
    rebalancer = Rebalancer(stages=6)
    rebalancer.begin(Placement((tuple(start),), parts, (8,)), None)
    failover = plan_loss(start, 1, parts, {"host1.0", "host1.1"})
    shallow = rebalancer.decide(list(failover.order), [], 12)
    assert shallow.action == "restore_redundancy" and shallow.layout.stages == 4
    assert len(on_one_machine(shallow.layout.grid)) == 1  # two machines cannot hold a ring of 4: said so
    rebalancer.layout = shallow.layout
    deep = rebalancer.decide(list(shallow.layout.order), ["host3.0", "host3.1"], 12)
    assert deep.action == "change_depth" and deep.layout.stages == 6
    for machine in ("host0", "host2", "host3"):  # whichever machine is cut off next, the job fails over
        lost = {f"{machine}.0", f"{machine}.1"}
        plan = plan_loss(list(deep.layout.order), 1, deep.layout.parts, lost)
        assert len(plan.order) == 4 and not lost & set(plan.order)
    assert on_one_machine(deep.layout.grid) == [] and deep.warning is None
    assert shallow.warning is not None and "host2.0 (stage 0) and host2.1 (stage 2) on host2" in shallow.warning


def test_a_restart_after_a_fatal_loss_places_the_survivors_apart():
    """After a fatal loss every survivor loads its stage from the checkpoint, so the restarted layout may put them
    anywhere: the survivors of a 6-deep pipeline, in their old order, have stage 0 and stage 4 on host2."""
    from lightning_bamboo.runtime.restart import restart_order, restart_shape

    survivors = ["host2.0", "host0.0", "host3.0", "host0.1", "host2.1", "host3.1"]
    assert on_one_machine([survivors]) == [("host2.0", "host2.1")]
    pipelines, depth = restart_shape(len(survivors), 6, 6, 4)
    assert (pipelines, depth) == (1, 6)
    order = restart_order(survivors, depth)
    assert sorted(order) == sorted(survivors) and on_one_machine([order]) == []
    apart = ["host0.0", "host2.0", "host3.0", "host0.1", "host2.1", "host3.1"]
    assert restart_order(apart, 6) == apart  # already apart: the ranks stay


def test_the_rebalancer_keeps_the_policys_warning_when_the_tuner_splits_the_layers():
    """Two machines left for a ring of 4: no layout keeps stage 0 and stage 2 apart. The tuner's layer split
    replaces the policy's parts, not what the policy said about the machines."""
    rebalancer = Rebalancer(stages=4)
    rebalancer.begin(Placement((("a.0", "b.0", "c.0", "b.1"),), (0, 2, 4, 6, 8), (4,)), None)
    rebalancer.split_for = lambda stages, micro_batch_size, micro_batches, pipelines: (0, 1, 4, 6, 8)[:stages + 1]
    decision = rebalancer.decide(["a.0", "b.0", "b.1"], ["a.1"], 8)  # c lost: its stage goes to a standby
    assert decision.layout.parts == (0, 1, 4, 6, 8) and "layer split by HydrozoaTuner" in decision.reason
    assert len(on_one_machine(decision.layout.grid)) == 1
    assert decision.warning is not None and "cannot, whatever the placement" in decision.warning
