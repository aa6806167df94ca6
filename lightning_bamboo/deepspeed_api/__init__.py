"""``lightning_bamboo.initialize``: the drop-in for ``deepspeed.initialize`` in existing DeepSpeed projects."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.runtime.config import DEFAULT_DETECTION_SECONDS, DEFAULT_TIMEOUT_SECONDS, BambooConfig
from lightning_bamboo.runtime.refusal import refused_quietly, report_config_errors_briefly

BAMBOO_KEY = "bamboo"
_TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def _refused_once(door: Callable[..., Any]) -> Callable[..., Any]:
    """A ``BambooConfigError`` from ``door``: under the Bamboo launcher one message for the job (the first worker's)
    and exit status 2, as the Lightning door does; elsewhere the rule and the user's line, without a traceback
    (``BAMBOO_TRACEBACK=1`` keeps it). The error is raised unchanged for a caller that catches it."""

    @functools.wraps(door)
    def checked(*args: Any, **kwargs: Any) -> Any:
        report_config_errors_briefly()
        with refused_quietly():
            return door(*args, **kwargs)

    return checked


def bamboo_options(config: dict[str, Any]) -> BambooConfig:
    """The ``"bamboo"`` section of a DeepSpeed config as the ``BambooConfig`` both doors run (checked; what the
    ``PipelineModule`` and the rest of the config give is added when the engine is built)."""
    return BambooConfig.from_deepspeed(config.get(BAMBOO_KEY))


@_refused_once
def init_distributed(timeout: float = DEFAULT_TIMEOUT_SECONDS, dist_backend: str | None = None,
                     detection_timeout: float = DEFAULT_DETECTION_SECONDS, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` with ``timeout`` for the default group *and* every group made later.

    Call it before building a ``PipelineModule``: DeepSpeed creates the pipeline's process
    groups there, and torch gives groups created without a timeout its 30-minute default.
    Under the Bamboo launcher it joins the job's membership first (a node lost from then on is found within
    ``detection_timeout`` seconds) and forms the group on the abortable backend, as ``BambooStrategy`` does.
    """
    import torch.distributed as torch_dist

    from lightning_bamboo.runtime.session import launched_by_bamboo

    if launched_by_bamboo() and not torch_dist.is_initialized():
        from lightning_bamboo.deepspeed_api.resilient import open_job

        c10d = torch_dist.distributed_c10d
        for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
            if isinstance(getattr(c10d, name, None), timedelta):
                setattr(c10d, name, timedelta(seconds=timeout))
        open_job(timeout, detection_timeout)
        return

    delta = timedelta(seconds=timeout)
    c10d = torch_dist.distributed_c10d
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if isinstance(getattr(c10d, name, None), timedelta):
            setattr(c10d, name, delta)
    from lightning_bamboo.engine.construct import init_deepspeed_comm

    init_deepspeed_comm(dist_backend=dist_backend, timeout=delta, **kwargs)


@_refused_once
def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = _TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: str | dict[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | dict[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Same signature and return value as ``deepspeed.initialize``, for a ``PipelineModule``.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` where ``engine`` is, under the Bamboo
    launcher, a :class:`~lightning_bamboo.deepspeed_api.resilient.ResilientPipelineEngine` (replicas and failover),
    elsewhere a :class:`~lightning_bamboo.engine.pipe.BambooPipelineEngine`. Bamboo's options live under
    the config's ``"bamboo"`` key: ``{"redundancy": "off" | "lazy" | "eager" | "auto", "timeout": seconds,
    "notices": [...], "rebalance": true | {...}}``; replicas, notices and rebalancing need the Bamboo launcher
    (docs/deepspeed.md).
    """
    from deepspeed.pipe import PipelineModule

    if not isinstance(model, PipelineModule):
        raise BambooConfigError(
            f"lightning_bamboo.initialize takes a deepspeed.pipe.PipelineModule (got {type(model).__name__}); "
            f"wrap the layers with PipelineModule(layers=..., num_stages=...) or use deepspeed.initialize"
        )
    if mpu is not None:
        raise BambooConfigError("mpu must be None with a PipelineModule: its topology defines the groups")
    if mesh_param is not None:
        raise BambooConfigError("mesh_param (sequence parallelism) is not supported with pipeline parallelism")
    config = config if config is not None else config_params
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config = args.deepspeed_config
    if config is None:
        raise BambooConfigError("a DeepSpeed config is required: pass config={...} or a path to a JSON file")
    if not isinstance(config, dict):
        with open(config) as f:
            config = json.load(f)
    assert isinstance(config, dict)
    config = copy.deepcopy(config)
    options = bamboo_options(config)
    config.pop(BAMBOO_KEY, None)
    from lightning_bamboo.runtime.session import launched_by_bamboo

    if launched_by_bamboo():
        # under the Bamboo launcher: the runner's engine, with replicas (lazy, eager) and failover
        from lightning_bamboo.deepspeed_api.resilient import ResilientPipelineEngine

        resilient = ResilientPipelineEngine(model, config, options, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                            training_data=training_data, collate_fn=collate_fn)
        return resilient, resilient.optimizer, resilient.training_dataloader, resilient.lr_scheduler
    if options.redundancy_with(membership=False) != "off":
        raise BambooConfigError(
            f'"{BAMBOO_KEY}.redundancy" = {options.redundancy!r} needs the Bamboo launcher, whose membership store '
            "finds a lost node: start the script with python -m lightning_bamboo.launcher --nodes N -- python SCRIPT "
            '(lightning_bamboo.init_distributed() then joins the job), or use "redundancy": "off"'
        )
    if options.rebalance:
        raise BambooConfigError(
            f'"{BAMBOO_KEY}.rebalance" = {options.rebalance!r} moves layers between the nodes of a job and admits '
            "standby nodes, which needs the Bamboo launcher's membership; start the script with python -m "
            'lightning_bamboo.launcher --nodes N -- python SCRIPT, or leave "rebalance" out'
        )
    if options.notices:
        raise BambooConfigError(
            f'"{BAMBOO_KEY}.notices" = {list(options.notices)!r}: a node leaves at a notice and the others take its '
            "stage, which needs the Bamboo launcher's membership; start the script with python -m "
            'lightning_bamboo.launcher --nodes N -- python SCRIPT, or leave "notices" out'
        )

    from deepspeed.accelerator import get_accelerator

    from lightning_bamboo.engine.construct import build_engine, init_deepspeed_comm
    from lightning_bamboo.engine.pipe import EngineOptions

    timeout = timedelta(seconds=options.timeout)
    init_deepspeed_comm(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
        timeout=timeout,
    )
    engine = build_engine(
        model, optimizer, config, timeout, lr_scheduler=lr_scheduler,
        options=EngineOptions(options.redundancy_with(membership=False)), args=args,
        model_parameters=model_parameters, training_data=training_data,
        dist_init_required=dist_init_required, collate_fn=collate_fn,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
