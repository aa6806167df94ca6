"""``PipelineRunner``: the door a training loop drives: steps that survive a loss, failover, reconfiguration and
collectives of one node. It composes the node's ``NodeStage`` (what it runs), its ``StageCheckpoints`` and its
membership ``Session``."""

from __future__ import annotations

import faulthandler
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from lightning_bamboo.engine.comm_process import BACKEND, CommAborted
from lightning_bamboo.errors import BambooConfigError, BambooError, FatalLoss, PeerLost, batch_form_error
from lightning_bamboo.membership.collectives import BarrierTimeoutError
from lightning_bamboo.membership.node import leave_idle_priority
from lightning_bamboo.membership.records import Failover, Reconfiguration, Restart
from lightning_bamboo.runtime.checkpoints import StageCheckpoints
from lightning_bamboo.runtime.config import BambooConfig
from lightning_bamboo.runtime.failover import fail_over
from lightning_bamboo.runtime.host import PipelineModel, RunnerHost
from lightning_bamboo.runtime.moves import reconfigure, start_admitted
from lightning_bamboo.runtime.refusal import stop_if_refused
from lightning_bamboo.runtime.restart import (
    PendingRestart,
    known_checkpoint,
    reform_after_fatal_loss,
    restarted,
)
from lightning_bamboo.runtime.session import Session, launched_by_bamboo, start_session
from lightning_bamboo.runtime.stage import NodeStage
from lightning_bamboo.topology.layout import Layout, micro_batches, pipeline_share

log = logging.getLogger(__name__)

T = TypeVar("T")

#: restarts after fatal losses with no step trained in between, after which a fatal loss ends the job: one that
#: fails by itself at every restart (a bug, a node that cannot start) would otherwise restart for ever
MAX_RESTARTS_IN_A_ROW = 4


