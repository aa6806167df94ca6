"""The replica audit's digests and comparison, without processes."""

from __future__ import annotations

import pytest
import torch

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.engine.audit import NodeDigest, ReplicaAuditError, check, digest, mismatches
from lightning_bamboo.engine.replica import StageContainer


def _stage(seed: int = 0) -> tuple[StageContainer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = StageContainer({2: torch.nn.Linear(3, 3), 3: torch.nn.Linear(3, 2)})
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


def _report(node: str, stage: int, own, replica_stage=None, replica=None) -> NodeDigest:
    return NodeDigest(node, stage, 0, digest(own), replica_stage, digest(replica or {}))


def test_equal_states_pass_and_one_changed_bit_is_named():
    owner, holder = _stage(), _stage()
    states = ckpt.layer_states(owner[0], owner[1], range(2, 4))
    reports = [_report("node0", 0, {}, 1, ckpt.layer_states(holder[0], holder[1], range(2, 4))), _report("node1", 1, states)]
    assert mismatches(reports, 5, "after") == []
    check(reports, 5, "after")

    with torch.no_grad():  # the smallest change: one bit of one second moment
        exp_avg_sq = holder[1].state[holder[0].get_submodule("3").bias]["exp_avg_sq"]
        exp_avg_sq.view(torch.int32)[0] ^= 1
    reports[0] = _report("node0", 0, {}, 1, ckpt.layer_states(holder[0], holder[1], range(2, 4)))
    assert mismatches(reports, 5, "after") == [
        "after step 5: node0's replica of stage 1 (run by node1): layer 3 optimizer/bias/exp_avg_sq differs"]
    with pytest.raises(ReplicaAuditError, match="a failover would train on wrong weights"):
        check(reports, 5, "after")


def test_a_replica_of_other_layers_or_of_no_running_stage_is_named():
    module, optimizer = _stage()
    both = ckpt.layer_states(module, optimizer, range(2, 4))
    reports = [_report("node0", 0, {}, 1, {2: both[2]}), _report("node1", 1, both)]
    assert mismatches(reports, 0, "after") == ["after step 0: node0's replica of stage 1 (run by node1) holds layers [2], "
                                               "the stage has [2, 3]"]
    alone = [_report("node0", 0, {}, 1, both)]
    assert mismatches(alone, 0, "after") == ["after step 0: node0 holds a replica of stage 1 of pipeline 0, which no node runs"]


def test_step_counts_are_compared_too():
    owner, holder = _stage(), _stage()
    holder[1].state[holder[0].get_submodule("2").weight]["step"] += 1
    reports = [_report("a", 0, {}, 1, ckpt.layer_states(holder[0], holder[1], range(2, 4))),
               _report("b", 1, ckpt.layer_states(owner[0], owner[1], range(2, 4)))]
    assert mismatches(reports, 1, "after") == ["after step 1: a's replica of stage 1 (run by b): layer 2 optimizer/weight/step differs"]
