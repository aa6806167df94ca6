"""The reconfiguration policy: one test per rule, placement that moves little state, clear errors."""

from __future__ import annotations

import pytest

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology import (
    Decision,
    Layout,
    Placement,
    PolicyConfig,
    balanced_parts,
    even_parts,
    fresh_placement,
    reconfigure,
    shape_for,
    split_micro_batches,
    step_units,
)

CFG = PolicyConfig(stages=3, layers=6, global_micro_batches=12, min_stages=2, max_overloaded_fraction=0.05)
#: the same job with a model that needs 3 stages: four nodes make one pipeline of 3 and a standby node
CFG3 = PolicyConfig(stages=3, layers=6, global_micro_batches=12, min_stages=3, max_overloaded_fraction=0.05)


def names(n: int, prefix: str = "n") -> list[str]:
    return [f"{prefix}{i}" for i in range(1, n + 1)]


def layout_of(rows: list[list[str]], cfg: PolicyConfig = CFG) -> Placement:
    return Placement(
        tuple(tuple(r) for r in rows),
        cfg.parts(len(rows[0])),
        split_micro_batches(cfg.global_micro_batches, len(rows)),
    )


def test_start_places_nodes_column_by_column_and_keeps_the_rest_standby():
    d = reconfigure(names(7), names(7), None, (), CFG)
    assert d.action == "start"
    # node i -> pipeline i % 2, stage i // 2: consecutive nodes never share a pipeline
    assert d.layout.grid == (("n1", "n3", "n5"), ("n2", "n4", "n6"))
    assert d.layout.parts == (0, 2, 4, 6)
    assert d.layout.micro_batches == (6, 6)  # global batch fixed: 12 micro-batches over 2 pipelines
    assert set(d.moved) == set(names(6))


def test_a_placement_numbers_its_nodes_as_its_layout_numbers_ranks():
    placement = Placement((("a0", "a1", "a2"), ("b0", "b1", "b2")), (0, 2, 3, 6), (3, 3))
    layout = placement.layout
    assert layout == Layout(stages=3, pipelines=2, parts=(0, 2, 3, 6))
    assert placement.order == ("a0", "b0", "a1", "b1", "a2", "b2")  # the grid read column by column
    for rank, node in enumerate(placement.order):
        assert placement.position(node) == (layout.pipeline_of_rank(rank), layout.stage_of_rank(rank))
        assert placement.stage_layers(node) == (layout.parts[layout.stage_of_rank(rank)],
                                                layout.parts[layout.stage_of_rank(rank) + 1])


def test_keep_when_nothing_changed():
    old = layout_of([["a", "b", "c"]])
    d = reconfigure(["a", "b", "c", "x"], ["x"], old, (), CFG3)
    assert d.action == "keep" and d.layout is old and not d.changed


def test_rebalance_puts_a_standby_node_in_the_lost_place_and_moves_nothing_else():
    old = layout_of([["a", "b", "c"], ["d", "e", "f"]])
    # e lost: d (its replica holder) runs both stages
    d = reconfigure(["a", "b", "c", "d", "f", "x"], ["x"], old, ["d"], CFG)
    assert d.action == "rebalance"
    assert d.layout.grid == (("a", "b", "c"), ("d", "x", "f"))
    assert d.moved == ("x",)


def test_standby_nodes_that_relieve_a_loss_and_could_all_train_make_the_shape_that_trains_them_at_once():
    # one pipeline of 3 failed over (c lost, b runs both stages), two released survivors back as standby: relieving
    # c with one of them would leave the other idle until a second reconfiguration; 4 nodes train as 2 x 2 now
    old = layout_of([["a", "b", "c"]])
    d = reconfigure(["a", "b", "x", "y"], ["x", "y"], old, ["b"], CFG)
    assert d.action == "change_depth", d
    assert len(d.layout.grid) == 2 and d.layout.stages == 2 and set(d.layout.nodes) == {"a", "b", "x", "y"}
    # one standby node: relieving keeps the preferred depth and trains every node
    d = reconfigure(["a", "b", "x"], ["x"], old, ["b"], CFG)
    assert d.action == "rebalance" and d.layout.grid == (("a", "b", "x"),)


