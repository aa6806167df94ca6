"""Each process materialises only its layers: a ``LayerSpec`` is built only where it is kept, under ``seed + index``,
so the layers a process builds (its stage and its replica) equal the whole model's build bit for bit, in any layout,
and a ``LayerSpec`` not kept is never constructed (pure, in one process)."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from lightning_bamboo.engine.module import build_layers, census_layers, layer_init_seed
from lightning_bamboo.models.gpt import GPTConfig, gpt_layer_specs, gpt_layers
from lightning_bamboo.topology.layout import Layout

SEED = 1234
CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=6, n_head=2, n_embd=32)  # 8 pipeline layers


def _specs():
    return gpt_layer_specs(CFG)


def _assert_equal_layers(a: nn.Module, b: nn.Module, where: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), where
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{where}: {name}"


@pytest.mark.parametrize("layout", [Layout(2, 1, (0, 4, 8)), Layout(4, 1, (0, 2, 4, 6, 8)), Layout(4, 1, (0, 1, 4, 7, 8)),
                                    Layout(3, 2, (0, 3, 5, 8)), Layout(8, 1, tuple(range(9)))],
                         ids=["2-even", "4-even", "4-uneven", "3x2", "8"])
def test_each_rank_builds_its_stage_and_replica_equal_to_the_whole_build(layout):
    whole = build_layers(_specs, SEED).layers
    for rank in range(layout.stages * layout.pipelines):
        stage = layout.stage_of_rank(rank)
        mine = set(layout.layers_of_stage(stage)) | set(layout.layers_of_stage((stage + 1) % layout.stages))
        built = build_layers(_specs, SEED, keep=lambda i, mine=mine: i in mine).layers
        assert {i for i, layer in enumerate(built) if layer is not None} == mine
        for i in mine:
            _assert_equal_layers(built[i], whole[i], f"rank {rank}, layer {i}")


def test_a_layer_is_built_under_its_own_seed_whatever_else_is_built():
    """Layer i is ``torch.manual_seed(seed + i); spec.build()``: DeepSpeed's ``seed_layers=True`` rule."""
    specs = _specs()
    for i in (0, 3, 7):
        torch.manual_seed(layer_init_seed(SEED, i))
        _assert_equal_layers(build_layers(_specs, SEED, keep=lambda j, i=i: j == i).layers[i], specs[i].build(),
                             f"layer {i}")
    # the blocks have equal shapes and still differ: each has its own seed
    blocks = build_layers(_specs, SEED, keep=lambda j: j in (1, 2)).layers
    assert not torch.equal(blocks[1].qkv.weight, blocks[2].qkv.weight)


class Counted(nn.Module):
    """A layer that records, by its ``tag``, every construction and the device it was constructed on."""

    made: list[tuple[int, str]] = []

    def __init__(self, tag: int) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        Counted.made.append((tag, self.linear.weight.device.type))


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise AssertionError("a LayerSpec that is not kept was built")


def test_a_layer_spec_not_kept_is_never_constructed():
    Counted.made = []
    specs = [LayerSpec(Counted, 0), LayerSpec(Exploding), LayerSpec(Counted, 2), LayerSpec(Counted, 3)]
    built = build_layers(lambda: specs, SEED, keep=lambda i: i in (0, 3))
    assert Counted.made == [(0, "cpu"), (3, "cpu")]
    assert [type(layer).__name__ for layer in built.layers] == ["Counted", "NoneType", "NoneType", "Counted"]
    assert built.names == ["Counted", "Exploding", "Counted", "Counted"]


def test_the_census_counts_every_layer_on_the_meta_device():
    Counted.made = []

    class NeedsValues(nn.Module):  # a constructor that cannot run on the meta device: counted on the CPU
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, int(torch.ones(()).item()) + 1)

    specs = [LayerSpec(Counted, 0), LayerSpec(NeedsValues), nn.Linear(2, 5), LayerSpec(Counted, 3)]
    census = census_layers(lambda: specs, SEED)
    assert Counted.made == [(0, "meta"), (3, "meta")]
    assert census.param_counts == [20, 8, 15, 20]  # NeedsValues: Linear(3, 2), its .item() read on the CPU
    assert census.names == ["Counted", "NeedsValues", "Linear", "Counted"]
    whole = build_layers(_specs, SEED).layers
    assert census_layers(_specs, SEED).param_counts == [sum(p.numel() for p in layer.parameters()) for layer in whole]


