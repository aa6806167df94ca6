"""BambooStrategy options, registration and the checks made before any process starts (in-process)."""

from __future__ import annotations

import psutil
import pytest
import torch

import lightning_bamboo
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.models.gpt import gpt_layers, gpt_loss
from tests.helpers import make_config

pl = pytest.importorskip("lightning.pytorch")
ptl = pytest.importorskip("pytorch_lightning")


def test_registered_in_both_namespaces():
    t1 = pl.Trainer(strategy="bamboo", accelerator="cpu", devices=2, logger=False)
    assert type(t1.strategy) is lightning_bamboo.BambooStrategy
    t2 = ptl.Trainer(strategy="bamboo", accelerator="cpu", devices=2, logger=False)
    assert type(t2.strategy) is lightning_bamboo.PTLBambooStrategy
    assert isinstance(t2.strategy, ptl.strategies.DDPStrategy)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stages": 0}, r"stages must be a positive integer or None \(stages: 0\)"),
        ({"micro_batch_size": 0}, r"micro_batch_size must be a positive integer \(micro_batch_size: 0\)"),
        ({"redundancy": "always"}, r"redundancy must be one of \('off', 'lazy', 'eager', 'auto'\) \(redundancy: 'always'\)"),
        ({"redundancy": "lazy", "stages": 1}, r"needs at least 2 stages.*\(stages: 1\); use stages >= 2"),
        ({"stages": 3, "partition": [0, 2, 2, 4]}, r"partition \[0, 2, 2, 4\] leaves stage 1 empty"),
        ({"timeout": 0}, r"timeout must be a positive number of seconds"),
        ({"rf_costs": "fast"}, r"rf_costs must be 'measured' or a dict such as \{'forward': 1, 'backward': 2\} \(rf_costs: 'fast'\)"),
        ({"rf_costs": {"forward": 1, "bwd": 2}}, r"rf_costs \{'forward': 1, 'bwd': 2\}: .*'bwd'.*; the fields are forward, backward"),
        ({"rf_costs": {"forward": 0}}, r"rf_costs \{'forward': 0\}: Costs.forward must be > 0"),
        ({"audit_replicas": "yes"}, r"audit_replicas must be True or False \(audit_replicas: 'yes'\)"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(BambooConfigError, match=message):
        lightning_bamboo.BambooStrategy(**kwargs)


def test_rf_costs_are_checked_once_into_costs():
    from lightning_bamboo.schedule import Costs

    assert lightning_bamboo.BambooStrategy(rf_costs={"forward": 1, "backward": 1.7}).rf_costs == Costs(backward=1.7)
    assert lightning_bamboo.BambooStrategy().rf_costs == "measured"


class Tiny(pl.LightningModule):
    def __init__(self, n_layer=2):
        super().__init__()
        self.n_layer = n_layer

    def configure_pipeline(self):
        cfg = make_config()
        return gpt_layers(type(cfg)(**{**cfg.__dict__, "n_layer": self.n_layer}))

    def pipeline_loss(self, outputs, targets):
        return gpt_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 8, dtype=torch.long)), batch_size=4)


class NoPipeline(pl.LightningModule):
    def training_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def _fit_fails_before_launch(trainer, model, message):
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(BambooConfigError, match=message):
        trainer.fit(model)
    started = set(psutil.Process().children(recursive=True)) - before
    assert not started, f"processes were started before the error: {started}"


def test_no_configure_pipeline_fails_before_launch():
    trainer = pl.Trainer(strategy=lightning_bamboo.BambooStrategy(stages=2), accelerator="cpu", devices=2, logger=False)
    _fit_fails_before_launch(trainer, NoPipeline(), r"NoPipeline does not define; add `def configure_pipeline\(self\)`")


def test_more_stages_than_layers_fails_before_launch():
    trainer = pl.Trainer(strategy=lightning_bamboo.BambooStrategy(stages=5), accelerator="cpu", devices=5, logger=False)
    _fit_fails_before_launch(trainer, Tiny(n_layer=2), r"more stages than layers \(stages: 5, layers: 4\)")


