"""``PipelineRunner``: one node's stage, engine, replica and membership, and the operations on them."""

from __future__ import annotations

import faulthandler
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.engine import audit
from lightning_bamboo.engine.build import (
    build_engine,
    build_pipeline_module,
    deepspeed_config,
    ensure_deepspeed_comm,
)
from lightning_bamboo.engine.failover import FatalLoss, layout_tag, plan_loss
from lightning_bamboo.engine.module import BuiltLayers, Splice, build_layers
from lightning_bamboo.engine.pipe import BambooPipelineEngine, PeerLost, Wiring, _maybe_fail
from lightning_bamboo.engine.replica import Replica, StageContainer, copy_hyperparameters, exchange_objects
from lightning_bamboo.errors import BambooConfigError, BambooError
from lightning_bamboo.membership.registry import BarrierTimeoutError
from lightning_bamboo.runtime.config import BambooConfig
from lightning_bamboo.runtime.host import PipelineModel, RunnerHost
from lightning_bamboo.runtime.session import LEAVE, Session, joining, launched_by_bamboo
from lightning_bamboo.strategy.layout import (
    Layout,
    check_replica_memory,
    compute_parts,
    micro_batches,
    partition_weights,
    pipeline_share,
    resolve_stages,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
States = dict[int, dict[str, Any]]
#: what a failover captures before it rebuilds: the layout it left, the layer states, the optimizer
_Captured = dict[str, Any]


class PipelineRunner:
    """Runs one node of a Bamboo pipeline: a stage of the model on a DeepSpeed engine, a replica of the
    successor's stage, and (under the Bamboo launcher) the node's membership session.

    The operations: :meth:`start` (build the stage), :meth:`train_step` (a step that survives a loss:
    fail over and redo it), :meth:`fail_over`, :meth:`reconfigure`, :meth:`gather` and :meth:`resilient`
    (collectives that survive a loss), :meth:`save` / :meth:`load` (checkpoints) and :meth:`audit`.
    The framework around it is reached only through a :class:`~lightning_bamboo.runtime.host.RunnerHost`.
    """

    def __init__(self, config: BambooConfig, host: RunnerHost, device: torch.device | str = "cpu",
                 backend: str = "gloo") -> None:
        self.config = config
        self.host = host
        self.device = torch.device(device)
        self.backend = backend
        self.model: PipelineModel | None = None
        self.session: Session | None = None
        self.engine: BambooPipelineEngine | None = None
        self.layout: Layout | None = None
        self.rank = 0
        self.gradient_clipping = 0.0
        self.param_counts: list[int] = []  # trainable parameters per layer, measured by start()
        self.layer_names: list[str] = []  # each layer's class name, measured by start()
        self.audits = 0  # replica audits passed by this process
        #: called at the start of every step under membership, after leavers were served (``before_step``)
        self._before_step: list[Callable[[PipelineRunner, int], None]] = []
        self._inside_resilient = False
        #: a node joining a running job, between its admission and its first step: the running nodes are past
        #: the barriers and broadcasts of the framework's start-up (they are training), so it meets them alone
        self.catching_up = False
        #: micro-batches per step over all pipelines when the data is loaded by global steps (the number of
        #: pipelines may change then); None: each pipeline loads its own batches (set by the host)
        self.global_micro_batches: int | None = None
        self._resume: tuple[Any, dict[str, Any]] | None = None  # (path, meta) of the checkpoint being loaded
        self._saved_reads: dict[tuple[int, int], States] = {}  # layer files read for that resume

    # ------------------------------------------------------------------ membership
    @property
    def node(self) -> str:
        return self.session.node if self.session is not None else f"rank {self.rank}"

    def open_session(self, leave_requested: Callable[[], bool] = LEAVE.is_set) -> Session | None:
        """Under the Bamboo launcher: register this node and pass the job's start rendezvous (else None)."""
        if self.session is None and launched_by_bamboo():
            self.session = Session(self.config.detection_timeout, self.config.timeout, leave_requested)
        return self.session

    def wait_admission(self, leave_requested: Callable[[], bool] = LEAVE.is_set) -> dict[str, Any] | None:
        """A node joining a running job: standby until a reconfiguration admits it (its record), or the job
        finishes (None)."""
        session = self.open_session(leave_requested)
        assert session is not None and joining(), "wait_admission() is for a node the launcher starts to join"
        record = session.wait_admission()
        if record is None:
            log.warning("%s: the job finished before this standby node was needed", session.node)
            session.stop()
        return record

    def enter(self, record: dict[str, Any]) -> tuple[int, int]:
        """Join the job's process group as its admission ``record`` says; returns (rank, world size)."""
        self.rank, world = self._session().enter(record)
        self.config.stages = world // int(record.get("pipelines", 1))
        self.catching_up = True  # until its first step (see ``catching_up``)
        log.warning("%s: admitted as rank %d of %d at step %d", self.node, self.rank, world, record["step"])
        return self.rank, world

    def start_without_lost(self) -> tuple[int, int]:
        """Nodes died before the job's process group formed: start one pipeline of the nodes that are up.

        No step has run, so this is a smaller launch, not a failover: the job's process group is
        formed of the survivors, and the stage count follows them (the checkpoint it resumes from,
        if any, loads into any layout). A data-parallel job, or too few nodes left, stops with
        ``FatalLoss``: the launcher starts it again with the nodes that are up. Returns (rank, world).
        """
        session = self._session()
        stages = self.config.stages
        if stages is not None and stages != len(session.nodes):
            raise FatalLoss(f"{sorted(session.start_lost)} died while the job started; a job of {len(session.nodes)} "
                            f"nodes in {stages}-stage pipelines starts again with the nodes that are up")
        assigned = session.start_without(min_nodes=2 if self.config.redundant else 1)
        self.config.stages = assigned[1]
        return assigned

    def before_step(self, hook: Callable[[PipelineRunner, int], None]) -> Callable[[], None]:
        """Call ``hook(runner, step)`` at the start of every step under membership, once every node of the
        pipeline is there in the same generation (leavers served): the place to reconfigure. Returns a
        function that removes the hook."""
        self._before_step.append(hook)
        return lambda: self._before_step.remove(hook) if hook in self._before_step else None

    @property
    def before_step_hooks(self) -> tuple[Callable[[PipelineRunner, int], None], ...]:
        return tuple(self._before_step)

    @property
    def nodes(self) -> list[str]:
        """The job's nodes in rank order (under membership; else one name per rank of the layout)."""
        if self.session is not None:
            return list(self.session.nodes)
        return [f"rank{r}" for r in range(self.layout.world_size if self.layout is not None else 1)]

    @property
    def standby(self) -> list[str]:
        """Standby nodes seen at the last commit (the same list on every node; see :meth:`admit_standby`)."""
        return [n for n in self.session.joiners if n not in self.session.nodes] if self.session is not None else []

    def admit_standby(self) -> None:
        """Report standby nodes at every commit (``standby``), so that a reconfiguration can admit them."""
        if self.session is not None:
            self.session.admitting = True

    @property
    def failovers(self) -> list[dict[str, Any]]:
        """This node's failover records, oldest first."""
        return self.session.failovers if self.session is not None else []

    def agree(self, topic: str, step: int, proposal: dict[str, Any]) -> dict[str, Any]:
        """One value for ``topic`` at ``step`` on every node: the first proposal put in the store wins."""
        session = self._session()
        _, kv = session.store.put_if_absent(f"{session.base}{topic}/{session.generation}/{step}", json.dumps(proposal))
        return dict(json.loads(kv.value))

    @property
    def between_steps(self) -> bool:
        """Whether collectives go through the membership store (under the launcher, once the engine exists).

        A gloo collective cut by a loss can leave some survivors past it and others still in it;
        after the failover they would retry different collectives and wait on each other until
        the process group's timeout. ``Session.gather`` fails the same collective on every survivor.
        """
        return self.session is not None and self.session.active and self.engine is not None

    # ------------------------------------------------------------------ building the stage
    def probe(self, model: PipelineModel) -> BuiltLayers:
        """The model's layers as the seed builds them, none kept: their parameter counts and names."""
        self.model = model
        probe = self._build(keep=lambda i: False)
        self.param_counts, self.layer_names = probe.param_counts, probe.names
        return probe

    def start(self, model: PipelineModel, world: int, rank: int, fitting: bool, gradient_clipping: float = 0.0) -> None:
        """Build this process's stage of a fresh layout (``world`` processes), its engine and its replica."""
        stages, pipelines = resolve_stages(world, self.config.stages)
        probe = self.probe(model)
        parts = compute_parts(self.config.partition, stages, probe.param_counts, probe.names)
        self.layout, self.rank, self.gradient_clipping = Layout(stages, pipelines, parts), rank, gradient_clipping
        ensure_deepspeed_comm(self.backend)
        module = self._stage_module(self.layout, self.layout.stage_of_rank(rank))
        optimizer = self.host.setup_optimizers(module) if fitting else None
        self.engine = self._new_engine(module, optimizer, self.layout)
        if fitting:
            self._arm(self.engine)

    def _session(self) -> Session:
        if self.session is None:
            raise BambooConfigError("this operation needs a job started by the Bamboo launcher (lightning-bamboo run)")
        return self.session

    def _ready(self) -> tuple[BambooPipelineEngine, Layout]:
        if self.engine is None or self.layout is None:
            raise BambooConfigError("the runner has no stage yet: start() it first")
        return self.engine, self.layout

    def _build(self, keep: Callable[[int], bool]) -> BuiltLayers:
        assert self.model is not None, "probe() or start() names the model first"
        return build_layers(self.model.configure_pipeline, self.seed, keep)

    @property
    def seed(self) -> int:
        """The seed the layers are built under: the configured one, else the framework's global seed."""
        import os

        return int(self.config.seed) if self.config.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _stage_module(self, layout: Layout, stage: int, states: States | None = None,
                      prebuilt: dict[int, torch.nn.Module] | None = None) -> Any:
        """This process's ``PipelineModule`` for ``stage`` of ``layout`` (weights from ``states`` if given).

        ``prebuilt`` layers are used as they are (the replica's own layer objects, whose kept
        graphs a failover reuses): their weights are not loaded again. The host adopts it.
        """
        assert self.model is not None
        prebuilt = prebuilt or {}
        mine = layout.layers_of_stage(stage)
        built = self._build(keep=lambda i: i in mine and i not in prebuilt)
        layers = [prebuilt.get(i, layer) for i, layer in enumerate(built.layers)]
        timeout = timedelta(seconds=self.config.timeout)
        module = build_pipeline_module(layers, layout, self.model.pipeline_loss, timeout)
        module.to(self.device)
        if states is not None:
            ckpt.load_weights(module, {i: s for i, s in states.items() if i not in prebuilt}, strict=not prebuilt)
        self.host.adopt_stage(module)
        return module

    def _new_engine(self, module: Any, optimizer: Any, layout: Layout) -> BambooPipelineEngine:
        config = deepspeed_config(self.config.micro_batch_size, 1, layout.pipelines, self.gradient_clipping,
                                  self.config.deepspeed)
        return build_engine(
            module, optimizer, config, timedelta(seconds=self.config.timeout),
            bamboo_options={"redundancy": self.config.redundancy, "layout": layout, "rf_costs": self.config.rf_costs},
        )

    def _rank_of(self, layout: Layout, stage: int, pipeline: int) -> int:
        return stage * layout.pipelines + pipeline

    def _replica_peers(self, layout: Layout, rank: int) -> tuple[int, int]:
        stage, pipeline = layout.stage_of_rank(rank), layout.pipeline_of_rank(rank)
        return (self._rank_of(layout, (stage - 1) % layout.stages, pipeline),
                self._rank_of(layout, (stage + 1) % layout.stages, pipeline))

    def _arm(self, engine: BambooPipelineEngine, replica_states: States | None = None) -> None:
        """Wire the engine: its replica (of the successor's stage, from ``replica_states`` or the seed),
        its exchange peers, and under membership its node name, commit hook and watchdog."""
        layout = self.layout
        assert layout is not None
        wiring = Wiring()
        if self.config.redundant and layout.stages > 1:
            successor = (layout.stage_of_rank(self.rank) + 1) % layout.stages
            if replica_states is None:
                self._check_host_memory(layout.layers_of_stage(successor))
            wiring.replica = self._new_replica(engine, layout.layers_of_stage(successor), successor, replica_states)
            wiring.replica_peers = self._replica_peers(layout, self.rank)
        if self.session is not None:
            session = self.session
            wiring.node = session.node
            wiring.commit = lambda _step: session.commit(self.host.global_step())
            wiring.guard = session.guard()
        engine.wire(wiring)

    def _check_host_memory(self, layers: range) -> None:
        import psutil

        check_replica_memory(layers, sum(self.param_counts[i] for i in layers), psutil.virtual_memory().available)

    def _new_replica(self, engine: BambooPipelineEngine, layers: range, stage: int, states: States | None) -> Replica:
        """A replica of ``stage`` (built under the seed, or from ``states``) with its own optimizer."""
        built = self._build(keep=lambda i: i in layers)
        container = StageContainer({i: layer for i, layer in enumerate(built.layers) if layer is not None}).to(self.device)
        if states is not None:
            ckpt.load_weights(container, states)
        optimizer = self.host.optimizer_for(container)
        if states is not None:
            ckpt.load_optimizer(container, optimizer, states, ckpt.param_group_hyperparameters(engine.optimizer))
        return Replica(stage, container, optimizer)

    def layer_costs(self) -> tuple[float, ...] | None:
        """Relative cost per layer as ``partition`` weighs them, for splits made later (``RebalanceCallback``).

        ``"parameters"``: the layers' parameter counts; ``"type:REGEX"``: 1 per matching layer; ``"uniform"``
        or explicit boundaries: None (every layer the same).
        """
        if not self.param_counts:
            return None
        weights = partition_weights(self.config.partition, self.param_counts, self.layer_names)
        # the policy needs a positive cost per layer: a layer the partition does not weigh costs little
        if weights is None or max(weights) <= 0:
            return None
        return tuple(float(w) if w > 0 else 1e-3 * max(weights) for w in weights)

    # ------------------------------------------------------------------ steps
    @property
    def pipelines(self) -> int:
        return self.layout.pipelines if self.layout is not None else 1

    @property
    def pipeline_rank(self) -> int:
        return self.layout.pipeline_of_rank(self.rank) if self.layout is not None else 0

    @property
    def micro_batches(self) -> int:
        """Micro-batches this pipeline ran in its last step."""
        return int(self.engine.micro_batches) if self.engine is not None else 1

    def split(self, batch: Any, global_batch: bool = False) -> tuple[list[tuple[Any, Any]], tuple[int, int] | None]:
        """This pipeline's micro-batches of ``batch``, and of a global batch its share (``(count, total)``
        micro-batches, see ``pipeline_share``; None for a batch of this pipeline's own)."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            kind = f"a {type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            raise BambooConfigError(
                f"strategy='bamboo' needs batches of the form (inputs, targets), got {kind}; make the "
                f"Dataset return (inputs, targets) pairs or add a collate_fn that does"
            )
        inputs, targets = batch
        b = self.config.micro_batch_size
        share: tuple[int, int] | None = None
        if global_batch:
            first, m, total = pipeline_share(len(inputs), b, self.pipelines, self.pipeline_rank)
            share = (m, total)
        else:
            first, m = 0, micro_batches(len(inputs), b, self.pipelines)
        return [(inputs[i * b : (i + 1) * b], targets[i * b : (i + 1) * b]) for i in range(first, first + m)], share

    def train_step(self, batch: Any) -> torch.Tensor:
        """Train the step ``host.global_step()`` on ``batch``; if a peer is lost, fail over and redo it (unless
        it had committed). The batch is cut into this pipeline's micro-batches at every attempt: a failover
        or a reconfiguration may have changed the number of pipelines (the global batch stays)."""
        step = self.host.global_step()
        session = self.session
        joined_now, self.catching_up = self.catching_up, False
        if session is not None and session.leavers:
            # A peer announced at the last commit that it leaves: switch now, between steps, losing nothing.
            self.fail_over(PeerLost(f"{sorted(session.leavers)} left after a notice", session.leavers), step,
                           in_flight=False)
            session.leavers = set()
        if session is not None and not joined_now:  # (a new node: decided already)
            for hook in list(self._before_step):
                hook(self, step)
        for _ in range(len(session.nodes) if session is not None else 1):
            engine, _layout = self._ready()
            chunks, share = self.split(batch, global_batch=self.global_micro_batches is not None)
            engine.set_micro_batches(len(chunks))
            if session is not None:
                # A step that takes a commit timeout is stuck somewhere: every thread's stack goes to the
                # node's log then, so that the node the others wait for shows where it waits.
                faulthandler.dump_traceback_later(session.rendezvous_timeout * 0.75, repeat=False)
            try:
                loss = engine.train_batch(data_iter=iter(chunks), step=step, share=share)
                if session is not None and session.leaving:
                    session.depart()
                return loss
            except PeerLost as err:
                if session is None:
                    raise
                if self.fail_over(err, step):
                    return self._ready()[0].last_loss  # type: ignore[return-value]  # set by the failover
            finally:
                if session is not None:
                    faulthandler.cancel_dump_traceback_later()
        raise BambooConfigError(f"step {step} failed over {len(self._session().nodes)} times; giving up")

    def eval_step(self, batch: Any) -> torch.Tensor:
        """The loss of ``batch`` (this pipeline's share), with no update."""
        engine, _ = self._ready()
        chunks, _ = self.split(batch)
        engine.set_micro_batches(len(chunks))
        return engine.eval_batch(data_iter=iter(chunks), num_micro_batches=len(chunks))

    # ------------------------------------------------------------------ failover
    def fail_over(self, err: Exception, step: int, in_flight: bool = True) -> bool:
        """Rebuild the pipeline from the survivors' own stages and replicas; True if the step had committed.

        Every attempt starts from the same captured state (the layers this node held before the
        loss) with the union of the losses seen so far, so a node lost *during* a failover only
        makes the survivors agree on a larger set and try again; no wait is unbounded.
        """
        session = self._session()
        started = time.monotonic()
        if not self.config.redundant:
            raise FatalLoss(f"lost {list(getattr(err, 'lost', ()))} with redundancy='off': no replica to take over")
        old, layout = self._ready()
        log.info("%s: failover starts", session.node)
        committed = session.committed(step)
        if committed and old.phase != "idle":
            old.apply_step()  # every node had its gradients in: the step counts
        elif not committed:
            old.discard_step()
        base: _Captured = {
            "nodes": list(session.nodes),
            "pipelines": layout.pipelines,
            "parts": tuple(layout.parts),
            "states": {**old.own_states(), **(old.replica.states() if old.replica else {})},
            "optimizer": old.optimizer,
            "last_loss": old.last_loss,
            # eager: the successor's forwards of the failed step, reused when this node takes its stage over
            "reuse": None if committed or old.redundant is None or not old.redundant.kept or old.replica is None
            else (old.replica.module, dict(old.redundant.kept)),
        }
        log.info("%s: state captured (%.2f s)", session.node, time.monotonic() - started)
        suspected = set(getattr(err, "lost", ()))
        # A failover should take well under a detection timeout; if one does not, every thread's stack
        # goes to stderr (the node's log) so the wait can be named.
        faulthandler.dump_traceback_later(max(4 * self.config.detection_timeout, 10.0), repeat=True)
        try:
            for _attempt in range(len(base["nodes"])):
                try:
                    plan, rank, world = self._fail_over_once(base, suspected, step)
                    break
                except (PeerLost, BarrierTimeoutError) as again:
                    suspected |= set(getattr(again, "lost", ())) | session.detector.lost
                    log.warning("%s: another loss during the failover (%s); trying again with %s", session.node,
                                again, sorted(suspected))
            else:
                raise BambooError(f"failover at step {step} did not converge after {len(base['nodes'])} attempts")
        finally:
            faulthandler.cancel_dump_traceback_later()
        session.leavers &= set(session.nodes)  # a leaver this failover already served needs no second one
        seconds = time.monotonic() - started
        # a released node may have left before another survivor decided: the lost set then names it too
        released = set(plan.released) | session.released() if base["pipelines"] > 1 else set()
        session.record_failover({
            "step": step, "lost": sorted(set(base["nodes"]) - set(plan.order) - released), "committed": committed,
            "seconds": seconds, "redone": in_flight and not committed, "order": list(plan.order),
            "parts": list(plan.parts), "pipelines": plan.pipelines, "released": sorted(released),
            "rows": [list(r) for r in plan.rows], "old_parts": list(base["parts"]), "old_pipelines": base["pipelines"],
        })
        log.warning("%s: failover done in %.2f s (rank %d of %d)", session.node, seconds, rank, world)
        if committed:
            self._ready()[0].last_loss = base["last_loss"]
        return committed

    def _fail_over_once(self, base: _Captured, suspected: set[str], step: int) -> tuple[Any, int, int]:
        session = self._session()
        lost = session.decide_lost(tuple(suspected), base["nodes"])
        plan = plan_loss(base["nodes"], base["pipelines"], base["parts"], lost, replicas=self.config.redundant)
        log.warning("%s: lost %s at step %d; new layout %s (%d pipeline(s)) parts %s%s", session.node, sorted(lost),
                    step, plan.order, plan.pipelines, plan.parts,
                    f"; released {list(plan.released)}" if plan.released else "")
        if session.node in plan.released:
            self._release(step)
        # The group's tag names its members: survivors that saw a released node's lease end (it left)
        # and those that did not agree on the same layout, so they must meet in the same group.
        rank, world = session.reform(list(plan.order), tag=layout_tag(plan.order))
        log.info("%s: process group re-formed", session.node)
        _maybe_fail(session.node, "failover", None)  # fault injection (BAMBOO_FAIL_AT=node@failover)
        self.enter_group(rank, world)
        # This node's layers in the new layout, each from its own copy or its replica (no disk, no transfer).
        layout = Layout(world // plan.pipelines, plan.pipelines, plan.parts)
        self.rebuild(layout, rank, base["states"], base["optimizer"], reuse=base["reuse"])
        return plan, rank, world

    def _release(self, step: int) -> None:
        """Leave the layout (this node's pipeline was dropped) and come back as a standby node, in a fresh process."""
        from lightning_bamboo.launcher import rejoin_as_standby

        session = self._session()
        log.warning("%s: released at step %d (its pipeline lost a node; the whole pipelines train on); joining again "
                    "as a standby node", session.node, step)
        try:
            session.release()
            session.registry.leave(timeout=2.0)  # its id is free at once for the standby incarnation
        finally:
            session.stop()
        rejoin_as_standby()

    def enter_group(self, rank: int, world: int) -> None:
        """This process is ``rank`` of ``world`` in the process group just formed (the host and DeepSpeed too)."""
        import deepspeed.comm.comm as ds_comm_module

        self.rank = rank
        self.host.enter_group(rank, world)
        ds_comm_module.cdb = None
        ensure_deepspeed_comm(self.backend)

    def rebuild(self, layout: Layout, rank: int, held: States, hyper: torch.optim.Optimizer | list[dict[str, Any]],
                fresh_optimizer: bool = False, reuse: tuple[StageContainer, dict[int, Any]] | None = None) -> None:
        """Build this node's stage of ``layout`` from ``held`` layer states, its engine, and the replica ring.

        ``hyper`` gives the optimizer's current hyperparameters (the old optimizer, or saved param
        groups). With ``fresh_optimizer`` (a node joining), the optimizer and schedulers come from the
        host's ``setup_optimizers``; otherwise the old optimizer is swapped for the new one.
        ``reuse`` (eager failover): the old replica's container and its kept redundant forwards; when
        the new stage ends with the replica's layers, it takes those layer objects over and the next
        step reuses the kept forwards (``engine.module.Splice``).
        """
        session = self._session()
        stage = layout.stage_of_rank(rank)
        mine = layout.layers_of_stage(stage)
        missing = [i for i in mine if i not in held]
        if missing:
            raise BambooError(f"the new layout gives {session.node} layers {missing} it does not hold")
        stage_states = {i: held[i] for i in mine}
        self.config.stages, self.layout, self.rank = layout.stages, layout, rank
        prebuilt: dict[int, torch.nn.Module] = {}
        splice = None
        if reuse is not None:
            container, kept = reuse
            first, stop = container.indices[0], container.indices[-1] + 1
            if mine.stop == stop and mine.start <= first:  # the new stage ends with the replica's layers
                prebuilt = {int(n): layer for n, layer in container.named_children()}
                splice = Splice(first, kept)
        # DeepSpeed's PipelineModule forms its process groups (gloo connects to every peer): a peer lost
        # meanwhile would hold that connect for the whole group timeout, so it is bounded like a step.
        module = session.guard().run(lambda: self._stage_module(layout, stage, stage_states, prebuilt))
        module.splice = splice
        optimizer = self.host.setup_optimizers(module) if fresh_optimizer else self.host.optimizer_for(module)
        groups = hyper if isinstance(hyper, list) else ckpt.param_group_hyperparameters(hyper)
        ckpt.load_optimizer(module, optimizer, stage_states, groups)
        if isinstance(hyper, torch.optim.Optimizer):
            copy_hyperparameters(hyper, optimizer)

        def build_and_arm() -> BambooPipelineEngine:
            # Collectives with the new peers: bounded by the new membership watch like a step.
            engine = self._new_engine(module, optimizer, layout)
            received = None
            if self.config.redundant and layout.stages > 1:
                # every node sends its stage to its predecessor in its pipeline, which keeps it as the replica
                before, after = self._replica_peers(layout, rank)
                received = exchange_objects(engine.own_states(), send_to=before, recv_from=after)
            self._arm(engine, received)
            return engine

        self.engine = session.guard().run(build_and_arm)
        if isinstance(hyper, torch.optim.Optimizer):
            self.host.rebind_optimizer(hyper, optimizer)
        self.audit("membership change before")

    def reconfigure(self, order: list[str], parts: tuple[int, ...], reason: str = "", pipelines: int = 1) -> float:
        """Change the layout between two steps, with no loss (see ``runtime.moves.reconfigure``); the seconds it took."""
        from lightning_bamboo.runtime.moves import reconfigure

        return reconfigure(self, order, parts, reason, pipelines, elastic=self.global_micro_batches is not None)

    # ------------------------------------------------------------------ audit
    def audit(self, when: str) -> None:
        """With ``audit_replicas``: every replica against its owner's live stage, on every node (``engine.audit``).

        Every node gathers every node's digests and finds the same differences, so all stop together.
        Under the Bamboo launcher the digests go through the membership store, so a node lost meanwhile
        fails the audit like any collective: callers between steps run it through :meth:`resilient`
        (fail over, audit again); inside a failover, the failover is retried with the larger lost set.
        """
        if not self.config.audit_replicas or self.engine is None or self.layout is None:
            return
        engine, layout, rank = self.engine, self.layout, self.rank
        replica = engine.replica
        report = asdict(audit.NodeDigest(
            node=self.node, stage=layout.stage_of_rank(rank), pipeline=layout.pipeline_of_rank(rank),
            own=audit.digest(engine.own_states()),
            replica_stage=replica.stage if replica is not None else None,
            replica=audit.digest(replica.states()) if replica is not None else {},
        ))
        if self.between_steps:
            reports = self.gather(report)
        elif torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
            reports = [None] * torch_dist.get_world_size()
            torch_dist.all_gather_object(reports, report)
        else:
            reports = [report]
        audit.check([audit.NodeDigest(**r) for r in reports], self.host.global_step(), when)
        self.audits += 1

    # ------------------------------------------------------------------ collectives that survive a loss
    def resilient(self, fn: Callable[[], T]) -> T:
        """Run a collective; if a node is lost meanwhile, fail over (between steps) and run it again.

        Collectives outside the training step (checkpoint saves, metric syncs, the framework's own
        barriers) meet a lost node as much as the step does. Nested calls run plainly: the
        outermost call retries the whole operation in the new layout.
        """
        session = self.session
        if session is None or self.engine is None or self._inside_resilient:
            return fn()
        step = self.host.global_step()
        for _ in range(len(session.nodes)):
            self._inside_resilient = True
            try:
                return session.guard().run(fn)
            except PeerLost as err:
                self._inside_resilient = False
                self.fail_over(err, step, in_flight=False)
            finally:
                self._inside_resilient = False
        raise BambooError(f"a collective failed over {len(session.nodes)} times at step {step}; giving up")

    def gather(self, obj: Any, send: bool = True) -> list[Any]:
        """Every node's ``obj`` (None for a node that does not ``send``), in rank order, through the store."""
        from lightning_bamboo.runtime.collectives import decode, encode

        return [None if not part else decode(part) for part in self._session().gather(encode(obj) if send else "")]

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_shard(self, meta: Callable[[], dict[str, Any]] | None, with_optimizer: bool,
                         reuse: ckpt.Shard | None = None) -> ckpt.Shard:
        """This process's part of a checkpoint, copied to host memory (no collective; see ``AsyncCheckpoint``)."""
        engine, _ = self._ready()
        return ckpt.take_shard(self.rank, engine.module, engine.optimizer if with_optimizer else None,
                               engine.layer_range, writes_layers=self.pipeline_rank == 0, meta=meta, reuse=reuse)

    def save(self, path: Any, meta: Callable[[], dict[str, Any]], with_optimizer: bool, is_global_zero: bool,
             barrier: Callable[[str], None], step: int | None = None) -> None:
        """Every process writes its layers (one pipeline per stage), rank 0 the manifest; then swap in."""
        engine, _ = self._ready()

        def barrier_between(name: str) -> None:
            if self.session is not None and name == "bamboo_checkpoint_layers":
                # tests: a node that dies in the middle of a save (BAMBOO_FAIL_AT=node@save<step>)
                _maybe_fail(self.session.node, f"save{step}", None)
            barrier(name)

        ckpt.save_sharded(path, engine.module, engine.optimizer if with_optimizer else None, engine.layer_range, meta,
                          is_global_zero=is_global_zero, writes_layers=self.pipeline_rank == 0,
                          barrier=barrier_between, rank=self.rank)

    def resume_from(self, path: Any, meta: dict[str, Any]) -> None:
        """The checkpoint the next :meth:`load_weights` and :meth:`load_optimizer` read (any saved layout)."""
        self._resume, self._saved_reads = (path, meta), {}

    def resumed(self) -> None:
        """The resume is done: the layer files read for it are not needed any more."""
        self._saved_reads = {}

    def _saved_states(self, layers: range) -> States:
        assert self._resume is not None and self.layout is not None
        path, meta = self._resume
        saved_layers = meta["bamboo"]["num_layers"]
        if saved_layers != self.layout.num_layers:
            raise ckpt.CheckpointError(f"checkpoint {path} holds {saved_layers} layers but configure_pipeline() "
                                       f"builds {self.layout.num_layers}")
        # weights and optimizer state are loaded by two calls: each layer file is read once per resume
        key = (layers.start, layers.stop)
        if key not in self._saved_reads:
            self._saved_reads[key] = ckpt.read_layers(path, layers)
        return self._saved_reads[key]

    def load_weights(self, strict: bool = True) -> None:
        """The stage's weights from the checkpoint, and the replica's too: a replica is the successor's state
        as saved, never the seed's (a failover after a resume trains on it)."""
        engine, _ = self._ready()
        ckpt.load_weights(engine.module, self._saved_states(engine.layer_range), strict=strict)
        if engine.replica is not None:
            ckpt.load_weights(engine.replica.module, self._saved_states(engine.replica.layers), strict=strict)

    def load_optimizer(self) -> None:
        """The stage's optimizer state (moments, step counts, hyperparameters) from the checkpoint, and the replica's."""
        engine, _ = self._ready()
        assert self._resume is not None
        groups = self._resume[1]["bamboo"]["param_groups"]
        ckpt.load_optimizer(engine.module, engine.optimizer, self._saved_states(engine.layer_range), groups)
        if engine.replica is not None:
            replica = engine.replica
            ckpt.load_optimizer(replica.module, replica.optimizer, self._saved_states(replica.layers), groups)

    # ------------------------------------------------------------------ the end
    def finish(self, completed: bool) -> None:
        """Stop the membership session (``completed``: standby nodes never admitted stop waiting too)."""
        if self.session is not None:
            if completed:
                self.session.finish()
            self.session.stop()

    def close(self) -> Iterable[Any]:
        """Drop the engine and the session; returns what must outlive the process group (a store it hosts)."""
        keep = []
        if self.session is not None:
            self.session.stop()
            keep.append(getattr(self.session, "_tcp_store", None))
            self.session = None
        self.engine = None
        return keep
