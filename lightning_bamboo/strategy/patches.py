"""Lightning's pieces that ``BambooStrategy`` replaces by subclassing: SIGTERM broadcasts, the launcher, step hooks."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as torch_dist

from lightning_bamboo.engine.comm_process import abort_generation
from lightning_bamboo.engine.groups import reset_group_names
from lightning_bamboo.errors import FatalLoss, Released
from lightning_bamboo.runtime.leave import request_leave

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ SIGTERM under membership
_PATCHED: dict[tuple[type, str], type] = {}


def _under_membership(obj: Any) -> bool:
    runner = getattr(obj.trainer.strategy, "runner", None)
    return runner is not None and runner.session is not None


def _skip_sigterm_broadcast(self: Any) -> None:
    """The epoch loop's per-batch "did rank 0 get SIGTERM" broadcast; skipped under membership."""
    if not _under_membership(self):
        base: Any = type(self).__mro__[1]  # Lightning's class (ours is the subclass made below)
        base._broadcast_sigterm_tensor(self)


def _sigterm_is_a_notice(self: Any, signum: Any, frame: Any) -> None:
    """Lightning's SIGTERM handler; under membership a flag only (never a collective in a handler)."""
    if not _under_membership(self):
        base: Any = type(self).__mro__[1]
        base._sigterm_notifier_fn(self, signum, frame)
        return
    # Not ``received_sigterm``: Lightning would raise SIGTERMException after the batch, and a notice
    # that arrives between a commit and the end of the batch would stop the node before it
    # announced that it leaves (its neighbours would lose the step in flight to a failover).
    request_leave()


_REPLACEMENTS = {"_broadcast_sigterm_tensor": _skip_sigterm_broadcast, "_sigterm_notifier_fn": _sigterm_is_a_notice}


def _without_raw_broadcast(base: type, method: str) -> type:
    """A subclass of Lightning's ``base`` whose ``method`` makes no raw collective under membership."""
    if (base, method) not in _PATCHED:
        _PATCHED[base, method] = type(f"Bamboo{base.__name__}", (base,), {"_bamboo": True, method: _REPLACEMENTS[method]})
    return _PATCHED[base, method]


def no_sigterm_broadcast_under_membership(trainer: Any) -> None:
    """Under the Bamboo launcher, Lightning's per-step SIGTERM broadcast is replaced by the membership protocol.

    Lightning broadcasts a "rank 0 got SIGTERM" flag with a raw ``torch.distributed.broadcast``
    before every batch. With a node just lost that call blocks until the process-group
    timeout (it bypasses the strategy, so no failover can rescue it), and its meaning, stop
    every rank, is the opposite of Bamboo's: a node with a notice leaves alone and its
    neighbours take over (``Session.commit``). The epoch loop gets a subclass that skips
    the broadcast when membership is on and keeps Lightning's behaviour otherwise.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is not None and hasattr(loop, "_broadcast_sigterm_tensor") and not getattr(loop, "_bamboo", False):
        loop.__class__ = _without_raw_broadcast(type(loop), "_broadcast_sigterm_tensor")
    # Lightning's SIGTERM handler broadcasts too (inside the handler); under membership SIGTERM is
    # a preemption notice: flag only, and the node leaves after its next commit.
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None and hasattr(connector, "_sigterm_notifier_fn") and not getattr(connector, "_bamboo", False):
        connector.__class__ = _without_raw_broadcast(type(connector), "_sigterm_notifier_fn")


# ------------------------------------------------------------------ step hooks the pipeline runs instead
def pipeline_step_placeholder(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for a step hook the model does not define: strategy='bamboo' runs the pipeline instead."""
    raise RuntimeError("this step is run by BambooStrategy; it is not meant to be called directly")


def fit_without_val_data(model: Any) -> bool:
    """True when ``model`` is being fit with no validation data (no ``val_dataloader`` anywhere)."""
    trainer = getattr(model, "_trainer", None)
    if trainer is None or str(getattr(trainer.state.fn, "value", trainer.state.fn)) != "fit":
        return False
    return not trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined()


# ------------------------------------------------------------------ the launcher
class _PreflightLauncherMixin:
    """Runs the strategy's checks (options, model, training data) in the launching process before any child
    process starts."""

    _bamboo_strategy: Any
    cluster_environment: Any

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        model = args[0] if args and hasattr(args[0], "configure_optimizers") else None
        if not self.cluster_environment.creates_processes_externally and int(os.environ.get("LOCAL_RANK", 0)) == 0:
            self._bamboo_strategy.check_before_launch(model, trainer, args)
        if trainer is not None and function == getattr(trainer, "_fit_impl", None):
            function = self._restarting(function, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]

    def _restarting(self, fit: Callable, trainer: Any) -> Callable:
        """``fit``, run again from the last complete checkpoint each time a fatal loss ends it under the Bamboo
        launcher, and from the running nodes' state each time this node, released from the layout, is admitted again
        (``strategy.restart``): the user's ``trainer.fit`` returns when the job is done."""
        from lightning_bamboo.strategy.restart import restart_fit, stand_by_fit

        strategy = self._bamboo_strategy

        def fit_through_fatal_losses(*args: Any, **kwargs: Any) -> Any:
            while True:
                try:
                    return fit(*args, **kwargs)
                except FatalLoss as err:
                    if not strategy.runner.can_restart(err):
                        raise
                    args = restart_fit(strategy, trainer, err, args)
                except Released:  # out of the layout: stand by in this process until admitted again
                    args = stand_by_fit(strategy, trainer, args)

        return fit_through_fatal_losses