def test_add_pipeline_when_enough_standby_nodes_and_split_the_global_batch():
    cfg = PolicyConfig(stages=2, layers=4, global_micro_batches=7)
    old = layout_of([["a", "b"], ["c", "d"]], cfg)
    d = reconfigure(["a", "b", "c", "d", "x", "y"], ["x", "y"], old, (), cfg)
    assert d.action == "add_pipeline"
    assert d.layout.grid[:2] == old.grid  # running pipelines untouched
    assert sorted(d.layout.grid[2]) == ["x", "y"]
    assert d.layout.micro_batches == (3, 2, 2) and sum(d.layout.micro_batches) == 7
    assert sorted(d.moved) == ["x", "y"]


def test_without_a_fixed_global_batch_every_pipeline_keeps_its_micro_batches():
    cfg = PolicyConfig(stages=2, layers=4, global_micro_batches=2, pipeline_micro_batches=5)
    d = reconfigure(names(6), names(6), None, (), cfg)
    assert d.layout.pipelines == 3 and d.layout.micro_batches == (5, 5, 5)  # not capped at 2 pipelines


def test_pipelines_never_exceed_the_global_micro_batches():
    cfg = PolicyConfig(stages=1, layers=2, global_micro_batches=2)
    d = reconfigure(names(5), names(5), None, (), cfg)
    assert d.layout.pipelines == 2


def test_keep_running_degraded_while_the_overloaded_share_is_small():
    rows = [[f"p{p}s{s}" for s in range(3)] for p in range(12)]  # 36 nodes
    old = layout_of(rows)
    live = [n for n in old.nodes if n != "p0s1"]
    d = reconfigure(
        live, [], old, ["p0s0"], CFG.__class__(**{**CFG.__dict__, "max_overloaded_fraction": 0.1})
    )
    # 2 * 1 / 35 = 5.7% <= 10%: keep
    assert d.action == "keep"
    d = reconfigure(live, [], old, ["p0s0"], CFG)  # > 5%: rebuild with 11 pipelines
    assert d.action == "restore_redundancy"
    assert d.layout.pipelines == 11
    # the broken pipeline is dissolved; its survivors wait; nobody else moves
    assert d.moved == ()
    assert "p0s0" not in d.layout.nodes and "p0s2" not in d.layout.nodes


def test_restore_redundancy_fills_holes_with_nodes_that_already_hold_that_stage():
    old = layout_of([["a", "b", "c"], ["d", "e", "f"]])
    # b and f lost (not adjacent): a and e overloaded; 4 usable nodes of a model that needs 3 stages -> 1 x 3
    d = reconfigure(["a", "c", "d", "e"], [], old, ["a", "e"], CFG3)
    assert d.action == "restore_redundancy"
    # keep pipeline 0 (2 live), its stage-1 hole gets e, which runs stage 1 already
    assert d.layout.grid == (("a", "e", "c"),)
    assert d.moved == ()


def test_change_depth_when_too_few_nodes_remain_and_back_when_they_return():
    old = layout_of([["a", "b", "c"]])
    d = reconfigure(["a", "c"], [], old, ["a"], CFG)
    assert d.action == "restore_redundancy"
    assert d.layout.stages == 2 and d.layout.parts == (0, 3, 6)
    assert d.layout.micro_batches == (12,)
    d2 = reconfigure(["a", "c", "x"], ["x"], d.layout, (), CFG)
    assert d2.action == "change_depth" and d2.layout.stages == 3


def test_one_pipeline_below_its_preferred_depth_grows_by_every_node_that_stands_by():
    """A lone survivor restarted from a checkpoint, or a job that started on fewer nodes than its preferred depth,
    runs one pipeline below that depth: standby nodes are taken at once, even fewer than the preferred depth (a job
    grows past its start; every live node trains). Several pipelines keep their depth and batch: a standby node
    waits there until it completes a pipeline."""
    cfg = PolicyConfig(stages=4, layers=8, global_micro_batches=4)
    alone = layout_of([["a"]], cfg)
    assert reconfigure(["a"], [], alone, (), cfg).action == "keep"
    d = reconfigure(["a", "x", "y"], ["x", "y"], alone, (), cfg)
    assert d.action == "change_depth" and d.layout.stages == 3 and d.layout.grid[0][0] == "a"
    pair = layout_of([["a", "b"]], cfg)
    d = reconfigure(["a", "b", "x"], ["x"], pair, (), cfg)
    assert d.action == "change_depth" and (d.layout.stages, d.layout.pipelines) == (3, 1)
    assert reconfigure(["a", "b", "c", "d"], [], layout_of([["a", "b", "c", "d"]], cfg), (), cfg).action == "keep"
    two = layout_of([["a", "b"], ["c", "d"]], PolicyConfig(stages=2, layers=8, global_micro_batches=4))
    assert reconfigure(["a", "b", "c", "d", "x"], ["x"], two,
                       (), PolicyConfig(stages=2, layers=8, global_micro_batches=4)).action == "keep"


