"""``BambooPipelineEngine``: DeepSpeed's pipeline engine with replicas, a committed optimizer step and failover hooks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.engine import heap
from lightning_bamboo.engine.exchange import GradientExchange
from lightning_bamboo.engine.guard import StepGuard, is_comm_error
from lightning_bamboo.engine.layer_rng import StepKeys
from lightning_bamboo.engine.precision import Precision, StepFinish, StepResult, scaled_loss
from lightning_bamboo.engine.probe import measure_layers
from lightning_bamboo.engine.program import (
    BambooTrainSchedule,
    RecvReplicaSync,
    RedundantForward,
    ReplicaUpdate,
    SendReplicaSync,
    redundant_forwards_placed,
)
from lightning_bamboo.engine.replica import Replica
from lightning_bamboo.engine.replica_location import as_leaf, detached, on_host, saved_on_host, to_device
from lightning_bamboo.errors import BambooConfigError, PeerLost
from lightning_bamboo.schedule import REDUNDANCY_MODES, Costs
from lightning_bamboo.testing import faults

log = logging.getLogger(__name__)


class _RedundantStep:
    """What eager redundancy keeps during one step: RF inputs in micro-batch order, and each RF's (input, output)."""

    def __init__(self) -> None:
        self.inputs: list[Any] = []
        self.kept: dict[int, tuple[Any, Any]] = {}


