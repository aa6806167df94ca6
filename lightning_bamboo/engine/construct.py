"""Constructing the pipeline module and engine with bounded communication timeouts."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from lightning_bamboo.engine.module import BambooPipelineModule
from lightning_bamboo.engine.pipe import BambooPipelineEngine, EngineOptions
from lightning_bamboo.logs import deepspeed_prints_hidden
from lightning_bamboo.topology.layout import Layout

# DeepSpeed prints a line every `steps_per_print` steps on rank 0 (and at every new engine's first step, as
# the deferred optimizer step leaves global_steps at 0 then); Lightning's progress bar does that job. None: never.
_NEVER = None


@contextmanager
def bounded_group_timeouts(timeout: timedelta) -> Iterator[None]:
    """Give process groups created inside the block ``timeout`` instead of torch's 30-minute default.

    ``torch.distributed.new_group`` without a timeout falls back to a module-level default
    (30 minutes for gloo), and DeepSpeed creates its pipeline and data-parallel groups that way.
    """
    c10d = torch_dist.distributed_c10d
    names = [n for n in ("default_pg_timeout", "default_pg_nccl_timeout") if isinstance(getattr(c10d, n, None), timedelta)]
    saved = {n: getattr(c10d, n) for n in names}
    try:
        for name in names:
            setattr(c10d, name, timeout)
        yield
    finally:
        for name, value in saved.items():
            setattr(c10d, name, value)


#: DeepSpeed's shared-memory all-reduce op for CPUs (``ShareMemCommBuilder``)
SHM_OP = "deepspeed_shm_comm"


def skip_shm_op() -> None:
    """Keep DeepSpeed from loading its shared-memory all-reduce op when its communication layer starts.

    On CPU, ``deepspeed.comm.init_distributed`` JIT-loads that op (and rebuilds it when its build
    files look stale) under a lock file in ``~/.cache/torch_extensions``. A process killed while it
    holds that lock (a SIGKILLed spot node, at any moment) leaves the file behind, and every later
    start on the machine waits for it forever; a rebuild makes every start wait for tens of seconds.
    Seen in the preemption benchmark: a restarted job sat in that wait until it was stopped.
    lightning_bamboo never uses the op (it serves DeepSpeed's ``inference_all_reduce``), so it is
    marked incompatible, which DeepSpeed reads as "do not load".
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False


def init_deepspeed_comm(**kwargs: Any) -> None:
    """``deepspeed.comm.init_distributed(**kwargs)`` without its shared-memory op (``skip_shm_op``):
    every start of DeepSpeed's communication layer in lightning_bamboo goes through here."""
    import deepspeed.comm as ds_comm

    skip_shm_op()
    ds_comm.init_distributed(**kwargs)


def ensure_deepspeed_comm(backend: str) -> None:
    """Let DeepSpeed's communication layer use the process group that is already initialised."""
    init_deepspeed_comm(dist_backend=backend, dist_init_required=False, auto_mpi_discovery=False)


def deepspeed_config(
    micro_batch_size: int,
    micro_batches: int,
    pipelines: int,
    gradient_clipping: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config of a pipeline engine; ``extra`` (e.g. ``bf16``) is merged on top."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batch_size * micro_batches * pipelines,
        "steps_per_print": _NEVER,
        "gradient_clipping": gradient_clipping,
        "wall_clock_breakdown": False,
    }
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def build_pipeline_module(
    layers: Sequence[Any], layout: Layout, loss_fn: Callable[..., torch.Tensor] | None, timeout: timedelta
) -> BambooPipelineModule:
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    topology = PipeDataParallelTopology(num_pp=layout.stages, num_dp=layout.pipelines)
    with bounded_group_timeouts(timeout), deepspeed_prints_hidden():
        return BambooPipelineModule(layers, layout.parts, topology=topology, loss_fn=loss_fn)


def build_engine(
    module: Any,
    optimizer: torch.optim.Optimizer | None,
    config: dict[str, Any],
    timeout: timedelta,
    lr_scheduler: Any = None,
    engine_cls: type[BambooPipelineEngine] = BambooPipelineEngine,
    options: EngineOptions | None = None,
    **engine_kwargs: Any,
) -> BambooPipelineEngine:
    """Construct the engine directly: ``deepspeed.initialize`` hard-codes ``PipelineEngine``.

    ``options``: what lightning_bamboo tells the engine (none: plain DeepSpeed); ``engine_kwargs`` are more of
    ``DeepSpeedEngine``'s arguments (``args``, ``training_data``, ...).
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    mpu = module.mpu()
    engine_kwargs.setdefault("dist_init_required", False)
    engine_kwargs.setdefault("args", None)
    with bounded_group_timeouts(timeout):
        engine = engine_cls(
            model=module,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            config=config,
            config_class=DeepSpeedConfig(config, mpu),
            options=options,
            **engine_kwargs,
        )
    return engine


def retire(engine: BambooPipelineEngine) -> None:
    """Let go of what keeps an engine that was replaced (by a failover, a move, a restart) alive.

    DeepSpeed registers backward hooks on a step's outputs and loss that call the engine back, and keeps the last
    micro-batch's in its pipeline buffers: a reference cycle through the autograd graph, which the garbage collector
    cannot see, so the engine, its stage's weights and optimizer state outlived it (three engines alive after a
    failover and a move, and the previous stage's 0.5 GiB after a restart, at GPT-2 small's shape). With those
    tensors dropped, the cycles left are plain Python ones that the next collection frees."""
    engine.pipe_buffers = {key: [] for key in engine.pipe_buffers}
    engine.loss = engine.total_loss = engine.outputs = None
    engine.fwd_outputs = []
    engine.redundant = None