class PipelineRunner:
    """Runs one node of a Bamboo pipeline: it composes the node's :class:`~lightning_bamboo.runtime.stage.NodeStage`
    (``stage``: a stage of the model on a DeepSpeed engine and a replica of the successor's stage, built and rebuilt),
    its checkpoints (``checkpoints``) and, under the Bamboo launcher, its membership session (``session``).

    The verbs a training loop drives: :meth:`start` (build the stage), :meth:`train_step` (a step that survives a
    loss: fail over and redo it), :meth:`eval_step`, :meth:`resilient` and :meth:`gather` (collectives that survive
    a loss), :meth:`reconfigure`, :meth:`agree` and :meth:`publish`; for membership :meth:`open_session`,
    :meth:`wait_admission`, :meth:`join`, :meth:`start_admitted`, :meth:`start_without_lost`, :meth:`before_step`,
    :meth:`admit_standby`; and the end, :meth:`finish` and :meth:`close`. The framework around it is reached only
    through a :class:`~lightning_bamboo.runtime.host.RunnerHost`; it can be driven without one of Lightning's.
    """

    def __init__(self, config: BambooConfig, host: RunnerHost, device: torch.device | str = "cpu",
                 backend: str = BACKEND) -> None:
        #: what this process runs: its stage, the engine around it, its replica (the runner's own: the views and
        #: verbs below are what the front doors see of it)
        self._stage = NodeStage(config, host, device, backend)
        #: the stage's part of the job's checkpoints: saves, an asynchronous save's shard, the resume
        self.checkpoints = StageCheckpoints(self._stage)
        self.host = host
        #: a node joining a running job, between its admission and its first step: the running nodes are past
        #: the barriers and broadcasts of the framework's start-up (they are training), so it meets them alone
        self.catching_up = False
        #: called at the start of every step under membership, after leavers were served (``before_step``)
        self._before_step: list[Callable[[PipelineRunner, int], None]] = []
        self._inside_resilient = False
        self._restart: PendingRestart | None = None  # a restart after a fatal loss, until its checkpoint is loaded
        self._trained = False  # a step of this job committed here (before: a loss may be a worker's refusal)
        self._restarts_in_a_row = 0  # restarts after fatal losses with no step trained in between

    # ------------------------------------------------------------------ the stage, as the front doors see it
    @property
    def engine(self) -> Any:
        """The DeepSpeed pipeline engine running this node's stage (None before ``start``, or standing by)."""
        return self._stage.engine

    @property
    def layout(self) -> Layout | None:
        """The running layout (stages x pipelines, the layer split); None before ``start``."""
        return self._stage.layout

    @property
    def depth(self) -> int | None:
        """The pipeline depth this node runs, or will run at ``start`` (None: the world's)."""
        return self._stage.depth

    @property
    def seed(self) -> int:
        """The seed the layers are built under."""
        return self._stage.seed

    @property
    def node(self) -> str:
        """This node's name."""
        return self._stage.node

    @property
    def backend(self) -> str:
        """The process group backend the stage's groups form on."""
        return self._stage.backend

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step of this node's pipeline."""
        return self._stage.micro_batches

    @property
    def gradient_clipping(self) -> float:
        """The global norm gradients are clipped to (0: none)."""
        return self._stage.gradient_clipping

    @property
    def precision(self) -> Any:
        """The precision the stage computes in (``engine.precision.Precision``; None before it is resolved)."""
        return self._stage.precision

    @property
    def audits(self) -> int:
        """Replica audits run so far."""
        return self._stage.audits

    def place(self, device: torch.device | str | None = None, backend: str | None = None) -> None:
        """Where the stage will live and which backend its groups use (before ``start``)."""
        self._stage.place(device, backend)

    def configure(self, config: BambooConfig) -> None:
        """The options the stage is built with (before ``start``)."""
        self._stage.configure(config)

    def probe(self, model: PipelineModel) -> Any:
        """The model's layer census (names, parameter counts), without building a stage."""
        return self._stage.probe(model)

    def layer_costs(self) -> tuple[float, ...] | None:
        """The relative cost of each layer the partition weighs (None: equal)."""
        return self._stage.layer_costs()

    def precision_meta(self) -> dict[str, Any]:
        """What a checkpoint keeps of the precision (its name, fp16's loss scale)."""
        return self._stage.precision_meta()

    def resolve_precision(self, loss_scale: dict[str, Any] | None = None, gradient_clipping: float | None = None) -> Any:
        """The precision the stage computes in (a checkpoint's fp16 loss scale goes on)."""
        return self._stage.resolve_precision(loss_scale, gradient_clipping)

    def audit(self, when: str) -> None:
        """Compare every replica with its owner's live stage (with ``audit_replicas``; ``when`` for the message)."""
        self._stage.audit(when)

    @property
    def config(self) -> BambooConfig:
        """The options the stage runs with (``stage.configure`` changes them before it is built)."""
        return self._stage.config

    @property
    def session(self) -> Session | None:
        """The node's membership session under the Bamboo launcher (:meth:`open_session`), else None."""
        return self._stage.session

    @property
    def between_steps(self) -> bool:
        """Whether collectives go through the membership store (``NodeStage.between_steps``)."""
        return self._stage.between_steps

    # ------------------------------------------------------------------ membership
    def open_session(self, session: Session | None = None) -> Session | None:
        """Under the Bamboo launcher: register this node and pass the job's start rendezvous (else None). ``session``:
        one opened already (the DeepSpeed door opens it before the engine is asked for), taken as it is."""
        if self.session is None:
            if session is None and launched_by_bamboo():
                stage = self._stage
                session = start_session(self.config.detection_timeout, self.config.timeout, stage.backend)
            self._stage.attach(session)
        return self.session

    def wait_admission(self) -> Reconfiguration | None:
        """A standby node (one the launcher starts to join, or one that left the layout: ``Released``): standby
        until a reconfiguration admits it (its record; :meth:`join` it next), or the job finishes (None)."""
        session = self.open_session()
        assert session is not None and session.joining, "wait_admission() is for a standby node"
        return session.wait_as_standby()

    def join(self, record: Reconfiguration | None = None) -> tuple[Reconfiguration, int, int] | None:
        """A standby node's way into the job: enter the process group of its admission ``record`` (None: wait for
        one first, :meth:`wait_admission`). An admission that a loss interrupts before the group formed (a node of
        the new layout lost, cut off or frozen meanwhile: the running nodes restart without this node, or go back to
        their layout) stands this node by again, and it waits for the next one: whatever the membership did
        meanwhile, it takes the layout of the record it is admitted by. Returns (the record entered, rank, world
        size); None when the job finished first. An abandoned job ends the wait with ``FatalLoss``."""
        while True:
            if record is None:
                record = self.wait_admission()
                if record is None:
                    return None
            leave_idle_priority()  # a local standby process waited at idle priority (Cluster.spawn_joiner)
            try:
                rank, world = self._stage.require_session().enter(record)
            except (PeerLost, BarrierTimeoutError, CommAborted, FatalLoss) as err:
                log.warning("%s: a node was lost while this node was admitted at step %d (%s); it stands by again",
                            self._stage.node, record.step, err)
                self._stage.stand_by()
                record = None
                continue
            self._stage.assign(world // record.pipelines, rank)
            self.catching_up = True  # until its first step (see ``catching_up``)
            log.warning("%s: admitted as rank %d of %d at step %d", self._stage.node, rank, world, record.step)
            return record, rank, world

    def start_without_lost(self) -> tuple[int, int]:
        """Nodes died before the job's process group formed: start one pipeline of the nodes that are up.

        No step has run, so this is a smaller launch, not a failover: the job's process group is
        formed of the survivors, and the stage count follows them (the checkpoint it resumes from,
        if any, loads into any layout). A data-parallel job, or too few nodes left, stops with
        ``FatalLoss``: the launcher starts it again with the nodes that are up. Returns (rank, world).
        """
        session = self._stage.require_session()
        stop_if_refused(session)  # the node that died refused the configuration: the job stops, it does not shrink
        stages = self._stage.depth
        if stages is not None and stages != len(session.nodes):
            raise FatalLoss(f"{sorted(session.start_lost)} died while the job started; a job of {len(session.nodes)} "
                            f"nodes in {stages}-stage pipelines starts again with the nodes that are up")
        assigned = session.start_without(min_nodes=2 if self.config.redundant else 1)
        self._stage.assign(assigned[1])
        return assigned

    def before_step(self, hook: Callable[[PipelineRunner, int], None]) -> Callable[[], None]:
        """Call ``hook(runner, step)`` at the start of every step under membership, once every node of the
        pipeline is there in the same generation (leavers served): the place to reconfigure. A step that a failover
        redoes calls it again, in the failover's generation, before the redo, when that failover released nodes it
        offers for admission at once. Returns a function that removes the hook."""
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
        layout = self._stage.layout
        return [f"rank{r}" for r in range(layout.world_size if layout is not None else 1)]

    @property
    def standby(self) -> list[str]:
        """Standby nodes seen at the last commit (the same list on every node; see :meth:`admit_standby`)."""
        return [n for n in self.session.joiners if n not in self.session.nodes] if self.session is not None else []

    def admit_standby(self) -> None:
        """Report standby nodes at every commit (``standby``), so that a reconfiguration can admit them."""
        if self.session is not None:
            self.session.admitting = True

    @property
    def failovers(self) -> list[Failover | Restart]:
        """This node's failover records (and restarts after fatal losses), oldest first."""
        return self.session.failovers if self.session is not None else []

    def publish(self, topic: str, value: str) -> None:
        """Put ``value`` as this node's entry of ``topic`` in the job's store (``<job>/<topic>/<node>``), for
        whoever watches the job (the demo's controller reads ``progress``); nothing without membership."""
        if self.session is not None:
            self.session.store.put(self.session.keys.topic(topic, self.session.node), value)

    def agree(self, topic: str, step: int, proposal: dict[str, Any]) -> dict[str, Any]:
        """One value for ``topic`` at ``step`` on every node: the first proposal put in the store wins."""
        session = self._stage.require_session()
        _, kv = session.store.put_if_absent(session.keys.agreement(topic, session.generation, step), json.dumps(proposal))
        return dict(json.loads(kv.value))

    # ------------------------------------------------------------------ steps
    def start(self, model: PipelineModel, world: int, rank: int, fitting: bool, gradient_clipping: float = 0.0) -> None:
        """Build this process's stage of a fresh layout (``world`` processes), its engine and its replica."""
        self._stage.start(model, world, rank, fitting, gradient_clipping)

    def start_admitted(self, model: PipelineModel, record: Reconfiguration, gradient_clipping: float = 0.0) -> dict[str, Any]:
        """A joining node's stage, from the running nodes (see ``runtime.moves.start_admitted``); returns the
        training state the sender's host gave."""
        return start_admitted(self._stage, model, record, self._stage.rank, gradient_clipping)

    def train_step(self, batch: Any) -> torch.Tensor:
        """Train the step ``host.global_step()`` on ``batch``; if a peer is lost, fail over and redo it (unless
        it had committed). The batch is cut into this pipeline's micro-batches at every attempt: a failover
        or a reconfiguration may have changed the number of pipelines (the global batch stays). With
        ``audit_replicas`` every replica is then audited against its owner (a loss meanwhile: fail over, again)."""
        loss = self._train_step(batch)
        self.resilient(lambda: self._stage.audit("after"))
        return loss

    def _train_step(self, batch: Any) -> torch.Tensor:
        step = self.host.global_step()
        session = self.session
        joined_now, self.catching_up = self.catching_up, False
        if session is not None and session.leavers:
            # A peer announced at the last commit that it leaves: switch now, between steps, losing nothing.
            self._fail_over(PeerLost(f"{sorted(session.leavers)} left after a notice", session.leavers), step,
                            in_flight=False)
            session.leavers = set()
        if session is not None and not joined_now:  # (a new node: decided already)
            self._run_before_step(step)
        for _ in range(len(session.nodes) if session is not None else 1):
            engine, _layout = self._stage.require_stage()
            self._stage.collect_retired()  # an engine this one replaced: its memory goes before this step
            chunks, share, first = self._split(batch, global_batch=self.host.global_micro_batches() is not None)
            engine.set_micro_batches(len(chunks))
            if session is not None:
                # A step that takes a commit timeout is stuck somewhere: every thread's stack goes to the
                # node's log then, so that the node the others wait for shows where it waits.
                faulthandler.dump_traceback_later(session.rendezvous_timeout * 0.75, repeat=False)
            try:
                loss = engine.train_batch(data_iter=iter(chunks), step=step, share=share, first_micro_batch=first)
                self._trained, self._restarts_in_a_row = True, 0
                self._stage.tell_memory(rebuilt=bool(self.failovers))  # after an engine's first step: its memory
                self._stage.settle_placement()  # after an engine's first step on a GPU: where its replica lives
                if session is not None and session.leaving:
                    session.depart()
                return loss
            except PeerLost as err:
                if session is None:
                    raise
                if self._fail_over(err, step):
                    kept = self._stage.require_stage()[0].last_loss  # the committed step's, kept by the failover
                    assert kept is not None
                    return kept
                # the step is redone in a new generation. Nodes the failover released and offered at once
                # (``Session.offer_released``): the hooks decide again first, as after a notice's failover, so they
                # are taken back before the redo, not a step later; else the survivors redo it first
                if session.joiners:
                    self._run_before_step(step)
            finally:
                if session is not None:
                    faulthandler.cancel_dump_traceback_later()
        raise BambooConfigError(f"step {step} failed over {len(self._stage.require_session().nodes)} times; giving up")

    def _run_before_step(self, step: int) -> None:
        """The ``before_step`` hooks, for ``step`` in the current generation (their agreements are keyed by it)."""
        for hook in list(self._before_step):
            hook(self, step)

    def eval_step(self, batch: Any) -> torch.Tensor:
        """The loss of ``batch`` (this pipeline's share), with no update."""
        engine, _ = self._stage.require_stage()
        chunks, _, _ = self._split(batch)
        engine.set_micro_batches(len(chunks))
        return engine.eval_batch(data_iter=iter(chunks), num_micro_batches=len(chunks))

    def _split(self, batch: Any, global_batch: bool = False) -> tuple[list[tuple[Any, Any]], tuple[int, int] | None, int]:
        """This pipeline's micro-batches of ``batch``; of a global batch its share (``(count, total)``
        micro-batches, see ``pipeline_share``; None for a batch of this pipeline's own); and the global index of
        its first micro-batch (of a batch of its own: as if the pipelines' batches were one, in rank order)."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise batch_form_error(batch)
        inputs, targets = batch
        b = self.config.micro_batch_size
        pipelines, pipeline_rank = self._stage.pipelines, self._stage.pipeline_rank
        share: tuple[int, int] | None = None
        if global_batch:
            first, m, total = pipeline_share(len(inputs), b, pipelines, pipeline_rank)
            share, offset = (m, total), first
        else:  # the whole batch is this pipeline's; its micro-batches are numbered after the lower ranks'
            first, m = 0, micro_batches(len(inputs), b, pipelines)
            offset = pipeline_rank * m
        return [(inputs[i * b : (i + 1) * b], targets[i * b : (i + 1) * b]) for i in range(first, first + m)], share, offset

    def _fail_over(self, err: Exception, step: int, in_flight: bool = True) -> bool:
        """Rebuild the pipeline from the survivors' own stages and replicas; True if the step had committed
        (see ``runtime.failover.fail_over``). Before the job trained, a node lost may be a worker that refused the
        configuration: then the job stops (``stop_if_refused``)."""
        if not self._trained and self._restart is None:
            stop_if_refused(self.session)
        return fail_over(self._stage, err, step, in_flight)

    def reconfigure(self, order: list[str], parts: tuple[int, ...], reason: str = "", pipelines: int = 1) -> float:
        """Change the layout between two steps, with no loss (see ``runtime.moves.reconfigure``); the seconds it took."""
        return reconfigure(self._stage, order, parts, reason, pipelines,
                           elastic=self.host.global_micro_batches() is not None)

    # ------------------------------------------------------------------ a fatal loss: the job restarts
    def can_restart(self, err: BaseException) -> bool:
        """Whether ``err`` is a fatal loss this node restarts the job from (under membership, still a member; see
        ``MAX_RESTARTS_IN_A_ROW`` for the bound :meth:`restart` puts on restarts that train nothing)."""
        return (isinstance(err, FatalLoss) and self.config.restart_on_fatal_loss and self.session is not None
                and self.session.active and self._stage.engine is not None)  # (before the stage: the start fails)

    def restart(self, err: FatalLoss) -> tuple[int, int]:
        """After a fatal loss: the survivors form the job's next layout (``runtime.restart``); returns this node's
        (rank, world size). Next :meth:`start` the stage, load :meth:`restart_checkpoint`, then :meth:`restarted`."""
        if self._restarts_in_a_row >= MAX_RESTARTS_IN_A_ROW:
            log.error("%s: the job restarted %d times in a row without training a step; it stops (%s)",
                      self._stage.node, self._restarts_in_a_row, err)
            raise err
        self._restarts_in_a_row += 1
        self._restart = reform_after_fatal_loss(self._stage, err, self.host.global_step())
        self.catching_up = False
        return self._restart.rank, self._restart.world

    @property
    def restarting(self) -> bool:
        """Between :meth:`restart` and :meth:`restarted`."""
        return self._restart is not None

    def restart_checkpoint(self, candidates: Callable[[], Iterable[tuple[int, str]]]) -> tuple[int, str] | None:
        """The checkpoint the restarted job resumes from, the same on every node: each proposes the newest of its
        ``candidates()`` (``(step, path)`` of complete checkpoints it knows of), and the first proposal in the store
        wins. None: no complete checkpoint (the job starts again from its start). A checkpoint is code to the loader,
        and the store is not trusted (docs/security.md): the agreed path must be one of this node's own candidates
        (asked again, for a checkpoint committed meanwhile), else ``BambooError``."""
        assert self._restart is not None, "restart_checkpoint() comes after restart()"
        best = max(candidates(), default=None)
        proposal = {"step": best[0], "path": best[1]} if best is not None else {"step": None, "path": None}
        return known_checkpoint(self.agree("restart-checkpoint", self._restart.step, proposal), candidates)

    def restarted(self, checkpoint: str | None, from_step: int) -> Restart | None:
        """The restart is done (the stage built, ``checkpoint`` loaded, at ``from_step``): its record, logged once
        (None when no restart was under way)."""
        pending, self._restart = self._restart, None
        return restarted(self._stage, pending, checkpoint, from_step) if pending is not None else None

    # ------------------------------------------------------------------ collectives that survive a loss
    def resilient(self, fn: Callable[[], T]) -> T:
        """Run a collective; if a node is lost meanwhile, fail over (between steps) and run it again.

        Collectives outside the training step (checkpoint saves, metric syncs, the framework's own
        barriers) meet a lost node as much as the step does. Nested calls run plainly: the
        outermost call retries the whole operation in the new layout.
        """
        session = self.session
        if session is None or self._stage.engine is None or self._inside_resilient:
            return fn()
        step = self.host.global_step()
        for _ in range(len(session.nodes)):
            self._inside_resilient = True
            try:
                return session.guard().run(fn)
            except PeerLost as err:
                self._inside_resilient = False
                self._fail_over(err, step, in_flight=False)
            finally:
                self._inside_resilient = False
        raise BambooError(f"a collective failed over {len(session.nodes)} times at step {step}; giving up")

    def gather(self, obj: Any, send: bool = True) -> list[Any]:
        """Every node's ``obj`` (None for a node that does not ``send``), in rank order, through the store."""
        return self._stage.gather(obj, send)

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
            keep.append(getattr(self.session.groups, "tcp_store", None))
        self._stage.close()
        return keep
