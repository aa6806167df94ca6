"""Live reconfiguration, the pure parts: which layers move where, and what the rebalancing callback decides."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_bamboo.callbacks.rebalance import RebalanceCallback
from lightning_bamboo.errors import BambooError
from lightning_bamboo.membership.records import failover_record
from lightning_bamboo.topology import Move, Placement, transfer_plan
from tests.helpers import callback_from_yaml


def test_nothing_moves_when_the_layout_is_the_same():
    assert transfer_plan(["a", "b"], [0, 3, 6], ["a", "b"], [0, 3, 6]) == ()


def test_even_out_after_a_failover():
    # b ran its own stage and its lost successor's (layers 2..5): layer 5 goes to d
    moves = transfer_plan(["a", "b", "d"], [0, 2, 6, 8], ["a", "b", "d"], [0, 2, 5, 8])
    assert moves == (Move("b", "d", 5, 6),)


def test_a_joining_node_gets_its_layers_from_their_owners_in_runs():
    moves = transfer_plan(["a", "b", "d"], [0, 2, 5, 8], ["a", "b", "d", "s"], [0, 2, 4, 6, 8])
    # b keeps 2..3, d takes 4 from b and keeps 5, s takes 6..7 from d; ordered by destination rank
    assert moves == (Move("b", "d", 4, 5), Move("d", "s", 6, 8))
    assert list(moves[1].layers) == [6, 7]


def test_a_new_node_in_the_middle_and_a_shift():
    moves = transfer_plan(["a", "b"], [0, 4, 8], ["a", "s", "b"], [0, 3, 6, 8])
    assert moves == (Move("a", "s", 3, 4), Move("b", "s", 4, 6))


def test_a_new_pipeline_copies_every_stage_from_a_running_one():
    # 1 x 2 (b0 -> b1) to 2 x 2 in rank order [b0, a0, b1, a1]: a0 and a1 get stage 0 and stage 1 from b0 and b1
    moves = transfer_plan(["b0", "b1"], [0, 4, 8], ["b0", "a0", "b1", "a1"], [0, 4, 8], 1, 2)
    assert moves == (Move("b0", "a0", 0, 4), Move("b1", "a1", 4, 8))


def test_new_pipelines_take_their_layers_from_different_running_ones():
    # 2 x 2 to 4 x 2: new pipeline p takes from old pipeline p mod 2, so both old ones send
    old, new = ["a0", "b0", "a1", "b1"], ["a0", "b0", "c0", "d0", "a1", "b1", "c1", "d1"]
    moves = transfer_plan(old, [0, 4, 8], new, [0, 4, 8], 2, 4)
    assert moves == (Move("a0", "c0", 0, 4), Move("b0", "d0", 0, 4), Move("a1", "c1", 4, 8), Move("b1", "d1", 4, 8))


def test_a_deeper_layout_of_two_pipelines():
    # 2 x 1 (a and b each run all 8 layers) to 2 x 2: a and b keep layers 0..3, s and t get 4..7 from them
    moves = transfer_plan(["a", "b"], [0, 8], ["a", "b", "s", "t"], [0, 4, 8], 2, 2)
    assert moves == (Move("a", "s", 4, 8), Move("b", "t", 4, 8))


@pytest.mark.parametrize(
    ("old", "old_parts", "new", "new_parts", "message"),
    [
        (["a", "b"], [0, 4, 8], ["a"], [0, 8], "keeps every node that holds layers"),
        (["a", "b"], [0, 4, 8], ["a", "b"], [0, 4, 9], "same layers"),
        (["a", "b"], [0, 4, 8], ["a", "a"], [0, 4, 8], "one stage only"),
        (["a", "b"], [0, 4, 4], ["a", "b"], [0, 4, 8], "strictly increasing"),
        (["a", "b", "c"], [0, 8], ["a", "b", "c"], [0, 8], "layer boundaries"),  # one pipeline of 3 needs 4
    ],
)
def test_bad_layouts_are_refused(old, old_parts, new, new_parts, message):
    with pytest.raises(BambooError, match=message):
        transfer_plan(old, old_parts, new, new_parts)


def _callback(nodes, parts, stages=None):
    cb = RebalanceCallback(stages=stages)
    cb.layout = Placement((tuple(nodes),), tuple(parts), (4,))
    cb.stages = stages or len(nodes)
    return cb


def test_callback_keeps_a_healthy_pipeline():
    cb = _callback(["n0", "n1", "n2", "n3"], [0, 2, 4, 6, 8])
    assert cb.decide(["n0", "n1", "n2", "n3"], [], 8).action == "keep"


def test_callback_spreads_the_layers_of_a_lost_node_over_the_survivors():
    cb = _callback(["n0", "n1", "n2", "n3"], [0, 2, 4, 6, 8])
    decision = cb.decide(["n0", "n1", "n3"], [], 8)  # n2 lost, n1 serves its stage from the replica
    assert decision.action == "restore_redundancy"
    assert decision.layout.grid == (("n0", "n1", "n3"),) and decision.layout.parts == (0, 2, 5, 8)


def _failover(lost, rows, parts, old_pipelines, released=(), old_parts=None):
    """The record a failover at step 3 keeps (as ``runtime.failover`` makes it)."""
    return failover_record({"step": 3, "lost": lost, "committed": False, "seconds": 0.5, "redone": True,
                            "order": [n for row in zip(*rows, strict=True) for n in row], "parts": parts, "pipelines": len(rows),
                            "released": list(released), "rows": rows, "old_parts": old_parts or parts,
                            "old_pipelines": old_pipelines})


def test_callback_follows_a_failover_that_dropped_a_pipeline_and_adds_one_back():
    cb = RebalanceCallback(stages=2)
    cb.layout, cb.stages = Placement((("a0", "a1"), ("b0", "b1")), (0, 4, 8), (2, 2)), 2
    cb._follow_failovers([_failover(lost=["a1"], rows=[["b0", "b1"]], parts=[0, 4, 8], old_pipelines=2, released=["a0"])])
    assert cb.layout == Placement((("b0", "b1"),), (0, 4, 8), (4,))  # the global batch stays: 4 micro-batches
    assert cb.decide(["b0", "b1"], ["a0"], 8).action == "keep"  # 3 nodes make one pipeline of 2
    decision = cb.decide(["b0", "b1"], ["a0", "s"], 8)
    assert decision.action == "add_pipeline" and decision.layout.grid == (("b0", "b1"), ("a0", "s"))
    assert decision.layout.micro_batches == (2, 2)
    # a failover of one pipeline keeps the lost node in the view (its replica holder is overloaded)
    single = _callback(["n0", "n1", "n2", "n3"], [0, 2, 4, 6, 8])
    single._follow_failovers([_failover(lost=["n2"], rows=[["n0", "n1", "n3"]], parts=[0, 2, 6, 8], old_pipelines=1,
                                        old_parts=[0, 2, 4, 6, 8])])
    assert single.decide(["n0", "n1", "n3"], [], 8).action == "restore_redundancy"


def test_callback_splits_by_the_strategys_layer_costs():
    """With partition='parameters' the strategy gives the policy parameter counts: a GPT's small embedding
    and head share stages with blocks, as in the job's first split, instead of an even count of layers."""
    cb = _callback(["n0", "n1", "n2", "n3"], [0, 2, 4, 6, 8])
    cb.layer_costs = (3840.0, *[28272.0] * 6, 3168.0)
    decision = cb.decide(["n0", "n1", "n3"], [], 8)
    assert decision.action == "restore_redundancy" and decision.layout.parts == (0, 3, 5, 8)  # 2 blocks at most
    cb = _callback(["n0", "n1", "n3"], [0, 3, 5, 8], stages=6)
    cb.layer_costs = (3840.0, *[28272.0] * 6, 3168.0)
    decision = cb.decide(["n0", "n1", "n3"], ["s1", "s2", "s3"], 8)
    assert decision.layout.stages == 6 and decision.layout.parts == (0, 2, 3, 4, 5, 6, 8)  # one block each
    assert _callback(["n0", "n1", "n3"], [0, 3, 5, 8], stages=6).decide(
        ["n0", "n1", "n3"], ["s1", "s2", "s3"], 8).layout.parts == (0, 1, 2, 4, 5, 6, 8)  # equal layers: 2 blocks


