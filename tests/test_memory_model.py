"""``planner.memory``: a node's predicted memory, against numbers worked out by hand (no processes)."""

from __future__ import annotations

import pytest

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.planner.memory import (
    OWNERS,
    SLAB_CLASSES,
    SLAB_MIN_BYTES,
    TIE_PIECE_BYTES,
    TIE_ROUNDS,
    LayerMemory,
    MemorySettings,
    node_memory,
    pipeline_memory,
    slab_bytes,
    stage_activations,
    updates_replica_at_end,
)

# four layers of 100 parameters (the largest tensor 60), each micro-batch saving 1000 bytes and passing on 10
LAYERS = [LayerMemory(params=100, largest=60, activation_bytes=1000, output_bytes=10) for _ in range(4)]
# a baseline of 1000 bytes, nothing else fixed; AdamW's 8 bytes of state per parameter, 2 temporaries
PLAIN = MemorySettings(baseline_bytes=1000, framework_bytes=0, communication_bytes=0)
SLAB = SLAB_MIN_BYTES  # a 10-byte message's transfer buffer


def _phases(node):
    return {phase.name: phase.total for phase in node.phases}


def test_the_engines_constants_are_the_models():
    from lightning_bamboo.engine import ties
    from lightning_bamboo.engine.comm_cuda import size_class

    assert (TIE_PIECE_BYTES, TIE_ROUNDS) == (4 * ties.PIECE, ties.WINDOW + 1)
    assert all(slab_bytes(n) == size_class(n) for n in (1, SLAB_MIN_BYTES, SLAB_MIN_BYTES + 1, 65 << 20, 3 << 30))
    assert SLAB_CLASSES == 8 and slab_bytes(65 << 20) == 72 << 20


@pytest.mark.parametrize("stages", range(1, 9))
def test_the_replica_update_goes_where_the_schedule_puts_it(stages):
    from lightning_bamboo.schedule.build import updates_replica_at_end as scheduled

    assert [updates_replica_at_end(k, stages, eager=False) for k in range(stages)] == [
        scheduled(k, stages) for k in range(stages)]
    assert not any(updates_replica_at_end(k, stages, eager=True) for k in range(stages))


def test_off_two_stages_by_hand():
    first, last = pipeline_memory(LAYERS, (0, 2, 4), 4, settings=PLAIN)
    # stage 0: weights 800, AdamW state 1600, gradients 800; 2 micro-batches in flight of 2000 saved + 10 out; a
    # backward's working set 2 x 10; from the second micro-batch on a gradient of the largest tensor (4 x 60) made
    # whole before it is added to the one so far; transfer buffers of its output, sent and received: 2 x 4096
    assert _phases(first) == {"forward-backward": 1000 + 800 + 1600 + 2 * SLAB + 800 + 2 * 2010 + 20 + 240,
                              "update": 1000 + 800 + 1600 + 2 * SLAB + 800 + 2 * 4 * 60}
    assert first.peak.name == "forward-backward" and first.replica_stage is None
    # the last stage: one micro-batch in flight (2000 saved, its input 10, output 10 and the loss's 10); the last
    # micro-batch's output and loss input kept, 20; the working set 2 x 10 + 2 x 10 for the loss
    assert _phases(last) == {"forward-backward": 1000 + 800 + 1600 + 2 * SLAB + 20 + 800 + 2030 + 40 + 240,
                             "update": 1000 + 800 + 1600 + 2 * SLAB + 20 + 800 + 480}


def test_lazy_two_stages_through_shared_memory_by_hand():
    first, last = pipeline_memory(LAYERS, (0, 2, 4), 4, redundancy="lazy", settings=PLAIN)
    # the stage's and its replica's weights and AdamW state; both halves of the own gradients' and of the replica's
    # shared buffers (2 x 800 each), resident once written
    base = 1000 + 2 * (800 + 1600) + 2 * SLAB + 2 * 1600
    # stage 0 updates its replica before its first gradient (the warm-up's 2 micro-batches in flight); its own
    # gradients are views of their half from its last backward on (one micro-batch still in flight then)
    assert _phases(first) == {"forward-backward": base + 800 + 2 * 2010 + 20 + 240,
                              "write-ahead": base + 800 + 2010 + 20,
                              "replica update": base + 2 * 2010 + 480,
                              "update": base + 480}
    assert (first.peak.name, first.peak_bytes, first.replica_stage) == ("forward-backward", base + 5080, 1)
    # stage 1 (last): updates at the end, before its ship; the ship copies its gradients into their half
    base = base + 20
    assert _phases(last) == {"forward-backward": base + 800 + 2070 + 240, "replica update": base + 800 + 480,
                             "ship": base + 800, "update": base + 800 + 480}
    assert last.peak.by_owner() == {"stage": 800 + 1600 + 800 + 240, "replica": 2400, "activations": 20 + 2070,
                                    "buffers": 2 * SLAB + 3200, "communication process": 0, "baseline": 1000}


def test_over_the_network_the_exchange_keeps_its_buffers():
    shared = node_memory(LAYERS, (0, 2, 4), 0, 4, redundancy="lazy", settings=PLAIN)
    network = node_memory(LAYERS, (0, 2, 4), 0, 4, redundancy="lazy",
                          settings=MemorySettings(baseline_bytes=1000, framework_bytes=0, communication_bytes=0,
                                                  exchange="network"))
    # two receive buffers and the chunks' transfer buffers of the replica (8 + 4 per parameter), a send buffer and
    # the chunks' of the own gradients (4 + 4); no shared halves
    buffers = 12 * 200 + 8 * 200
    assert _phases(network)["update"] == 1000 + 2 * 2400 + 2 * SLAB + buffers + 800 + 480
    assert _phases(network)["forward-backward"] == _phases(shared)["forward-backward"] - 3200 + buffers