def test_built_modules_keep_the_factory_under_the_seed_and_mix_with_specs():
    """Layers returned built are today's ``torch.manual_seed(seed); factory()``; the specs among them still get
    their own seeds, and a spec never shifts the built modules' values."""

    def mixed():
        return [nn.Linear(4, 4), LayerSpec(nn.Linear, 4, 4), nn.Linear(4, 4), LayerSpec(nn.Linear, 4, 4)]

    torch.manual_seed(SEED)
    reference = mixed()
    for keep in ((0, 1, 2, 3), (2,), (1, 3), (0, 3)):
        built = build_layers(mixed, SEED, keep=lambda i, keep=keep: i in keep).layers
        for i in keep:
            if i in (0, 2):
                _assert_equal_layers(built[i], reference[i], f"built module {i}")
            else:
                torch.manual_seed(SEED + i)
                _assert_equal_layers(built[i], nn.Linear(4, 4), f"spec {i}")
    # all built modules: exactly the previous contract
    torch.manual_seed(SEED)
    sequential = nn.Sequential(*gpt_layers(CFG))
    built = build_layers(lambda: gpt_layers(CFG), SEED, keep=lambda i: i in (2, 5)).layers
    for i in (2, 5):
        _assert_equal_layers(built[i], sequential[i], f"layer {i}")


def test_the_callers_random_streams_are_left_alone():
    torch.manual_seed(7)
    numpy.random.seed(7)
    random.seed(7)
    saved = torch.random.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate()
    build_layers(_specs, SEED, keep=lambda i: i % 2 == 0)
    census_layers(_specs, SEED)
    assert torch.equal(torch.random.get_rng_state(), saved[0])
    assert numpy.array_equal(numpy.random.get_state()[1], saved[1]) and random.getstate() == saved[2]


def test_a_cuda_not_started_is_not_seeded():
    """torch queues a seed for a CUDA not yet initialised and applies it to the process's GPU streams when CUDA
    starts: a build must queue none (each process would start CUDA under the seed of the last layer it built)."""
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is already initialised in this process")
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    assert tracker is not None, "torch.cuda._lazy_seed_tracker moved: find where torch queues seeds for a lazy CUDA"
    before = tracker.manual_seed_all_cb, tracker.manual_seed_cb
    build_layers(_specs, SEED, keep=lambda i: i in (0, 1))
    build_layers(lambda: gpt_layers(CFG), SEED, keep=lambda i: i == 0)
    census_layers(_specs, SEED)
    assert (tracker.manual_seed_all_cb, tracker.manual_seed_cb) == before


def test_the_deepspeed_door_builds_what_deepspeed_builds_with_seed_layers(tmp_path, monkeypatch):
    """``PipelineModule(seed_layers=True, base_seed=s)`` builds layer i under ``s + i``: the door's layers (built from
    the module's specs under its ``base_seed``) equal DeepSpeed's own, bit for bit."""
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    from lightning_bamboo.deepspeed_api.resilient import PipelineModuleModel
    from lightning_bamboo.engine.construct import ensure_deepspeed_comm

    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's PipelineModule reads it
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    ensure_deepspeed_comm("gloo")
    try:
        # "uniform": DeepSpeed 0.19 seeds Python's stream with a numpy integer after a "parameters" split, which it refuses
        module = PipelineModule(layers=_specs(), num_stages=1, loss_fn=nn.MSELoss(), seed_layers=True, base_seed=99,
                                partition_method="uniform")
        built = build_layers(PipelineModuleModel(module).configure_pipeline, int(module.base_seed), keep=lambda i: i in (0, 4, 7))
        for i in (0, 4, 7):
            _assert_equal_layers(built.layers[i], module.forward_funcs[i], f"layer {i}")
    finally:
        ds_comm.cdb = None
        dist.destroy_process_group()