def test_callback_admits_a_standby_node_to_get_back_to_the_preferred_depth():
    cb = _callback(["n0", "n1", "n3"], [0, 2, 5, 8], stages=4)
    decision = cb.decide(["n0", "n1", "n3"], ["s1"], 8)
    assert decision.action == "change_depth"
    assert set(decision.layout.grid[0]) == {"n0", "n1", "n3", "s1"} and decision.layout.parts == (0, 2, 4, 6, 8)
    # a full pipeline leaves a spare standby (one pipeline is all the global batch needs here)
    full = _callback(["n0", "n1", "n2", "n3"], [0, 2, 4, 6, 8])
    assert full.decide(["n0", "n1", "n2", "n3"], ["s1"], 8).action == "keep"


def test_callback_takes_the_layer_split_of_a_hydrozoa_tuner():
    asked = []

    def split_for(stages, micro_batch_size, micro_batches, pipelines):
        asked.append((stages, micro_batch_size, micro_batches, pipelines))
        return (0, 1, 6, 8) if stages == 3 else None

    cb = _callback(["n0", "n1", "n2", "n3"], [0, 2, 4, 6, 8])
    cb.split_for, cb.micro_batch_size = split_for, 2
    decision = cb.decide(["n0", "n1", "n3"], [], 8)  # n2 lost: the planner's split for 3 stages, not an even one
    assert asked == [(3, 2, 4, 1)]
    assert decision.action == "restore_redundancy" and decision.layout.parts == (0, 1, 6, 8)
    assert "HydrozoaTuner" in decision.reason
    assert decision.moved == ("n0", "n1")  # with this split n3 keeps layers 6-7; n0 and n1 change
    # no split for that depth (None): the policy's own
    cb = _callback(["n0", "n1", "n3"], [0, 2, 5, 8], stages=4)
    cb.split_for = split_for
    assert cb.decide(["n0", "n1", "n3"], ["s1"], 8).layout.parts == (0, 2, 4, 6, 8)
    # a healthy pipeline is kept as it is, whatever the planner would split
    cb = _callback(["n0", "n1", "n2", "n3"], [0, 2, 4, 6, 8])
    cb.split_for = lambda *a: (0, 1, 2, 3, 8)
    assert cb.decide(["n0", "n1", "n2", "n3"], [], 8).action == "keep"


