"""A node driven by ``PipelineRunner`` alone: plain torch and a host of a few lines, no Lightning.

Run by ``tests/test_runner.py`` under ``lightning_bamboo.launcher.launch`` (membership in a store):
``runner_node.py OUT STEPS RECONFIGURE_AT [DEVICE [REDUNDANCY]]``. Trains STEPS steps of a 6-layer MLP; at step
RECONFIGURE_AT (if not -1) the nodes that are left re-split the layers evenly (every layer has dropout); writes OUT/<node>.pt
(its layers' weights and optimizer state) and OUT/<node>.json (its failovers and its final layout).
DEVICE (default cpu): ``cuda`` puts every node's stage and replica on GPU 0 (the nodes share it).
REDUNDANCY (default lazy): ``eager`` places the redundant forwards by the model's costs (F = 1, B = 2), so that
a kill at a given schedule step finds a known number of them run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_bamboo.engine.comm_process import BACKEND
from lightning_bamboo.engine.pipe import BambooPipelineEngine
from lightning_bamboo.runtime import BambooConfig, PipelineRunner
from lightning_bamboo.topology import even_parts

LAYERS, WIDTH, BATCH, DROPOUT = 6, 8, 8, 0.25


class Model:
    def configure_pipeline(self) -> list[nn.Module]:
        # dropout: a layer's random numbers must not depend on the stage that runs it (engine.layer_rng)
        return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(DROPOUT)) for _ in range(LAYERS)]

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)


class Host:
    """What a plain training loop tells the runner: its step counter and its optimizer."""

    def __init__(self) -> None:
        self.step = 0
        self.optimizer: torch.optim.Optimizer | None = None

    def global_step(self) -> int:
        return self.step

    def adopt_stage(self, module: nn.Module) -> None:
        self.stage = module

    def optimizer_for(self, module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=1e-2)

    def setup_optimizers(self, module: nn.Module) -> torch.optim.Optimizer:
        self.optimizer = self.optimizer_for(module)
        return self.optimizer

    def rebind_optimizer(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        self.optimizer = new

    def enter_group(self, rank: int, world: int) -> None:
        pass

    def training_state(self) -> dict[str, Any]:
        return {"step": self.step}

    def global_micro_batches(self) -> int | None:
        return None  # each pipeline loads its own batches


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)


def main(out: Path, steps: int, reconfigure_at: int, device: str = "cpu", redundancy: str = "lazy") -> None:
    host = Host()
    config = BambooConfig(redundancy=redundancy, micro_batch_size=2, seed=7, timeout=60.0, detection_timeout=3.0,
                          rf_costs={"forward": 1, "backward": 2} if redundancy == "eager" else "measured")
    runner = PipelineRunner(config, host, device=device)
    session = runner.open_session()
    assert session is not None, "run under lightning_bamboo.launcher.launch"
    dist.init_process_group(BACKEND, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))  # abortable
    runner.start(Model(), dist.get_world_size(), dist.get_rank(), fitting=True)
    taken = None
    for step in range(steps):
        host.step = step
        if step == reconfigure_at:
            nodes = runner.nodes
            before = {id(layer) for part in _layer_objects(runner).values() for layer in part.values()}
            runner.reconfigure(nodes, even_parts(LAYERS, len(nodes)))
            after = _layer_objects(runner)
            # which layers of the new stage and replica are the node's own objects from before (taken over, not built)
            taken = {part: sorted(i for i, layer in after[part].items() if id(layer) in before) for part in after}
        runner.train_step(batch(step))
    assert runner.engine is not None and runner.layout is not None
    torch.save(runner.engine.own_states(), out / f"{session.node}.pt")
    report = {"failovers": [f.as_dict() for f in runner.failovers], "parts": list(runner.layout.parts), "nodes": runner.nodes,
              "device": str(next(runner.engine.module.parameters()).device),
              "taken_over": taken,
              # engines alive now, without a collection of this script's own: the ones the failover and the
              # reconfiguration replaced are gone (``NodeStage.collect_retired``)
              "engines": sum(isinstance(o, BambooPipelineEngine) for o in gc.get_objects())}
    (out / f"{session.node}.json").write_text(json.dumps(report))
    runner.finish(completed=True)
    runner.close()
    dist.destroy_process_group()


def _layer_objects(runner: PipelineRunner) -> dict[str, dict[int, nn.Module]]:
    engine = runner.engine
    assert engine is not None
    children = {"stage": engine.module, "replica": engine.replica.module if engine.replica is not None else nn.Module()}
    return {part: {int(n): m for n, m in module.named_children() if n.isdigit()} for part, module in children.items()}


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6])