def test_activation_checkpointing_keeps_the_segments_inputs():
    layers = [LayerMemory(params=1, activation_bytes=a, output_bytes=o) for a, o in
              [(5, 1), (100, 2), (200, 3), (300, 4), (400, 5)]]
    # stage of layers 1-4 (not the last: 4 is, but the stage ends at the model's end), segments of 2: [1, 2], [3, 4];
    # kept: the second segment's input (layer 2's output, 3), the stage's input (1) and output (5), the loss's (5)
    assert stage_activations(layers, range(1, 5), last=True, checkpoint_every=2) == (3 + 1 + 5 + 5, 2 * 5 + 2 * 5 + 700)
    assert stage_activations(layers, range(1, 5), last=False) == (1000 + 1 + 5, 2 * 5)


def test_eager_keeps_its_redundant_forwards_and_a_tied_copy_its_buffers():
    layers = [LayerMemory(params=100, largest=100, activation_bytes=1000, output_bytes=10, tie="e"),
              *LAYERS[1:3], LayerMemory(params=100, largest=100, activation_bytes=1000, output_bytes=10, tie="e")]
    node = node_memory(layers, (0, 2, 4), 0, 4, redundancy="eager", eager_forwards=3, settings=PLAIN)
    items = {item.what: item.bytes for phase in node.phases for item in phase.items}
    # 3 forwards of stage 1's layers: 2000 saved, its input 10, output 10 and the loss's 10
    assert items["eager's kept redundant forwards"] == 3 * 2030
    # the embedding's copy on the other stage: one piece each way, and its gradient received (400)
    assert items["tied gradient's transfer buffers"] == 2 * SLAB and items["tied copy received"] == 400
    assert [o for o, _ in node.by_owner().items()] == list(OWNERS)
    assert node.format().startswith("stage 0 + replica of 1: ")


def test_what_the_model_refuses_says_why():
    with pytest.raises(BambooConfigError, match="exchange is one of"):
        MemorySettings(exchange="carrier-pigeon")
    with pytest.raises(BambooConfigError, match="largest parameter .* cannot exceed"):
        LayerMemory(params=10, largest=11)
    with pytest.raises(BambooConfigError, match="boundaries from 0 to 4"):
        node_memory(LAYERS, (0, 3), 0, 4)
    with pytest.raises(BambooConfigError, match="redundancy is"):
        node_memory(LAYERS, (0, 4), 0, 4, redundancy="sometimes")


def _profile(largest: int) -> object:
    from lightning_bamboo.planner.costmodel import LayerCost, LayerProfile, ModelProfile

    # 4 layers: 400 bytes of fp32 weights (100 parameters), as many of gradients, 800 of AdamW state; a micro-batch
    # saves 50 bytes and passes on 10
    return ModelProfile(tuple(LayerProfile(f"l{i}", 400, 400, 800, 0.0, ((1, LayerCost(1.0, 2.0, 10, 50)),),
                                           largest_param_bytes=largest) for i in range(4)))


def test_the_planner_counts_an_updates_temporaries_and_reports_every_nodes_memory():
    from lightning_bamboo.planner import Hardware, estimate_step, plan
    from lightning_bamboo.planner.plan import Plan, node_memory_of
    from lightning_bamboo.planner.solver import SegmentTables

    hw = Hardware(memory_bytes=10**9, bandwidth_bytes_per_second=1e30, latency_seconds=0.0)
    # two layers a stage: 2 x 1600 bytes of weights, gradients and state; 2 micro-batches in flight of 100 + 10 out
    # (stage 0), or two temporaries of the largest parameter: the larger counts
    for largest, expected in ((40, 3200 + 2 * 110), (400, 3200 + 2 * 400)):
        estimate = estimate_step(_profile(largest), hw, (0, 2, 4), 1, 4)
        assert estimate.stages[0].memory_bytes == expected
        assert SegmentTables(_profile(largest), hw, 1).memory(0, 2, 4)[0, 2] == expected
    chosen = plan(_profile(400), hw, 2, 4, redundancy="lazy")
    assert len(chosen.node_memory) == chosen.stages
    first = node_memory_of(_profile(400), (0, 2, 4), 1, 4, 1, "lazy", 0)[0]
    # planner.memory's node: 100 parameters a layer, AdamW's 8 bytes each (the profile's 800 bytes of state); its
    # peak is its forward-backward (its gradients and two micro-batches in flight weigh more than the replica
    # update's two temporaries of its largest parameter): the replica's weights and state
    assert (first["phase"], first["owners"]["replica"]) == ("forward-backward", 200 * (4 + 8))
    assert first["total_bytes"] == sum(first["owners"].values())
    assert Plan.from_json(chosen.to_json()).node_memory == chosen.node_memory
    assert chosen.format_memory().startswith("  node 0: ")


def test_a_gradient_is_accumulated_only_from_the_second_micro_batch_on():
    """Autograd makes the next micro-batch's gradient of a parameter whole, then adds it to the one so far: with one
    micro-batch there is nothing to add to, with two the largest parameter's (4 x 60 bytes) is in the working set."""
    def accumulating(micro_batches):
        node = node_memory(LAYERS, (0, 2, 4), 0, micro_batches, settings=PLAIN)
        phase = next(p for p in node.phases if p.name == "forward-backward")
        return sum(item.bytes for item in phase.items if "accumulated" in item.what)

    assert (accumulating(1), accumulating(2), accumulating(8)) == (0, 240, 240)