def test_callback_state_round_trips():
    cb = _callback(["n0", "n1", "n3"], [0, 2, 5, 8], stages=4)
    cb.decisions.append({"step": 3, "action": "restore_redundancy"})
    other = RebalanceCallback()
    other.load_state_dict(cb.state_dict())
    assert other.layout == cb.layout and other.stages == 4 and other.decisions == cb.decisions


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"stages": 0}, "depth must be >= 1"), ({"min_stages": 0}, "min_stages"), ({"max_overloaded_fraction": 2}, r"\[0, 1\]")],
)
def test_callback_bad_arguments(kwargs, message):
    with pytest.raises(BambooError, match=message):
        RebalanceCallback(**kwargs)


def test_callback_configurable_from_cli_yaml():
    callback = callback_from_yaml(RebalanceCallback, "{stages: 6, min_stages: 3, max_overloaded_fraction: 0.2, admit: false}")
    assert isinstance(callback, RebalanceCallback)
    assert (callback.stages, callback.min_stages, callback.max_overloaded_fraction, callback.admit) == (6, 3, 0.2, False)


def test_callback_needs_the_bamboo_strategy():
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    with pytest.raises(BambooError, match="strategy='bamboo'"):
        RebalanceCallback().setup(trainer, pl.LightningModule(), "fit")