class _ForkedRanksMixin:
    """Lightning's script launcher starts the other local ranks as ``python`` processes of their own, each importing
    torch, DeepSpeed and Lightning again (4-5 s of a core). On a machine without GPUs, with ``BAMBOO_PRELOAD`` set
    and a shared fork server at ``BAMBOO_FORK_SERVER`` (``launcher.forks.start_shared``), they are forks of that
    server instead: the same command, environment and output, no imports. They run on when this rank ends, as
    processes of their own would. Anywhere else (and under Hydra) Lightning starts them itself."""

    cluster_environment: Any
    num_processes: int
    num_nodes: int
    procs: list[Any]

    def _call_children_scripts(self) -> None:
        forks = _shared_forks()
        if forks is None:
            return super()._call_children_scripts()  # type: ignore[misc]
        import __main__

        self._check_can_spawn_children()  # type: ignore[attr-defined]
        os.environ.update({  # this rank's, as Lightning sets them
            "MASTER_ADDR": self.cluster_environment.main_address, "MASTER_PORT": str(self.cluster_environment.main_port),
            "NODE_RANK": str(self.cluster_environment.node_rank()), "LOCAL_RANK": str(self.cluster_environment.local_rank()),
            "WORLD_SIZE": str(self.num_processes * self.num_nodes)})
        spec = getattr(__main__, "__spec__", None)  # this program again: python -m MODULE, or python SCRIPT
        command = ([sys.executable, "-m", spec.name] if spec is not None else
                   [sys.executable, os.path.abspath(sys.argv[0])]) + sys.argv[1:]
        if not forks.accepts(command):
            forks.close()
            return super()._call_children_scripts()  # type: ignore[misc]
        self.procs = [forks.start(command, {**os.environ, "LOCAL_RANK": str(local_rank)})
                      for local_rank in range(1, self.num_processes)]


def _shared_forks() -> Any:
    """A connection to this machine's shared fork server where ranks may be forked there (see ``_ForkedRanksMixin``),
    else None."""
    from lightning_bamboo.launcher import PRELOAD_ENV
    from lightning_bamboo.launcher.cluster import visible_gpus
    from lightning_bamboo.launcher.forks import SHARED_ENV, ForkServer, ForkServerRefused

    preload = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    address = os.environ.get(SHARED_ENV, "")
    if not preload or not address or visible_gpus() or _hydra_in_use():
        return None
    try:
        return ForkServer(preload, os.environ, runs=("*",), scripts=True, address=address, detached=True)
    except ForkServerRefused as err:  # the ranks start as Lightning starts them: slower, the same job
        log.info("Lightning's ranks start as processes of their own: %s", err)
        return None


def _hydra_in_use() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return bool(HydraConfig.initialized())


_LAUNCHERS: dict[type, type] = {}


def make_launcher_class(base: type) -> type:
    if base not in _LAUNCHERS:
        mixins = (_PreflightLauncherMixin, _ForkedRanksMixin) if hasattr(base, "_call_children_scripts") else (
            _PreflightLauncherMixin,)
        _LAUNCHERS[base] = type(f"Bamboo{base.__name__.lstrip('_')}", (*mixins, base), {})
    return _LAUNCHERS[base]


# ------------------------------------------------------------------ release at exit
_TO_RELEASE: list[Any] = []


def release_at_exit(strategy: Any) -> None:
    """Release ``strategy``'s runner and the process group before the interpreter tears modules down."""
    if not _TO_RELEASE:
        atexit.register(_release)
    if strategy not in _TO_RELEASE:
        _TO_RELEASE.append(strategy)


def _drop_all() -> None:
    """Drop the runners (engines, membership sessions) of every strategy that ran, and destroy the process group."""
    keep: list[Any] = []
    for strategy in _TO_RELEASE:
        keep.extend(strategy.runner.close())
        model = strategy.lightning_module
        if model is not None and hasattr(model, "_bamboo_stage"):
            del model._bamboo_stage
    _TO_RELEASE.clear()
    gc.collect()
    abort_generation()  # nothing in flight survives a failed fit; at a clean exit nothing is in flight
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    reset_group_names()  # a failed connect left torch's group count past 0: the next job would not form
    del keep  # a TCPStore we host goes after the group that used it
    gc.collect()


def _release() -> None:
    """Drop engines and destroy the process group before the interpreter tears modules down.

    Without this a gloo run aborts at interpreter exit about one time in four. Then the heap left
    (about 400,000 objects of torch, DeepSpeed and Lightning, 2 million references) is frozen: the
    interpreter's own exit runs several full collections over it, about 1.3 s of CPU per process,
    which on a machine whose nodes all exit at once (4 nodes on 2 cores) kept them running more than
    10 s after the job finished, and the launcher killed them as hung (issue 41). Every cycle the job
    made is gone by now (``_drop_all`` collected it); frozen objects are still freed by reference
    counting as the modules are torn down, and no finalizer of ours waits for a collection.
    """
    _drop_all()
    gc.freeze()


def release_for_restart() -> None:
    """Free what a failed ``fit()`` left (engines, membership watcher, process group), so that this
    process can run ``fit()`` again in a new job: a restart from a checkpoint without a new process.
    The old generation's communication is aborted first, so nothing can still wait on it. Its two full
    garbage collections take about 0.2 s each in a process of torch, DeepSpeed and Lightning; a worker
    that calls ``gc.freeze()`` once its imports are done (as the demo's does) makes them milliseconds."""
    _drop_all()