def test_suspend_below_min_stages():
    old = layout_of([["a", "b", "c"]])
    d = reconfigure(["a"], [], old, [], CFG.__class__(**{**CFG.__dict__, "min_stages": 2}))
    assert d.action == "suspend" and d.layout is None
    assert "min_stages=2" in d.reason
    with pytest.raises(
        BambooConfigError, match=r"cannot train: 1 usable nodes left.*min_stages=2.*add nodes"
    ):
        d.require_layout()
    assert reconfigure(["a", "b"], ["a", "b"], None, (), CFG).require_layout().stages == 2


def test_recover_after_adjacent_losses():
    old = layout_of([["a", "b", "c"], ["d", "e", "f"]])
    # b and c lost: c's replica lived on b -> stage 2 of pipeline 0 is gone
    d = reconfigure(["a", "d", "e", "f"], [], old, ["a"], CFG3)
    assert d.action == "recover"
    assert d.layout.grid == (("d", "e", "f"),)
    # a model that fits 2 stages restarts on all four: 2 x 2
    d = reconfigure(["a", "d", "e", "f"], [], old, ["a"], CFG)
    assert d.action == "recover" and (d.layout.pipelines, d.layout.stages) == (2, 2)
    assert sorted(d.layout.nodes) == ["a", "d", "e", "f"]


def test_nodes_the_preferred_depth_leaves_idle_train_in_shallower_pipelines():
    """Every live node trains where min_stages allows: a depth that trains more nodes in a shorter step wins over the
    preferred one; a count the preferred depth divides keeps it; no pipeline of one stage (it has no replica)."""
    assert shape_for(4, CFG) == (2, 2) and shape_for(5, CFG) == (2, 2)
    assert shape_for(6, CFG) == (2, 3) and shape_for(7, CFG) == (2, 3)  # 3 x 2 trains no more nodes than 2 x 3
    assert shape_for(4, CFG3) == (1, 3)  # the model needs 3 stages: one node stands by
    assert shape_for(2, CFG) == (1, 2)
    loose = PolicyConfig(stages=3, layers=6, global_micro_batches=12, min_stages=1)
    assert shape_for(5, loose) == (2, 2)  # not 5 pipelines of one stage
    # a shorter step per micro-batch: 2 x 2 runs (6 + 1) / 2 units, 1 x 3 runs (12 + 2) / 3
    assert step_units(2, 2, CFG) < step_units(1, 3, CFG)
    # at the start, after a release came back, and after a loss: all four train
    assert reconfigure(names(4), names(4), None, (), CFG).layout.grid == (("n1", "n3"), ("n2", "n4"))
    d = reconfigure(["a", "b", "c", "x"], ["x"], layout_of([["a", "b", "c"]]), (), CFG)
    assert d.action == "change_depth" and (d.layout.pipelines, d.layout.stages) == (2, 2)
    assert sorted(d.layout.nodes) == ["a", "b", "c", "x"] and d.layout.micro_batches == (6, 6)
    old = layout_of([["a", "b", "c"], ["d", "e", "f"]])
    d = reconfigure(["a", "c", "d", "e"], [], old, ["a", "e"], CFG)
    assert d.action == "restore_redundancy" and (d.layout.pipelines, d.layout.stages) == (2, 2)
    # and back to the preferred depth once it trains every node
    d2 = reconfigure([*d.layout.nodes, "x", "y"], ["x", "y"], d.layout, (), CFG)
    assert d2.action == "change_depth" and (d2.layout.pipelines, d2.layout.stages) == (2, 3)
    assert reconfigure([*d2.layout.nodes], [], d2.layout, (), CFG).action == "keep"