def test_callback_finds_the_tuner_among_the_trainers_callbacks():
    from lightning_bamboo.callbacks.tuner import HydrozoaTuner
    from lightning_bamboo.runtime import BambooConfig, PipelineRunner

    tuner = HydrozoaTuner()
    runner = PipelineRunner(BambooConfig(), host=SimpleNamespace())
    strategy = SimpleNamespace(runner=runner, micro_batch_size=4)
    cb = RebalanceCallback()
    cb.setup(SimpleNamespace(strategy=strategy, callbacks=[tuner, cb]), object(), "fit")
    assert cb.split_for == tuner.split_for and cb.micro_batch_size == 4
    assert runner.before_step_hooks == (cb.at_step_start,)
    cb.setup(SimpleNamespace(strategy=strategy, callbacks=[tuner, cb]), object(), "fit")  # a second fit: hooked once
    assert runner.before_step_hooks == (cb.at_step_start,)
    cb.teardown(SimpleNamespace(strategy=strategy), object(), "fit")
    assert runner.before_step_hooks == ()
    alone = RebalanceCallback()
    alone.setup(SimpleNamespace(strategy=strategy, callbacks=[alone]), object(), "fit")
    assert alone.split_for is None


class _Runner:
    """What ``Rebalancer.at_step_start`` reads of a runner, for a pipeline of ``nodes`` and no standby node; the
    first proposal is agreed (one node), and a reconfiguration is recorded, not run."""

    def __init__(self, nodes, parts, pipelines=1):
        from lightning_bamboo.topology.layout import Layout

        self.nodes, self.standby, self.failovers = list(nodes), [], []
        self.session, self.host = object(), SimpleNamespace(global_micro_batches=lambda: 4)
        self.layout, self.node = Layout(len(nodes) // pipelines, pipelines, tuple(parts)), nodes[0]
        self.micro_batches = 1
        self.reconfigured = []

    def agree(self, topic, step, proposal):
        return proposal

    def reconfigure(self, order, parts, reason="", pipelines=1):
        self.reconfigured.append((order, parts))
        return 0.0


def test_a_preferred_depth_that_would_leave_running_nodes_idle_is_deferred_with_the_fix(caplog):
    """stages=3 on two healthy pipelines of 2, for a model that needs 3 stages: the policy's layout of 3 stages has no
    place for one running node, and a reconfiguration never drops one; nothing moves, and the warning names the rule
    and the fix (once)."""
    from lightning_bamboo.runtime.rebalance import Rebalancer, runtime_placement

    runner = _Runner(["a0", "b0", "a1", "b1"], [0, 4, 8], pipelines=2)
    shallower = Rebalancer(stages=3)  # a model that fits 2 stages: 2 x 2 trains every node, nothing to change
    shallower.begin(runtime_placement(runner, 4), None)
    shallower.at_step_start(runner, 0)
    assert runner.reconfigured == [] and shallower.decisions == []
    rebalancer = Rebalancer(stages=3, min_stages=3)
    rebalancer.begin(runtime_placement(runner, 4), None)
    with caplog.at_level("WARNING"):
        rebalancer.at_step_start(runner, 0)
        rebalancer.at_step_start(runner, 1)
    assert runner.reconfigured == [] and rebalancer.decisions == []
    warnings = [r.getMessage() for r in caplog.records if "deferred" in r.getMessage()]
    assert len(warnings) == 1 and "never drops a running node; choose stages (now 3) that divide" in warnings[0]
    # the same rebalancer with a depth that fits moves the layers of a lost node's stage
    runner = _Runner(["n0", "n1", "n3"], [0, 2, 6, 8])  # n1 serves n2's stage from its replica
    fitting = Rebalancer(stages=4)
    fitting.begin(runtime_placement(_Runner(["n0", "n1", "n2", "n3"], [0, 2, 4, 6, 8]), 4), None)
    fitting.at_step_start(runner, 5)
    assert runner.reconfigured == [(["n0", "n1", "n3"], (0, 2, 5, 8))]
    assert fitting.decisions[0]["action"] == "restore_redundancy"
