"""Layout rules (pure): stages x pipelines, partitions and micro-batching, with their error messages."""

from __future__ import annotations

import pytest

from lightning_bamboo.engine.partition import compute_parts
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology import (
    Layout,
    check_partition_option,
    check_parts,
    even_parts,
    micro_batches,
    partition_weights,
    resolve_stages,
)


def test_resolve_stages_gives_pipelines():
    assert resolve_stages(4, 2) == (2, 2)
    assert resolve_stages(4, None) == (4, 1)
    assert resolve_stages(6, 3) == (3, 2)


def test_devices_not_a_multiple_of_stages():
    with pytest.raises(BambooConfigError, match=r"multiple of stages \(devices x num_nodes: 3, stages: 2\); use devices=2 or stages=1"):
        resolve_stages(3, 2)


def test_more_stages_than_layers():
    with pytest.raises(BambooConfigError, match=r"more stages than layers \(stages: 5, layers: 4\); use stages <= 4"):
        compute_parts("uniform", 5, [1, 1, 1, 1], ["A"] * 4)


def test_partition_methods():
    counts = [100, 10, 10, 10, 10, 100]
    assert compute_parts("uniform", 3, counts, ["L"] * 6) == (0, 2, 4, 6)
    parts = compute_parts("parameters", 2, counts, ["L"] * 6)
    assert parts[0] == 0 and parts[-1] == 6 and len(parts) == 3
    assert compute_parts([0, 1, 6], 2, counts, ["L"] * 6) == (0, 1, 6)
    names = ["Embedding", "Block", "Block", "Block", "Block", "Head"]
    assert compute_parts("type:block", 2, counts, names) == (0, 3, 6)


def test_partition_list_leaving_a_stage_empty():
    with pytest.raises(BambooConfigError, match=r"partition \[0, 2, 2, 4\] leaves stage 1 empty"):
        check_partition_option([0, 2, 2, 4], 3)
    with pytest.raises(BambooConfigError, match=r"leaves stage 1 empty \(layers 2..1\)"):
        check_parts([0, 2, 2, 4], 3, 4)


def test_partition_list_of_wrong_length_or_end():
    with pytest.raises(BambooConfigError, match=r"stages \+ 1 layer boundaries \(stages: 2, boundaries given: 4"):
        check_parts([0, 1, 2, 4], 2, 4)
    with pytest.raises(BambooConfigError, match=r"ends at the number of layers \(layers: 4, partition: \[0, 2, 3\]\)"):
        check_parts([0, 2, 3], 2, 4)


def test_type_partition_matching_no_layer():
    with pytest.raises(BambooConfigError, match=r"partition 'type:Conv' matches no layer class \(classes: \['Block', 'Emb', 'Head'\]\)"):
        compute_parts("type:Conv", 2, [1, 1, 1, 1], ["Emb", "Block", "Block", "Head"])


def test_parts_are_plain_ints():
    parts = compute_parts("parameters", 3, [5, 1, 1, 9], ["L"] * 4)
    assert all(type(p) is int for p in parts)


def test_unknown_partition_method():
    with pytest.raises(BambooConfigError, match=r"'parameters', 'uniform', 'type:REGEX' or a list"):
        check_partition_option("balanced", 2)


def test_batch_not_divisible():
    assert micro_batches(8, 2, 2) == 4
    with pytest.raises(BambooConfigError, match=r"batch size 6 per pipeline \(global batch 12 = 6 x 2 pipelines\) is not a multiple of micro_batch_size x pipelines = 4 x 2 = 8"):
        micro_batches(6, 4, 2)


def test_layout_maps_ranks_like_deepspeed():
    layout = Layout(stages=2, pipelines=2, parts=(0, 3, 5))
    # DeepSpeed's PipeDataParallelTopology: rank = stage * pipelines + pipeline
    assert [layout.stage_of_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.pipeline_of_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert list(layout.layers_of_stage(1)) == [3, 4]
    assert layout.stage_of_layer(4) == 1


def test_partition_weights_are_what_the_first_split_and_later_splits_balance():
    counts, names = [10, 300, 300, 5], ["Embedding", "Block", "Block", "Linear"]
    assert partition_weights("parameters", counts, names) == counts
    assert partition_weights("type:block", counts, names) == [0, 1, 1, 0]
    assert partition_weights("uniform", counts, names) is None and partition_weights([0, 2, 4], counts, names) is None
    # compute_parts balances the same weights: one block per stage, the light layers beside them
    assert compute_parts("parameters", 2, counts, names) == compute_parts("type:block", 2, counts, names) == (0, 2, 4)


def test_even_parts_give_the_later_stages_the_extra_layers():
    assert even_parts(10, 3) == (0, 3, 6, 10)
    assert even_parts(8, 4) == (0, 2, 4, 6, 8)
    with pytest.raises(BambooConfigError, match=r"cannot split 2 layers over 3 stages"):
        even_parts(2, 3)


def test_error_hints_suggest_the_even_split():
    with pytest.raises(BambooConfigError, match=r"boundaries given: 3: \[0, 5, 10\]\); e\.g\. \[0, 3, 6, 10\]"):
        check_parts([0, 5, 10], 3, 10)
    with pytest.raises(BambooConfigError, match=r"e\.g\. \[0, 1, 2\] \(at most 2 stages\)"):
        check_parts([0, 1, 2], 3, 2)