def test_domains_keep_nodes_started_together_off_neighbouring_stages():
    cfg = PolicyConfig(stages=4, layers=4, global_micro_batches=4)
    domains = {"a": "z1", "b": "z1", "c": "z2", "d": "z2"}
    d = reconfigure(["a", "b", "c", "d"], ["a", "b", "c", "d"], None, (), cfg, domains)
    row = d.layout.grid[0]
    for s in range(4):
        assert domains[row[s]] != domains[row[(s + 1) % 4]], row
    # without domains the order is kept (and a, b are neighbours)
    assert reconfigure(["a", "b", "c", "d"], ["a", "b", "c", "d"], None, (), cfg).layout.grid[0] == (
        "a",
        "b",
        "c",
        "d",
    )


def test_balanced_parts_minimise_the_widest_stage():
    assert balanced_parts([1, 1, 1, 3], 2) == (0, 3, 4)
    assert balanced_parts([1, 1, 1, 1], 2) == even_parts(4, 2) == (0, 2, 4)
    parts = balanced_parts([5, 1, 1, 1, 1, 1, 5], 3)
    assert len(parts) == 4 and parts[0] == 0 and parts[-1] == 7
    loads = [sum([5, 1, 1, 1, 1, 1, 5][a:b]) for a, b in zip(parts, parts[1:], strict=False)]
    assert max(loads) == 5


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: reconfigure(["a"], ["b"], None, (), CFG), ["standby nodes must be live", "'b'"]),
        (lambda: reconfigure(["a", "a"], [], None, (), CFG), ["appears twice"]),
        (
            lambda: reconfigure(["a", "b", "c", "x"], [], layout_of([["a", "b", "c"]]), (), CFG),
            ["layout or standby", "'x'"],
        ),
        (
            lambda: reconfigure(["a", "b", "c"], [], layout_of([["a", "b", "c"]]), ["a"], CFG),
            ["reported overloaded", "successor 'b' is live"],
        ),
        (lambda: PolicyConfig(stages=4, layers=3, global_micro_batches=1), ["layers: 3", "stages: 4"]),
        (lambda: PolicyConfig(stages=2, layers=4, global_micro_batches=1, min_stages=3), ["min_stages"]),
        (lambda: PolicyConfig(stages=2, layers=2, global_micro_batches=0), ["global_micro_batches"]),
        (
            lambda: PolicyConfig(stages=2, layers=2, global_micro_batches=1, layer_costs=(1.0,)),
            ["layer_costs"],
        ),
        (lambda: Placement((("a", "b"), ("c",)), (0, 1, 2), (1, 1)), ["same number of stages"]),
        (lambda: Placement((("a", "b"),), (0, 2, 1), (1,)), ["strictly increasing"]),
        (lambda: Placement((("a", "b"),), (0, 1, 2), (0,)), ["micro_batches"]),
        (lambda: fresh_placement(["a"], 1, 2, CFG), ["need 2 nodes", "got 1"]),
        (lambda: split_micro_batches(1, 2), ["at least one micro-batch"]),
        (lambda: Decision("explode", None, ""), ["unknown action"]),
    ],
)
def test_errors_state_rule_values_and_fix(call, words):
    with pytest.raises(BambooConfigError) as info:
        call()
    for w in words:
        assert w in str(info.value)


def test_a_machines_workers_are_one_failure_domain_when_the_callback_rebuilds():
    """Machines m0 and m1 run two workers each (launcher --workers), interleaved; m1.0 is lost and m0.2 and
    m1.2 stand by. The stage between m0.0 and m0.1 goes to m1.2: with m0.2 there, losing machine m0 would
    take three neighbouring stages (a node and its replica holder) at once."""
    from lightning_bamboo.callbacks.rebalance import RebalanceCallback
    from lightning_bamboo.topology import machine_of

    assert [machine_of(n) for n in ("node1.3", "node1", "a.b", ".3", "gpu-7.0")] == ["node1", "node1", "a.b", ".3", "gpu-7"]
    callback = RebalanceCallback(stages=4)
    callback.layout = Placement((("m0.0", "m1.0", "m0.1", "m1.1"),), (0, 2, 4, 6, 8), (4,))
    decision = callback.decide(["m0.0", "m0.1", "m1.1"], ["m0.2", "m1.2"], 8)
    assert decision.layout.grid == (("m0.0", "m1.2", "m0.1", "m1.1"),)
