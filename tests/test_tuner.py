"""HydrozoaTuner without the strategy: plan on rank 0, share it, apply it, look up other world sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_bamboo.callbacks.tuner import HydrozoaTuner, apply_plan
from lightning_bamboo.errors import BambooConfigError


@dataclass
class FakeStrategy:
    """The part of BambooStrategy the tuner touches."""

    world_size: int
    global_rank: int = 0
    stages: int | None = None
    micro_batch_size: int = 1
    partition: Any = "parameters"
    root_device: torch.device = torch.device("cpu")
    from_rank0: Any = None  # what a broadcast delivers on ranks > 0
    broadcasts: list = field(default_factory=list)

    def update_options(self, **changes: Any) -> None:
        for name, value in changes.items():
            setattr(self, name, value)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.broadcasts.append(src)
        return obj if self.global_rank == src else self.from_rank0


@dataclass
class FakeTrainer:
    strategy: FakeStrategy
    num_devices: int = 1

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank


class UnevenMLP(pl.LightningModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.example_input_array = torch.randn(2, 16)
        self.built = 0

    def configure_pipeline(self) -> list[nn.Module]:
        self.built += 1
        return [nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 8), nn.Linear(8, 4)]


def tuner(**kwargs: Any) -> HydrozoaTuner:
    options = dict(micro_batch_sizes=(1, 2), repeats=1, warmup=0, memory_bytes=2**30)
    return HydrozoaTuner(**{**options, **kwargs})


def test_rank0_plans_and_applies_a_layout_for_the_world_size() -> None:
    module, strategy = UnevenMLP(batch_size=8), FakeStrategy(world_size=4, stages=2)
    cb = tuner(max_world_size=6)
    cb.setup(FakeTrainer(strategy), module, "fit")
    plan = cb.plan
    assert strategy.broadcasts == [0]
    assert plan.stages * plan.pipelines == 4
    assert (strategy.stages, strategy.micro_batch_size, strategy.partition) == (
        plan.stages, plan.micro_batch_size, list(plan.partition))
    assert plan.partition[-1] == 5
    assert plan.global_batch == 8 * 2  # fixed global batch: 8 per pipeline x 2 pipelines before tuning
    assert module.batch_size * plan.pipelines == 16
    for w in range(1, 7):
        other = cb.plan_for(w)
        assert other.stages * other.pipelines == w and other.global_batch == 16


def test_other_ranks_take_rank0s_plan_without_profiling() -> None:
    rank0 = tuner()
    rank0.setup(FakeTrainer(FakeStrategy(world_size=2)), UnevenMLP(), "fit")
    module = UnevenMLP()
    strategy = FakeStrategy(world_size=2, global_rank=1, from_rank0={"table": rank0.table.to_dict()})
    cb = tuner()
    cb.setup(FakeTrainer(strategy), module, "fit")
    assert module.built == 0
    assert cb.plan == rank0.plan
    assert strategy.partition == list(rank0.plan.partition)


def test_scale_batch_keeps_the_batch_per_pipeline() -> None:
    module = UnevenMLP(batch_size=4)
    cb = tuner(scale_batch=True, max_world_size=4)
    cb.setup(FakeTrainer(FakeStrategy(world_size=4)), module, "fit")
    assert module.batch_size == 4
    for w in range(1, 5):
        plan = cb.plan_for(w)
        assert plan.batch_per_pipeline == 4 and plan.global_batch == 4 * plan.pipelines


def test_state_dict_restores_the_table_and_skips_profiling() -> None:
    first = tuner(max_world_size=3)
    first.setup(FakeTrainer(FakeStrategy(world_size=2)), UnevenMLP(), "fit")
    second = tuner()
    second.load_state_dict(first.state_dict())
    assert second.plan_for(3) == first.plan_for(3)
    module = UnevenMLP()
    second.setup(FakeTrainer(FakeStrategy(world_size=3)), module, "fit")
    assert module.built == 0 and second.plan == first.plan_for(3)


def test_split_for_a_reconfigured_depth_is_the_planners_on_every_rank() -> None:
    from lightning_bamboo.planner.solver import solve_split

    rank0 = tuner(max_world_size=4)
    rank0.setup(FakeTrainer(FakeStrategy(world_size=4, stages=4)), UnevenMLP(batch_size=2), "fit")
    assert rank0.profile is not None and rank0.hardware is not None
    # the pipeline after a loss: 3 stages, micro-batch size 1, 8 micro-batches
    split = rank0.split_for(3, 1, 8)
    assert split == solve_split(rank0.profile, rank0.hardware, 3, 1, 8).partition
    assert len(split) == 4 and split[0] == 0 and split[-1] == 5
    assert rank0.split_for(3, 16, 8) is None  # a micro-batch size that was never profiled: no opinion
    assert rank0.split_for(9, 1, 8) is None  # more stages than layers: no split
    # another rank plans nothing but gets the profile with the table, so its split is the same
    strategy = FakeStrategy(world_size=4, stages=4, global_rank=1, from_rank0=rank0._model_state() | {"table": rank0.table.to_dict()})
    other = tuner()
    other.setup(FakeTrainer(strategy), UnevenMLP(batch_size=2), "fit")
    assert other.split_for(3, 1, 8) == split
    # and so does a run resumed from a checkpoint
    resumed = tuner()
    resumed.load_state_dict(rank0.state_dict())
    assert resumed.split_for(3, 1, 8) == split


def test_only_fit_is_tuned() -> None:
    module, strategy = UnevenMLP(), FakeStrategy(world_size=2)
    tuner().setup(FakeTrainer(strategy), module, "validate")
    assert module.built == 0 and strategy.broadcasts == [] and strategy.partition == "parameters"


def test_plans_that_do_not_fit_the_strategy_are_refused() -> None:
    cb = tuner(max_world_size=4)
    cb.setup(FakeTrainer(FakeStrategy(world_size=2)), UnevenMLP(), "fit")
    with pytest.raises(BambooConfigError, match="world size 2"):
        apply_plan(FakeStrategy(world_size=2), cb.plan_for(4))
    with pytest.raises(BambooConfigError, match="lacks"):
        apply_plan(object(), cb.plan_for(2))
    with pytest.raises(BambooConfigError, match="no plan table"):
        tuner().plan_for(2)


def test_missing_inputs_are_explained() -> None:
    module = UnevenMLP()
    module.example_input_array = None
    with pytest.raises(BambooConfigError, match="sample_input"):
        tuner().setup(FakeTrainer(FakeStrategy(world_size=1)), module, "fit")
    module = UnevenMLP()
    del module.batch_size
    with pytest.raises(BambooConfigError, match="global_batch"):
        tuner().setup(FakeTrainer(FakeStrategy(world_size=1)), module, "fit")
    with pytest.raises(BambooConfigError, match="global_batch"):
        HydrozoaTuner(global_batch=0)


def test_bandwidth_none_measures_the_link_on_every_rank(monkeypatch) -> None:
    import lightning_bamboo.planner.network as network

    calls = []
    monkeypatch.setattr(network, "measure_link", lambda **kw: calls.append(kw) or (5.0e8, 1.0e-4))
    cb = tuner(bandwidth_bytes_per_second=None)
    cb.setup(FakeTrainer(FakeStrategy(world_size=2)), UnevenMLP(), "fit")
    assert len(calls) == 1 and cb.link == (5.0e8, 1.0e-4)
    single = tuner(bandwidth_bytes_per_second=None)
    single.setup(FakeTrainer(FakeStrategy(world_size=1)), UnevenMLP(), "fit")
    assert single.link is None and single.plan.stages == 1  # one process: no link to measure


def test_a_planning_error_on_rank0_reaches_every_rank() -> None:
    tiny = tuner(memory_bytes=64)  # not even one layer fits
    with pytest.raises(BambooConfigError, match="alone needs"):
        tiny.setup(FakeTrainer(FakeStrategy(world_size=2)), UnevenMLP(), "fit")
    # rank 1 gets the error rank 0 broadcast instead of a table, and raises it too
    rank1 = FakeStrategy(world_size=2, global_rank=1, from_rank0={"error": "LayerTooLargeError: layer 0 alone needs 1.0 MiB"})
    with pytest.raises(BambooConfigError, match=r"planned on rank 0\): LayerTooLargeError: layer 0 alone needs"):
        tuner().setup(FakeTrainer(rank1), UnevenMLP(), "fit")


def test_the_strategys_prelaunch_check_leaves_the_layout_to_the_tuner() -> None:
    """4 processes, a 2-layer model: BambooStrategy's default (4 stages) is impossible, the tuner's 2x2 or 4x1 is not."""
    import lightning_bamboo

    class TwoLayers(UnevenMLP):
        def configure_pipeline(self) -> list[nn.Module]:
            return [nn.Linear(16, 8), nn.Linear(8, 4)]

        def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return outputs.sum()

    def trainer(callbacks: list) -> pl.Trainer:
        return pl.Trainer(strategy=lightning_bamboo.BambooStrategy(), accelerator="cpu", devices=4, logger=False,
                          callbacks=callbacks, enable_progress_bar=False)

    with pytest.raises(BambooConfigError, match=r"more stages than layers \(stages: 4, layers: 2\)"):
        plain = trainer([])
        plain.strategy.check_before_launch(TwoLayers(), plain)
    tuned = trainer([tuner()])
    tuned.strategy.check_before_launch(TwoLayers(), tuned)  # the tuner picks the layout inside the processes
    with pytest.raises(BambooConfigError, match="pipeline_loss"):
        tuned.strategy.check_before_launch(UnevenMLP(), tuned)  # the model's hooks are still checked