def test_devices_not_multiple_of_stages_fails_before_launch():
    trainer = pl.Trainer(strategy=lightning_bamboo.BambooStrategy(stages=2), accelerator="cpu", devices=3, logger=False)
    _fit_fails_before_launch(trainer, Tiny(), r"multiple of stages \(devices x num_nodes: 3, stages: 2\)")


def test_partition_list_of_wrong_size_for_model_fails_before_launch():
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(stages=2, partition=[0, 2, 6]), accelerator="cpu", devices=2, logger=False
    )
    _fit_fails_before_launch(trainer, Tiny(n_layer=2), r"ends at the number of layers \(layers: 4, partition: \[0, 2, 6\]\)")


def test_layers_are_built_under_the_seed_whatever_is_kept():
    from lightning_bamboo.engine.module import build_layers, census_layers

    torch.manual_seed(7)
    state = torch.random.get_rng_state()
    built = build_layers(Tiny().configure_pipeline, seed=1234, keep=lambda i: i in (1, 2))
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's RNG must be left alone"
    assert built.layers[0] is None and built.layers[3] is None
    torch.manual_seed(1234)
    reference = torch.nn.Sequential(*Tiny().configure_pipeline())
    for i in (1, 2):
        for (name, a), (_, b) in zip(built.layers[i].state_dict().items(), reference[i].state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    assert built.names == ["Embedding", "Block", "Block", "Head"]
    assert census_layers(Tiny().configure_pipeline, seed=1234).param_counts[0] == sum(p.numel() for p in reference[0].parameters())


@pytest.mark.parametrize(
    "section, message",
    [
        ({"redundancy": "always"}, r'"bamboo" section: redundancy must be one of'),
        ({"timeout": 0}, r'"bamboo" section: timeout must be a positive number of seconds \(timeout: 0\)'),
        ({"retries": 3}, r"unknown keys in the \"bamboo\" config entry: \['retries'\]"),
        ({"stages": 3}, r"\['stages'\] come from the PipelineModule and the DeepSpeed config"),
    ],
)
def test_initialize_bamboo_options_are_checked(section, message):
    """The DeepSpeed config's "bamboo" section is a BambooConfig, field for field, checked as the strategy's options are."""
    from lightning_bamboo.deepspeed_api import bamboo_options
    from lightning_bamboo.runtime.config import BambooConfig

    with pytest.raises(BambooConfigError, match=message):
        bamboo_options({"bamboo": section})
    assert bamboo_options({"bamboo": {"timeout": 60}}) == BambooConfig(timeout=60)
    assert bamboo_options({}) == BambooConfig()


def test_initialize_with_replicas_outside_the_bamboo_launcher_is_refused_with_how_to_start_it_and_auto_keeps_none(
        tmp_path, monkeypatch):
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import lightning_bamboo
    from lightning_bamboo.engine.construct import ensure_deepspeed_comm

    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's PipelineModule reads it
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    ensure_deepspeed_comm("gloo")
    try:
        module = PipelineModule(layers=[torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], num_stages=1,
                                loss_fn=torch.nn.functional.mse_loss)
        for mode in ("lazy", "eager"):
            with pytest.raises(BambooConfigError, match=rf"\"bamboo.redundancy\" = '{mode}' needs the Bamboo launcher.*"
                                                        r"python -m lightning_bamboo.launcher --nodes N"):
                lightning_bamboo.initialize(model=module, config={"train_micro_batch_size_per_gpu": 1,
                                                                  "bamboo": {"redundancy": mode}})
        # "auto", the default, keeps replicas only where they can serve: none outside the launcher, no refusal
        for section in ({}, {"bamboo": {"redundancy": "auto"}}):
            engine, *_ = lightning_bamboo.initialize(model=module, config={"train_micro_batch_size_per_gpu": 1,
                                                                           **section})
            assert engine.redundancy == "off" and engine.replica is None
    finally:
        ds_comm.cdb = None
        dist.destroy_process_group()


def test_reductions_between_steps_match_lightnings() -> None:
    """Under the Bamboo launcher, reduce() between steps goes through the store: the same ops as Lightning's."""
    from torch.distributed import ReduceOp

    from lightning_bamboo.runtime.collectives import reduce_kind as _reduce_kind
    from lightning_bamboo.runtime.collectives import reduced as _reduced

    parts = [torch.tensor([1.0, 4.0]), torch.tensor([3.0, 2.0]), torch.tensor([2.0, 6.0])]
    assert _reduce_kind(None) == _reduce_kind(ReduceOp.SUM) == _reduce_kind("sum") == "sum"
    assert _reduce_kind("mean") == _reduce_kind("avg") == "avg" and _reduce_kind(ReduceOp.MAX) == "max"
    assert _reduced(parts, "sum").tolist() == [6.0, 12.0]
    assert _reduced(parts, "avg").tolist() == [2.0, 4.0]
    assert _reduced(parts, "max").tolist() == [3.0, 6.0] and _reduced(parts, "min").tolist() == [1.0, 2.0]
    assert _reduced(parts, "product").tolist() == [6.0, 48.0]
    # integers (reduce_boolean_decision's votes) stay integers; a mean truncates as Lightning's does on gloo
    votes = [torch.tensor(1), torch.tensor(1), torch.tensor(0)]
    assert _reduced(votes, "sum").item() == 2 and _reduced(votes, "sum").dtype == torch.int64
    assert _reduced(votes, "avg").item() == 0
    with pytest.raises(BambooConfigError, match="reduce_op='median'"):
        _reduce_kind("median")


def test_the_process_group_backend_is_the_abortable_one_with_nccl_on_gpus():
    from lightning_bamboo.engine import comm_process

    def backend(chosen, device):
        strategy = lightning_bamboo.BambooStrategy(stages=2, process_group_backend=chosen)
        strategy.parallel_devices = [torch.device(device)]
        return strategy

    assert backend(None, "cpu")._get_process_group_backend() == comm_process.BACKEND
    assert backend("gloo", "cpu")._get_process_group_backend() == "gloo"  # the user's: used as it is
    with pytest.raises(BambooConfigError, match="process_group_backend='nccl' runs on GPUs.*cpu"):
        backend("nccl", "cpu")._get_process_group_backend()
    try:
        for chosen in (None, "nccl"):  # (no GPU is touched: the choice is made from the device's name)
            on_gpu = backend(chosen, "cuda:0")
            assert on_gpu._get_process_group_backend() == comm_process.BACKEND
            on_gpu._use_transport()
            assert (comm_process._GENERATION["transport"], comm_process._GENERATION["device"]) == ("nccl", 0)
        backend(None, "cpu")._use_transport()
        assert comm_process._GENERATION["transport"] == "gloo"
    finally:
        comm_process.use_transport("gloo")


def test_options_are_a_frozen_config_changed_only_by_a_checked_replacement():
    import dataclasses

    from lightning_bamboo.runtime.config import BambooConfig

    config = BambooConfig(stages=2, partition=[0, 4, 8])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stages = 3  # type: ignore[misc]
    with pytest.raises(BambooConfigError, match=r"stages must be a positive integer or None \(stages: 0\)"):
        config.replace(stages=0)
    with pytest.raises(BambooConfigError, match=r"has no option \['stage'\]"):
        config.replace(stage=3)
    wider = config.replace(stages=3, partition=(0, 2, 5, 8))
    assert (wider.stages, wider.partition, config.stages) == (3, [0, 2, 5, 8], 2)

    strategy = lightning_bamboo.BambooStrategy(stages=2, partition=[0, 4, 8], redundancy="lazy")
    runner = strategy.runner
    # one option at a time is checked against the others: a depth the explicit partition does not have is refused,
    # and nothing changes
    with pytest.raises(BambooConfigError, match="partition"):
        strategy.stages = 3
    assert strategy.options.stages == 2 and runner.config is strategy.options and runner.depth == 2
    strategy.update_options(stages=3, partition=[0, 2, 5, 8], micro_batch_size=2)  # together, as the tuner does
    assert (strategy.stages, strategy.partition, strategy.micro_batch_size) == (3, [0, 2, 5, 8], 2)
    assert runner.config is strategy.options and runner.depth == 3
    strategy.seed = 5
    assert runner.config.seed == 5 and runner.config.stages == 3