@dataclass(frozen=True)
class EngineOptions:
    """What lightning_bamboo tells an engine beyond DeepSpeed's config (the defaults run it as plain DeepSpeed)."""

    #: ``"off"``, ``"lazy"`` or ``"eager"``: eager runs the successor's forwards in the bubbles (with a replica)
    redundancy: str = "off"
    #: where eager's RFs go: ``"measured"`` (this stage's own backward/forward ratio) or fixed ``Costs``
    rf_costs: Costs | str = "measured"
    #: the seed of the layers' random streams (``layer_rng``); None: the process's streams, as DeepSpeed draws them
    seed: int | None = None
    #: how the engine computes; None: fp32
    precision: Precision | None = None

    def __post_init__(self) -> None:
        if self.redundancy not in REDUNDANCY_MODES:
            raise BambooConfigError(f"EngineOptions.redundancy must be one of {REDUNDANCY_MODES}, got "
                                    f"{self.redundancy!r}")
        if self.rf_costs != "measured" and not isinstance(self.rf_costs, Costs):
            raise BambooConfigError(f"EngineOptions.rf_costs must be 'measured' or a Costs, got {self.rf_costs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise BambooConfigError(f"EngineOptions.seed must be None or an int, got {self.seed!r}")


@dataclass
class Wiring:
    """What an engine is connected to (:meth:`BambooPipelineEngine.wire`); the defaults run it as plain DeepSpeed."""

    node: str = ""
    #: ``commit(step)`` returns once every node's part of the step is in; raises PeerLost otherwise
    commit: Callable[[int], None] | None = None
    #: runs each step on a worker thread and ends it with PeerLost when a peer is lost
    guard: StepGuard | None = None
    replica: Replica | None = None
    replica_peers: tuple[int | None, int | None] = (None, None)
    #: per stage of the pipeline, whether its replica is held (``topology.replicas.kept_replicas``); None: every
    #: stage's where the engine has a replica or a holder (the program has the replica actions of those only)
    kept: tuple[bool, ...] | None = None


class BambooPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` that lightning_bamboo builds directly (``deepspeed.initialize`` cannot).

    With a replica or a commit hook, the optimizer step of a batch is deferred: the
    ``OptimizerStep`` instruction only finishes the gradients (unscale, clip). With a replica the
    engine runs its stage's program of ``schedule.build_schedule`` (:mod:`lightning_bamboo.engine.program`): it ships the
    finished gradients to the replica's holder and receives the successor's once the loss went out;
    then ``commit`` decides whether the step counts everywhere, and only then is the own optimizer
    step applied and the replica's taken on (applied where the next step's program says, ``U``).
    A failure before that leaves every survivor with an unchanged model.
    """

    def __init__(self, *args: Any, options: EngineOptions | None = None, **kwargs: Any) -> None:
        """DeepSpeed's ``PipelineEngine(*args, **kwargs)``, told ``options``; :meth:`wire` connects it."""
        # set before DeepSpeed's constructor, which may call methods of this class
        self.options = options or EngineOptions()
        self.replica: Replica | None = None
        #: global ranks this process ships its gradients to / receives its replica's from
        self.replica_peers: tuple[int | None, int | None] = (None, None)
        #: the stages of the pipeline whose replicas are held (None: every one; ``Wiring.kept``)
        self.kept: tuple[bool, ...] | None = None
        #: called after the schedule ran, before the update; raises PeerLost if the step does not commit
        self.commit: Callable[[int], None] | None = None
        #: the watchdog running train_batch; None runs it on the calling thread
        self.guard: StepGuard | None = None
        self.node_id = ""
        #: the index of the step running now plus one (the steps begun), from train_batch's ``step``
        self.batches_run = 0
        #: this pipeline's share of the step's global batch, ``(micro-batches, total)``; None: its own batch
        self.share: tuple[int, int] | None = None
        #: the index of this pipeline's first micro-batch in the step's global batch (its layers' random streams)
        self.first_micro_batch = 0
        self.redundant_forwards_run = 0
        #: seconds spent on redundancy, summed over steps: shipping the own gradients, waiting for the replica's,
        #: commit, replica update, eager RFs
        self.replica_seconds = {"ship": 0.0, "receive": 0.0, "commit": 0.0, "replica_step": 0.0,
                                "redundant_forward": 0.0}
        #: the RF state of the step running now (None outside a training step or without eager redundancy)
        self.redundant: _RedundantStep | None = None
        #: the program of the step running now (None: DeepSpeed's ``TrainSchedule``)
        self.program: BambooTrainSchedule | None = None
        #: what the step's ``StepFinish`` found (None: it did not run)
        self.finished: StepResult | None = None
        self.phase = "idle"  # schedule -> commit -> apply -> idle; "apply" is local work and is never abandoned
        self.last_loss: torch.Tensor | None = None
        self._pending_step = False
        self._gradients_received = 0
        self._measured_costs: Costs | None = None
        self._action_seconds: dict[str, list[float]] = {"forward": [], "backward": []}
        self._exchange: GradientExchange | None = None
        self._exchange_key: Any = None
        #: per layer, what one micro-batch of it holds (saved bytes, output bytes): measured at the engine's first
        #: training forward (``engine.probe``), and the replica's at its first redundant forward
        self.layer_memory: dict[int, tuple[int, int]] = {}
        super().__init__(*args, **kwargs)

    def wire(self, wiring: Wiring) -> None:
        """Connect the engine to its replica, its exchange peers and (under membership) its commit and watchdog."""
        self.node_id, self.commit, self.guard = wiring.node, wiring.commit, wiring.guard
        self.replica, self.replica_peers = wiring.replica, wiring.replica_peers
        self.kept = wiring.kept

    # ------------------------------------------------------------------ eager redundancy
    @property
    def eager(self) -> bool:
        """Whether this engine runs the successor's forward in the bubbles (``redundancy="eager"`` with a replica)."""
        return self.replica is not None and self.options.redundancy == "eager"

    @property
    def redundancy(self) -> str:
        """The program this engine runs (``schedule.build_schedule``'s modes): ``"eager"``; ``"lazy"`` with a
        replica or a holder of its own; ``"off"`` (DeepSpeed's ``TrainSchedule``) otherwise."""
        if self.eager:
            return "eager"
        if self.num_stages > 1 and (self.replica is not None or self.replica_peers[0] is not None):
            return "lazy"
        return "off"

    def _train_schedule(self) -> Any:
        redundancy = self.redundancy
        if redundancy == "off":
            self.program = None
            return super()._train_schedule()
        costs = self.rf_costs if redundancy == "eager" else None
        self.program = BambooTrainSchedule(self.micro_batches, self.num_stages, self.stage_id, redundancy, costs,
                                           self._kept())
        return self.program

    def _kept(self) -> tuple[bool, ...] | None:
        """The stages whose replica actions the program has: ``kept``, or (None) every one."""
        kept = self.kept
        return kept if kept is not None and len(kept) == self.num_stages and not all(kept) else None

    # ------------------------------------------------------------------ where eager's RFs go
    #: training steps whose forward and backward times are measured (after the first, which allocates)
    COST_STEPS = range(1, 4)

    @property
    def rf_costs(self) -> Costs | None:
        """The action costs eager's RFs are placed with: ``options.rf_costs`` (a ``Costs``), or with
        ``"measured"`` (the default) this stage's own backward/forward time ratio over ``COST_STEPS``
        (rounded to 0.1, so the placement is built once), or the model's F = 1, B = 2 until then."""
        option = self.options.rf_costs
        if isinstance(option, Costs):
            return option
        if self._measured_costs is not None:
            return self._measured_costs
        times = self._action_seconds
        if self.batches_run - 1 < self.COST_STEPS.stop or not times["forward"] or not times["backward"]:
            return None
        import statistics

        ratio = max(0.1, round(statistics.median(times["backward"]) / statistics.median(times["forward"]), 1))
        costs = self._measured_costs = Costs(forward=1, backward=ratio)
        placed = [redundant_forwards_placed(self.num_stages, self.micro_batches, self.stage_id, c) for c in (costs, None)]
        log.info("%s: eager RFs placed with measured costs F = 1, B = %.1f: %d per step (the model's F = 1, B = 2: %d)",
                 self.node_id or f"rank {self.global_rank}", ratio, *placed)
        return costs

    def _timed(self, kind: str, fn: Callable[[], None]) -> None:
        if not self.eager or self.batches_run - 1 not in self.COST_STEPS:
            fn()
            return
        started = time.perf_counter()
        fn()
        self._action_seconds[kind].append(time.perf_counter() - started)

    def _exec_backward_timed(self, buffer_id: int) -> None:
        if self.is_last_stage() and self.precision.scaling is not None:
            self.loss: Any = scaled_loss(self.loss, self.precision)  # fp16: the backward starts from the scaled loss
        self._timed("backward", lambda: PipelineEngine._exec_backward_pass(self, buffer_id))

    @property
    def precision(self) -> Precision:
        """How this engine computes (``engine.precision``): fp32, or bf16/fp16 under autocast with fp32 masters."""
        return self.options.precision if self.options.precision is not None else _FP32

    def _finish_gradients(self) -> StepResult | None:
        """Unscale (fp16), the global norm and clipping, and whether the step is skipped (an overflow anywhere)."""
        if not self.precision.finishes_step:
            return None
        import torch.distributed as dist

        result = StepFinish(self.precision).run(self.module, self.module._num_layers, self.grid.data_parallel_id == 0,
                                                dist.all_reduce, self.device)
        self._global_grad_norm = result.norm
        return result

    def _skip_step(self) -> None:
        """An fp16 overflow (or a non-finite norm): the update is skipped everywhere, as DeepSpeed skips it."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _update_loss_scale(self) -> None:
        scaling = self.precision.scaling
        if self.finished is not None and self.precision.state is not None and scaling is not None:
            self.precision.state.update(self.finished.overflow, scaling)

    def _next_batch(self) -> Any:
        batch = super()._next_batch()
        if self.redundant is not None and self.is_last_stage() and self.replica is not None and self.replica.stage == 0:
            self.redundant.inputs.append(on_host(batch[0]))  # stage 0's RF runs on the loaded inputs
        return batch

    def _exec_forward_keeping_output(self, buffer_id: int) -> None:
        if self.phase == "schedule" and self.module._local_start not in self.layer_memory:
            self.layer_memory.update(measure_layers(enumerate(self.module.forward_funcs, start=self.module._local_start),
                                                    self.module, self.pipe_buffers["inputs"][buffer_id],
                                                    self.precision.autocast(self.device)))
        self._timed("forward", lambda: PipelineEngine._exec_forward_pass(self, buffer_id))
        if self.redundant is not None and not self.is_last_stage():
            self.redundant.inputs.append(on_host(detached(self.pipe_buffers["outputs"][buffer_id])))

    def _exec_redundant_forward(self, stage: int, micro_batch: int, buffer_id: int) -> None:
        assert self.redundant is not None and self.replica is not None
        if self.replica.due:
            raise RuntimeError(f"the program runs {stage}RF{micro_batch} before {stage}U: a redundant forward runs on "
                               "the replica's weights of this step (schedule.build puts U before the first RF)")
        started = time.perf_counter()
        # The successor's layers draw what they draw on the successor (the step's keys: an engine with a replica
        # is built by the runtime, with a seed), and the process's streams are left as they were.
        keys = self.module.keys
        assert keys is not None, "redundant forwards run only in an engine built with a seed (NodeStage)"
        if self.replica.module.indices[0] not in self.layer_memory:
            self.layer_memory.update(measure_layers(self.replica.module.calls(), self.replica.module,
                                                    to_device(self.redundant.inputs[micro_batch], self.device),
                                                    self.precision.autocast(self.device)))
        with torch.enable_grad(), saved_on_host(self.device), self.precision.autocast(self.device):
            leaf = as_leaf(to_device(self.redundant.inputs[micro_batch], self.device))
            self.redundant.kept[micro_batch] = (leaf, self.replica.compute_module().run(leaf, keys, micro_batch))
        self.redundant_forwards_run += 1
        self.replica_seconds["redundant_forward"] += time.perf_counter() - started

    # ------------------------------------------------------------------ micro-batches
    def set_micro_batches(self, micro_batches: int) -> None:
        """Run the next batch as ``micro_batches`` micro-batches (the micro-batch size is fixed)."""
        if micro_batches != self.micro_batches:
            self.set_train_batch_size(self.micro_batch_size * micro_batches * self.grid.data_parallel_size)

    @property
    def layer_range(self) -> range:
        """Indices of the layers this process owns."""
        return range(self.module._local_start, self.module._local_stop)

    def own_states(self, copy: bool = True) -> dict[int, dict[str, Any]]:
        """Weights and optimizer state of this stage's layers, by layer (CPU copies; without ``copy``, a CPU stage's
        own tensors)."""
        return ckpt.layer_states(self.module, self.optimizer, self.layer_range, copy=copy)

    def save_layer_checkpoint(self, path: str, client_state: dict[str, Any] | None = None) -> None:
        """Save in lightning_bamboo's per-layer format (every process calls it).

        ``lightning_bamboo.consolidate_checkpoint(path)`` turns it into one state_dict, and a
        run with another number of stages or pipelines can load it.
        """
        import torch.distributed as dist

        def meta() -> dict[str, Any]:
            extra = {"global_steps": self.global_steps}
            return {**(client_state or {}), "bamboo": ckpt.bamboo_meta(
                self.module._num_layers, self.module.parts, self.grid.data_parallel_size, self.optimizer,
                ties=getattr(self.module, "ties", None), **extra)}

        ckpt.save_sharded(
            path, self.module, self.optimizer, self.layer_range, meta,
            is_global_zero=dist.get_rank() == 0, writes_layers=self.grid.data_parallel_id == 0,
            barrier=lambda name: dist.barrier(),
        )

    # ------------------------------------------------------------------ the step
    @property
    def defers_step(self) -> bool:
        return self.replica is not None or self.commit is not None or self.replica_peers[0] is not None

    def train_batch(self, data_iter: Any = None, step: int | None = None,
                    share: tuple[int, int] | None = None, first_micro_batch: int = 0) -> torch.Tensor:
        """One training step (``step``: its index, default the next; ``share`` and ``first_micro_batch``: see
        :attr:`share` and :attr:`first_micro_batch`)."""
        step = self.batches_run if step is None else step
        self.batches_run, self.share, self.first_micro_batch = step + 1, share, first_micro_batch
        faults.reached(self.node_id, step)
        if self.guard is None:
            return self._train_and_commit(data_iter, step)
        return self.guard.run(lambda: self._train_and_commit(data_iter, step), busy=lambda: self.phase == "apply")

    def step_keys(self, step: int) -> StepKeys | None:
        """What the layers' random streams of training step ``step`` are seeded from (``layer_rng``); None when the
        engine was built without a seed (plain DeepSpeed: the process's streams, as DeepSpeed draws them)."""
        seed = self.options.seed
        if seed is None:
            return None
        return StepKeys(seed, step, self.first_micro_batch, (self.device.index or 0) if self.device.type == "cuda" else None)

    def _train_and_commit(self, data_iter: Any, step: int) -> torch.Tensor:
        self._pending_step = False
        self.phase = "schedule"
        self.module.keys, self.module.forwards = self.step_keys(step), 0
        self.redundant = _RedundantStep() if self.eager else None
        try:
            loss = super().train_batch(data_iter)
        finally:
            self._end_splice()
        self.last_loss = loss
        if self.program is not None:
            for cmd in self.program.after_loss:  # S<: once the loss went out (``engine.program``)
                self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)
        if self._pending_step:
            if self.commit is not None:
                self.phase = "commit"
                started = time.perf_counter()
                self.commit(step)
                self.replica_seconds["commit"] += time.perf_counter() - started
            faults.reached(self.node_id, f"apply{step}")  # tests: committed everywhere, applied nowhere yet
            self.phase = "apply"
            self.apply_step()
        self.phase = "idle"
        return loss

    def _end_splice(self) -> None:
        """A step after an eager failover reuses the kept forwards once; then the module runs plainly again."""
        splice = getattr(self.module, "splice", None)
        if splice is None:
            return
        self.module.splice = None
        log.warning("%s: the redone step reused %d of %d kept redundant forwards (micro-batches %s) and ran %d lazy "
                    "backwards through them", self.node_id, len(splice.reused), len(splice.kept), splice.reused,
                    splice.backwards)

    def apply_step(self) -> None:
        """Apply the deferred update of the own stage and the replica (after the step committed)."""
        self.redundant = None  # the step counts: what a lazy backward would have needed is freed
        skip = self.finished is not None and self.finished.overflow
        if skip:
            self._skip_step()
        else:
            heap.give_back()  # what the activations left: the update's temporaries would come on top of it
            PipelineEngine._exec_optimizer_step(self)
        self._update_loss_scale()
        exchange = self._exchange
        if exchange is not None:
            exchange.owner_stepped()  # whether its gradients may be written ahead (``write_ahead``)
        if self.replica is not None and self.replica.pending:
            if skip:
                self.replica.discard()
            else:
                self.replica.step(self.optimizer, defer=True)  # applied where the next step first waits
        self._pending_step = False

    def discard_step(self) -> None:
        """Forget the gradients of a step that did not commit."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.replica is not None:
            self.replica.discard()
        self._pending_step = False

    def _exec_deferred_optimizer_step(self, lr_kwargs: Any = None) -> None:
        # Clipped (and unscaled) before they are shipped: the replica receives what the owner's optimizer consumes.
        self.finished = self._finish_gradients()
        if not self.defers_step:
            if self.finished is not None and self.finished.overflow:
                self._skip_step()
            else:
                PipelineEngine._exec_optimizer_step(self, lr_kwargs)
            self._update_loss_scale()
            return None
        self._pending_step = True  # applied once the step commits (the program's S> ships what was finished)

    def _exec_replica_update(self, stage: int) -> None:
        """``U``: the replica's update of the last step, where the program put it (its longest wait)."""
        self._settle_replica(update=True)

    def _exec_send_replica_sync(self, stage: int, peer: int) -> None:
        """``S>``: ship the gradients ``OptimizerStep`` finished to the replica's holder, without waiting."""
        started = time.perf_counter()
        self.exchange.ship(self.module)
        self.replica_seconds["ship"] += time.perf_counter() - started

    def _exec_recv_replica_sync(self, stage: int, peer: int) -> None:
        """``S<``: wait for the replica's gradients (``after_loss``); the next step's ``U`` applies them."""
        started = time.perf_counter()
        self.exchange.receive()
        self.replica_seconds["receive"] += time.perf_counter() - started

    @property
    def exchange(self) -> GradientExchange:
        """The gradient exchange with this engine's replica peers (rebuilt when they change)."""
        key = (self.replica, self.replica_peers)
        if self._exchange is None or self._exchange_key != key:
            self._exchange, self._exchange_key = GradientExchange(self.replica, *self.replica_peers), key
        return self._exchange

    def release_exchange(self) -> None:
        """Let go of the gradient exchange's buffers (its shared memory too): a failover that captured this engine's
        states never runs it again, and they would stay mapped beside the new engine's until it is collected."""
        exchange, self._exchange, self._exchange_key = self._exchange, None, None
        if exchange is not None:
            exchange.release()

    def _settle_replica(self, update: bool = True) -> None:
        """Where the step waits: apply the last step's replica update (``update``: the program's ``U``), answer
        "read" for the gradients it used, and let the successor's gradients in early."""
        if update and self.replica is not None and self.replica.due:
            self.replica_seconds["replica_step"] += self.replica.settle()
        if self.phase == "schedule" and self.defers_step:
            self.exchange.acknowledge()
            self.exchange.post_receive()

    def _exec_recv_grads_settling(self, buffer_id: int) -> None:
        self._settle_replica(update=False)
        self._write_ahead_at_last_gradient()
        PipelineEngine._exec_recv_grads(self, buffer_id)

    def _exec_recv_activations_settling(self, buffer_id: int) -> None:
        self._settle_replica(update=False)
        PipelineEngine._exec_recv_activations(self, buffer_id)

    def _write_ahead_at_last_gradient(self) -> None:
        """At the step's last gradient receive, before the last backward, write the own gradients ahead into the
        replica holder's shared memory (``GradientExchange.write_ahead``): that backward accumulates there and the
        ship copies nothing. Not on the last stage: its ship runs while the stages before it run their last
        backwards, off the critical path, and its last activation often comes without a wait."""
        if not (self.phase == "schedule" and self.defers_step):
            return
        self._gradients_received += 1
        if self._gradients_received == self.micro_batches:
            self.exchange.write_ahead(self.module)

    def _exec_reduce_tied_grads_bamboo(self) -> None:
        """DeepSpeed's tied-gradient reduction (nothing: it sees no ``TiedLayerSpec``), then ours: every copy of a
        tied module gets the sum of the copies' gradients in layer order (``engine.ties``), the same bit for bit
        whichever stages hold them."""
        PipelineEngine._exec_reduce_tied_grads(self)
        ties = getattr(self.module, "ties", None)  # a plain PipelineModule (``deepspeed.initialize``) has DeepSpeed's
        if ties:
            from lightning_bamboo.engine.ties import reduce_tied_gradients

            pipeline = self.grid.data_parallel_id
            reduce_tied_gradients(self.module, ties, lambda layer: self.grid.stage_to_global(
                stage_id=self.module.stage_owner(layer), data=pipeline))

    def _exec_reduce_grads_weighted(self) -> None:
        """Average over samples, not over pipelines, when the pipelines ran different numbers of micro-batches.

        DeepSpeed averages each pipeline's gradients over its own micro-batches, then over the
        pipelines: with ``m_p`` of ``M`` micro-batches on pipeline ``p`` of ``P``, scaling its gradients
        by ``m_p * P / M`` first makes the result the mean over all ``M``, as with an even split.
        """
        share, pipelines = self.share, self.grid.data_parallel_size
        if share is not None and share[0] * pipelines != share[1]:
            weight = share[0] * pipelines / share[1]
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.mul_(weight)
        if pipelines == 1 and self.pipeline_enable_backward_allreduce:
            # One pipeline: DeepSpeed's all-reduce over a group of one process would copy every gradient into a
            # flat bucket and a transfer buffer that stays (4 + 4 bytes per parameter) to add nothing and divide by 1.
            # What it does besides is kept: a parameter without a gradient gets zeros, as with several pipelines.
            self._get_gradients_for_reduction()
            return
        PipelineEngine._exec_reduce_grads(self)

    def _broadcast_model(self) -> None:
        """DeepSpeed's broadcast of the weights over the data-parallel group; not over a group of one process (it
        would leave a transfer buffer of each parameter's size behind and send nothing)."""
        import deepspeed.comm as ds_dist

        if ds_dist.get_world_size(group=self.seq_data_parallel_group) > 1:
            super()._broadcast_model()

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads_bamboo,
        ds_schedule.ReduceGrads: _exec_reduce_grads_weighted,
        ds_schedule.RecvGrad: _exec_recv_grads_settling,
        ds_schedule.RecvActivation: _exec_recv_activations_settling,
        ds_schedule.OptimizerStep: _exec_deferred_optimizer_step,
        ds_schedule.ForwardPass: _exec_forward_keeping_output,
        ds_schedule.BackwardPass: _exec_backward_timed,
        RedundantForward: _exec_redundant_forward,
        ReplicaUpdate: _exec_replica_update,
        SendReplicaSync: _exec_send_replica_sync,
        RecvReplicaSync: _exec_recv_replica_sync,
    }

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        steps = _FailureInjector(pipe_schedule, self.node_id, self.batches_run - 1)
        self._gradients_received = 0  # (``_write_ahead_at_last_gradient``)
        try:
            super()._exec_schedule(steps)
        except Exception as err:
            if isinstance(pipe_schedule, ds_schedule.TrainSchedule):
                # a lost peer is expected on spot machines (the failover says so): the table is for a real fault
                level = logging.DEBUG if isinstance(err, PeerLost) or is_comm_error(err) else logging.ERROR
                log.log(level, "rank %d (stage %d) failed at schedule step %d:\n%s", self.global_rank, self.stage_id,
                        steps.index, self.schedule_table(error_at=steps.index))
            raise

    def schedule_table(self, error_at: int | None = None) -> str:
        """This engine's training step as a Step x Rank table (lightning_bamboo.schedule)."""
        from lightning_bamboo.schedule import build_schedule, format_table

        mode = self.redundancy
        costs = self.rf_costs if mode == "eager" else None
        kept = self._kept() if mode != "off" else None
        return format_table(build_schedule(self.num_stages, self.micro_batches, mode, costs=costs, kept=kept),
                            error_at=error_at)


_FP32 = Precision()


class _FailureInjector:
    """Iterates a DeepSpeed schedule, reporting each of its steps to ``faults.reached`` (a kill mid-step)."""

    def __init__(self, schedule: Any, node: str, step: int) -> None:
        self.schedule, self.node, self.step = schedule, node, step
        self.index = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.schedule, name)  # num_pipe_buffers() and the rest of the schedule's API

    def __iter__(self) -> Iterator[Any]:
        check = faults.armed(self.node)
        for index, commands in enumerate(self.schedule):
            self.index = index
            if index and check:
                faults.reached(self.node, self.step, index)
            yield commands
