"""``NodeStage``: a node's stage of the model, its DeepSpeed engine and its replica, built and rebuilt."""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.engine import audit, heap
from lightning_bamboo.engine.comm_process import BACKEND, trim_buffers
from lightning_bamboo.engine.construct import (
    build_engine,
    build_pipeline_module,
    deepspeed_config,
    ensure_deepspeed_comm,
    retire,
)
from lightning_bamboo.engine.module import BuiltLayers, LayerCensus, Splice, build_layers, census_layers
from lightning_bamboo.engine.partition import compute_parts
from lightning_bamboo.engine.pipe import BambooPipelineEngine, EngineOptions, Wiring
from lightning_bamboo.engine.precision import Precision, ScaleState, resolve
from lightning_bamboo.engine.replica import Replica, StageContainer, copy_hyperparameters
from lightning_bamboo.engine.replica_location import must_fit, replica_device, replica_stays_on_gpu
from lightning_bamboo.engine.transfer import exchange_objects
from lightning_bamboo.errors import BambooConfigError, BambooError
from lightning_bamboo.runtime import memory
from lightning_bamboo.runtime.collectives import gather_values
from lightning_bamboo.runtime.config import BambooConfig
from lightning_bamboo.runtime.host import PipelineModel, RunnerHost
from lightning_bamboo.runtime.session import Session
from lightning_bamboo.topology.layout import Layout, check_replica_memory, partition_weights, resolve_stages
from lightning_bamboo.topology.replicas import describe_kept, held_stage, kept_replicas, replica_peers

log = logging.getLogger(__name__)

States = dict[int, dict[str, Any]]
#: the layer objects a node held before a rebuild, by layer: its old stage's, its old replica's
LayerPool = tuple[Mapping[int, torch.nn.Module], Mapping[int, torch.nn.Module]]


class NodeStage:
    """What one process runs: its stage of ``layout`` (rank ``rank``), the engine around it and the replica of its
    successor's stage; under the Bamboo launcher it runs under the node's membership :class:`Session` (``attach``).

    ``start`` builds the first layout; ``rebuild`` any later one from layer states the node holds. Before the build,
    ``configure``, ``place`` and ``assign`` set its options, device and backend, and depth. The
    :class:`~lightning_bamboo.runtime.runner.PipelineRunner` composes it; the framework is reached through the
    :class:`~lightning_bamboo.runtime.host.RunnerHost`.
    """

    def __init__(self, config: BambooConfig, host: RunnerHost, device: torch.device | str = "cpu",
                 backend: str = BACKEND) -> None:
        self.config = config
        #: the depth the next fresh layout takes: the config's, until an admission or a smaller start decides it;
        #: a running job's depth is its layout's (``layout.stages``), which a reconfiguration carries here
        self.depth: int | None = config.stages
        self.host = host
        self.device = torch.device(device)
        self.backend = backend
        self.model: PipelineModel | None = None
        self.session: Session | None = None
        self.engine: BambooPipelineEngine | None = None
        self._placed: BambooPipelineEngine | None = None  # the engine whose replica's place a step decided
        self.layout: Layout | None = None
        self.rank = 0
        self.gradient_clipping = 0.0
        #: how the job computes (fp32, or bf16/fp16 with fp32 masters), its clipping and fp16's loss scale: resolved
        #: at start from the config, kept through every rebuild (the loss scale is the job's, not an engine's)
        self.precision: Precision | None = None
        self.param_counts: list[int] = []  # trainable parameters per layer, measured by probe()
        self.layer_names: list[str] = []  # each layer's class name, measured by probe()
        self.audits = 0  # replica audits passed by this process
        #: the process's RSS before it built a stage (its interpreter, imports, framework): the model's baseline
        self.baseline_bytes = 0
        self._memory_told: BambooPipelineEngine | None = None  # the engine whose memory was logged
        self._retired: list[weakref.ref[BambooPipelineEngine]] = []  # engines replaced, until they are collected
        heap.keep_heap_small()  # the process's RSS follows what its tensors hold (``engine.heap``)
        self._census: tuple[PipelineModel, int, LayerCensus] | None = None  # probe()'s, for its model and seed

    @property
    def node(self) -> str:
        return self.session.node if self.session is not None else f"rank {self.rank}"

    def configure(self, config: BambooConfig) -> None:
        """Run with ``config`` instead (a tuner's layout options, Lightning's precision), before the stage is built."""
        if self.engine is not None:
            raise BambooConfigError(
                "the strategy's options are fixed once its engine is built (at trainer.fit's setup); set them before, "
                "e.g. in BambooStrategy(...) or from a callback's setup hook, as HydrozoaTuner does"
            )
        if config.stages != self.config.stages:
            self.depth = config.stages
        self.config = config

    def place(self, device: torch.device | str | None = None, backend: str | None = None) -> None:
        """Run the stage on ``device`` and form its process groups on ``backend`` (the framework knows them only at
        its setup); refused once the stage is built (an engine's tensors and groups stay where they are)."""
        device = torch.device(device) if device is not None else self.device
        backend = backend if backend is not None else self.backend
        if self.engine is not None and (device, backend) != (self.device, self.backend):
            raise BambooConfigError(f"the stage's device and backend are fixed once its engine is built ({self.device}, "
                                    f"{self.backend!r}; asked {device}, {backend!r}): place() it before start()")
        self.device, self.backend = device, backend

    def attach(self, session: Session | None) -> None:
        """Run under the membership ``session`` (its commits, its guard, its store's collectives), or none."""
        self.session = session

    def assign(self, depth: int | None, rank: int | None = None) -> None:
        """The next fresh layout is ``depth`` stages deep (an admission, a smaller start, a restart decided it), and
        this process is ``rank`` in it (None: the rank ``start`` is given)."""
        self.depth = depth
        if rank is not None:
            self.rank = rank

    def require_session(self) -> Session:
        """The membership session; refused outside a job the Bamboo launcher started."""
        if self.session is None:
            raise BambooConfigError("this operation needs a job started by the Bamboo launcher (lightning-bamboo run)")
        return self.session

    def require_stage(self) -> tuple[BambooPipelineEngine, Layout]:
        """The engine and the layout of the built stage; refused before the stage is built."""
        if self.engine is None or self.layout is None:
            raise BambooConfigError("the runner has no stage yet: start() it first")
        return self.engine, self.layout

    @property
    def between_steps(self) -> bool:
        """Whether collectives go through the membership store (under the launcher, once the engine exists).

        A gloo collective cut by a loss can leave some survivors past it and others still in it;
        after the failover they would retry different collectives and wait on each other until
        the process group's timeout. ``Session.gather`` fails the same collective on every survivor.
        """
        return self.session is not None and self.session.active and self.engine is not None

    def probe(self, model: PipelineModel) -> LayerCensus:
        """The model's layers' parameter counts and names, none kept (``LayerSpec``s counted on the meta device);
        taken once per model and seed (the strategy's early checks and ``start`` ask both)."""
        if self._census is None or self._census[0] is not model or self._census[1] != self.seed:
            self._census = (model, self.seed, census_layers(model.configure_pipeline, self.seed))
        self.model = model
        census = self._census[2]
        self.param_counts, self.layer_names = census.param_counts, census.names
        return census

    def start(self, model: PipelineModel, world: int, rank: int, fitting: bool, gradient_clipping: float = 0.0) -> None:
        """Build this process's stage of a fresh layout (``world`` processes), its engine and its replica."""
        stages, pipelines = resolve_stages(world, self.depth)
        probe = self.probe(model)
        parts = compute_parts(self.config.partition, stages, probe.param_counts, probe.names)
        self.layout, self.rank, self.gradient_clipping = Layout(stages, pipelines, parts), rank, gradient_clipping
        self.resolve_precision()
        if self.session is not None and torch_dist.get_backend() != BACKEND:
            log.warning("%s: the job's process group uses %r, which cannot be aborted: a failover waits until a step "
                        "blocked on a lost peer returns by that backend's own timeout. Form it with "
                        "torch.distributed.init_process_group(%r, ...) (lightning_bamboo.engine.comm_process.BACKEND) "
                        "to end such waits at once.", self.session.node, torch_dist.get_backend(), BACKEND)
        ensure_deepspeed_comm(self.backend)
        if not self.baseline_bytes:  # the first stage this process builds
            self.baseline_bytes = memory.resident_bytes()
            gc.freeze()  # what lives until now lives on: later full collections scan only what is made from now on
        if self.engine is not None:  # a restart: the engine before runs no more, and goes before the new one is built
            self._retire(self.engine)
            self.engine = None
            self.collect_retired()
        module = self._stage_module(self.layout, self.layout.stage_of_rank(rank))
        optimizer = self.host.setup_optimizers(module) if fitting else None
        self.engine = self._new_engine(module, optimizer, self.layout)
        if fitting:
            self._arm(self.engine)
        trim_buffers()  # DeepSpeed's start-up broadcasts: their transfer buffers are not used again

    def resolve_precision(self, loss_scale: dict[str, Any] | None = None,
                          gradient_clipping: float | None = None) -> Precision:
        """The job's :class:`Precision` from the config and ``gradient_clipping`` (given: the host's, which it keeps;
        else the last given) (``loss_scale``: fp16's scale state to continue from, a checkpoint's or a running
        node's)."""
        if gradient_clipping is not None:
            self.gradient_clipping = gradient_clipping
        if self.precision is None:
            self.precision, _ = resolve(self.config.precision, self.config.deepspeed, self.gradient_clipping)
        if loss_scale and self.precision.state is not None:
            self.precision.state = ScaleState(**loss_scale)  # in place: the engines share this object
        return self.precision

    def precision_meta(self) -> dict[str, Any]:
        """What a checkpoint or a joining node needs of the precision: fp16's loss scale state."""
        state = self.precision.state if self.precision is not None else None
        return {"precision": self.precision.name if self.precision else "32",
                **({"loss_scale": state.as_dict()} if state is not None else {})}

    def _build(self, keep: Callable[[int], bool]) -> BuiltLayers:
        """The layers ``keep`` selects (a stage's, a replica's), built under the layer-wise contract
        (``engine.module.build_layers``): a ``LayerSpec`` not kept is never built."""
        assert self.model is not None, "probe() or start() names the model first"
        return build_layers(self.model.configure_pipeline, self.seed, keep)

    @property
    def seed(self) -> int:
        """The seed the layers are built under: the configured one, else the framework's global seed."""
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
        with _deepspeed_device(self.device):
            module = build_pipeline_module(layers, layout, self.model.pipeline_loss, timeout)
        module.to(self.device)
        module.set_precision(self.precision, self.device)
        module.checkpoint_every = self.config.activation_checkpointing
        module.ties = built.ties
        if states is not None:
            ckpt.load_weights(module, {i: s for i, s in states.items() if i not in prebuilt}, strict=not prebuilt)
        self.host.adopt_stage(module)
        return module

    def _retire(self, engine: BambooPipelineEngine) -> None:
        retire(engine)  # what the garbage collector cannot see
        self._retired.append(weakref.ref(engine))

    def collect_retired(self) -> None:
        """Before a step, while an engine that was replaced (a failover, a reconfiguration, a restart) is alive: a full
        garbage collection. DeepSpeed's engine is in reference cycles (its module's forward hooks and closures of its
        constructor call it back) that only such a collection frees, and a long-running process runs one rarely: the
        old engine's stage, weights and optimizer state stayed resident beside the new one's. Cheap: the objects of
        before the first stage are frozen (``start``)."""
        if any(ref() is not None for ref in self._retired):
            gc.collect()
        self._retired = [ref for ref in self._retired if ref() is not None]

    def tell_memory(self, rebuilt: bool) -> None:
        """After the first step of each engine (``rebuilt``: a failover's, a reconfiguration's): log the node's
        predicted peak by owner against its measured peak (``runtime.memory``)."""
        engine, layout = self.engine, self.layout
        if engine is None or layout is None or engine is self._memory_told or not self.param_counts:
            return
        self._memory_told = engine
        why = "its first step since its stage was rebuilt" if rebuilt else "its first step"
        try:
            predicted = memory.predict(engine, layout, self.rank, self.param_counts, self.baseline_bytes,
                                       self.config.activation_checkpointing)
        except (BambooConfigError, ValueError, ZeroDivisionError) as err:  # a log line must not stop training
            log.warning("%s: no memory prediction after %s: %s", self.node, why, err)
            return
        log.log(*memory.report(self.node, why, predicted))

    def settle_placement(self) -> None:
        """Once per engine, after its first step on a GPU under ``replica_placement="auto"`` without a budget: keep the
        replica where it is or move it, by what that step's peak left of the GPU (``placement.replica_stays_on_gpu``)."""
        engine = self.engine
        replica = engine.replica if engine is not None else None
        if (replica is None or self.device.type != "cuda" or self._placed is engine
                or self.config.replica_placement != "auto" or self.config.replica_memory_budget is not None):
            return
        self._placed = engine
        free, total = torch.cuda.mem_get_info(self.device)
        peak, on_gpu = torch.cuda.max_memory_allocated(self.device), not replica.hosted
        params = sum(p.numel() for p in replica.module.parameters())
        stays = replica_stays_on_gpu(on_gpu, params, free, total, torch.cuda.memory_reserved(self.device), peak)
        if stays != on_gpu:
            where = "the GPU" if stays else "pinned host memory"
            log.info("replica of stage %d (%d parameters): to %s after the first step (GPU %.2f GiB free of %.2f, peak "
                     "%.2f GiB)", replica.stage, params, where, free / 2**30, total / 2**30, peak / 2**30)
            with must_fit(f"the replica of stage {replica.stage} moved to {where}", self.device, stays):
                replica.place(stays)

    def _new_engine(self, module: Any, optimizer: Any, layout: Layout) -> BambooPipelineEngine:
        if self.device.type == "cuda":
            # the first step's peak decides the replica's place (``settle_placement``); torch keeps one peak per
            # process, so a user's own reading of it counts from here too
            torch.cuda.reset_peak_memory_stats(self.device)
        precision = self.precision if self.precision is not None else self.resolve_precision()
        # reduced precision and clipping are the engine's own (``engine.precision``), not DeepSpeed's
        _, rest = resolve(self.config.precision, self.config.deepspeed, self.gradient_clipping)
        config = deepspeed_config(self.config.micro_batch_size, 1, layout.pipelines, 0.0, rest)
        with _deepspeed_device(self.device):
            return build_engine(
                module, optimizer, config, timedelta(seconds=self.config.timeout),
                # "auto" runs lazy's program where it keeps replicas (``_arm`` wires which)
                options=EngineOptions(redundancy="lazy" if self.redundancy == "auto" else self.redundancy,
                                      rf_costs=self.config.rf_costs, seed=self.seed, precision=precision),
            )

    @property
    def redundancy(self) -> str:
        """The redundancy this node runs (``BambooConfig.redundancy_with``: ``auto`` keeps nothing without the
        launcher's membership)."""
        return self.config.redundancy_with(self.session is not None)

    def order(self, layout: Layout) -> list[str]:
        """The nodes of ``layout`` in rank order: the session's under membership, else one name per rank (each then
        its own machine)."""
        nodes = list(self.session.nodes) if self.session is not None else []
        return nodes if len(nodes) == layout.world_size else [f"rank{r}" for r in range(layout.world_size)]

    def kept(self, layout: Layout) -> tuple[bool, ...]:
        """Per stage of ``layout``: whether its replica is kept (``topology.replicas.kept_replicas`` of the config's
        redundancy and the node order: every rank computes the same)."""
        return kept_replicas(self.order(layout), layout.stages, self.redundancy)

    def _arm(self, engine: BambooPipelineEngine, replica_states: States | None = None,
             replica_layers: Mapping[int, torch.nn.Module] | None = None) -> None:
        """Wire the engine: its replica (of the successor's stage where it is kept, from ``replica_states`` or the
        seed; the layer objects ``replica_layers`` taken over as they are), its exchange peers, and under membership
        its node name, commit hook and watchdog."""
        layout = self.layout
        assert layout is not None
        wiring = Wiring()
        kept = self.kept(layout)
        if any(kept):
            successor = held_stage(layout, self.rank, kept)
            if successor is not None:
                layers = layout.layers_of_stage(successor)
                wiring.replica = self._new_replica(engine, layers, successor, replica_states,
                                                   self._replica_device(layers, check=replica_states is None),
                                                   replica_layers)
            wiring.replica_peers, wiring.kept = replica_peers(layout, self.rank, kept), kept
        if self.redundancy == "auto" and self.rank == 0:
            log.info("%s: %s", self.node, describe_kept(kept, "auto"))
        if self.session is not None:
            session = self.session
            wiring.node = session.node
            wiring.commit = lambda _step: session.commit(self.host.global_step())
            wiring.guard = session.guard()
        engine.wire(wiring)

    def _replica_device(self, layers: range, check: bool) -> torch.device:
        """Where the replica of ``layers`` lives (``placement.replica_device``); ``check``: that host memory
        holds it, if it goes there."""
        params = sum(self.param_counts[i] for i in layers)
        device = replica_device(self.device, params, self.config.replica_placement, self.config.replica_memory_budget)
        if check and device.type == "cpu":
            import psutil

            check_replica_memory(layers, params, psutil.virtual_memory().available)
        return device

    def _new_replica(self, engine: BambooPipelineEngine, layers: range, stage: int, states: States | None,
                     device: torch.device, prebuilt: Mapping[int, torch.nn.Module] | None = None) -> Replica:
        """A replica of ``stage`` (built under the seed, or from ``states``) with its own optimizer, on ``device``
        (the stage's, or the host: its forwards then run on a copy on the stage's device). ``prebuilt`` layers are
        taken over as they are (their weights are ``states``')."""
        prebuilt = prebuilt or {}
        built = self._build(keep=lambda i: i in layers and i not in prebuilt)
        with must_fit(f"the replica of stage {stage} (layers {layers.start}-{layers.stop - 1}, "
                      f"{sum(self.param_counts[i] for i in layers):,} parameters)", device, device.type == "cuda"):
            container = StageContainer({i: prebuilt.get(i, layer) for i, layer in enumerate(built.layers)
                                        if layer is not None or i in prebuilt}).to(device)
        if device.type == "cpu" and self.device.type == "cuda":
            for tensor in [*container.parameters(), *container.buffers()]:
                if not tensor.is_pinned():
                    tensor.data = tensor.data.pin_memory()  # its copies to and from the GPU run asynchronously
        if states is not None:
            ckpt.load_weights(container, {i: s for i, s in states.items() if i not in prebuilt}, strict=not prebuilt)
        optimizer = self.host.optimizer_for(container)
        if states is not None:
            ckpt.load_optimizer(container, optimizer, states, ckpt.param_group_hyperparameters(engine.optimizer))
        return Replica(stage, container, optimizer, device=self.device)

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

    def enter_group(self, rank: int, world: int) -> None:
        """This process is ``rank`` of ``world`` in the process group just formed (the host and DeepSpeed too)."""
        import deepspeed.comm.comm as ds_comm_module

        self.rank = rank
        self.host.enter_group(rank, world)
        ds_comm_module.cdb = None
        ensure_deepspeed_comm(self.backend)

    def rebuild(self, layout: Layout, rank: int, held: States, hyper: torch.optim.Optimizer | list[dict[str, Any]],
                fresh_optimizer: bool = False, reuse: tuple[StageContainer, dict[int, Any]] | None = None,
                pool: LayerPool | None = None, lineage: int | None = None, stage_lineage: int | None = None) -> None:
        """Build this node's stage of ``layout`` from ``held`` layer states, its engine, and the replica ring.

        ``hyper`` gives the optimizer's current hyperparameters (the old optimizer, or saved param
        groups). With ``fresh_optimizer`` (a node joining), the optimizer and schedulers come from the
        host's ``setup_optimizers``; otherwise the old optimizer is swapped for the new one.
        ``reuse`` (eager failover): the old replica's container and its kept redundant forwards; when
        the new stage ends with the replica's layers, it takes those layer objects over and the next
        step reuses the kept forwards (``engine.module.Splice``).
        ``pool`` (a failover, a reconfiguration): the layer objects this node held, its old stage's and its old
        replica's, whose weights are ``held``'s; the new stage and replica take over those they keep instead of
        building and loading them, and the replica ring sends a node only the layers it does not hold already from the
        same ``lineage`` (the old pipeline whose copies they are). ``stage_lineage``: that of the new stage's layers
        (None where they are of several, or unknown: the predecessor then gets every one). The old stage's objects
        serve only the new stage: the framework may still touch the parameters of the optimizer its step began with
        (Lightning zeroes that optimizer's gradients at its next step), and a replica's gradients wait there for its
        deferred update.
        """
        session = self.require_session()
        stage = layout.stage_of_rank(rank)
        mine = layout.layers_of_stage(stage)
        missing = [i for i in mine if i not in held]
        if missing:
            raise BambooError(f"the new layout gives {session.node} layers {missing} it does not hold")
        stage_states = {i: held[i] for i in mine}
        self.depth, self.layout, self.rank = layout.stages, layout, rank
        own_objects, replica_objects = pool if pool is not None else ({}, {})
        for layer in [*own_objects.values(), *replica_objects.values()]:
            for param in layer.parameters():
                param.grad = None  # a gradient is no state: the new engine starts from none, as a fresh build
        objects = {**replica_objects, **own_objects}  # for the stage: its own, and a replica's it takes over
        splice = None
        if reuse is not None:
            container, kept = reuse
            first, stop = container.indices[0], container.indices[-1] + 1
            if mine.stop == stop and mine.start <= first:  # the new stage ends with the replica's layers
                objects.update({int(n): layer for n, layer in container.named_children()})  # the forwards' own
                splice = Splice(first, kept)
        prebuilt = {i: objects[i] for i in mine if i in objects}
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
            replica = None
            kept = self.kept(layout)  # the new layout's: replicas it keeps are built, those it drops are not
            if any(kept):
                replica = self._ring(engine, layout, rank, held, replica_objects, lineage, stage_lineage, kept)
            self._arm(engine, *(replica or (None, None)))
            trim_buffers()  # the layers' transfer buffers: idle for the rest of this generation
            return engine

        old, self.engine = self.engine, session.guard().run(build_and_arm)
        if old is not None:
            self._retire(old)
        if isinstance(hyper, torch.optim.Optimizer):
            self.host.rebind_optimizer(hyper, optimizer)
        self.audit("membership change before")

    def _ring(self, engine: BambooPipelineEngine, layout: Layout, rank: int, held: States,
              pool: Mapping[int, torch.nn.Module], lineage: int | None, stage_lineage: int | None,
              kept_stages: tuple[bool, ...]) -> tuple[States, dict[int, torch.nn.Module]]:
        """Restore the replica ring: every node keeps its successor's stage where ``kept_stages`` keeps it (a node
        keeping none only serves its holder, if its own stage has one). The states and layer objects of the
        new replica: the layers this node holds already as copies of the same lineage are taken over, the others
        come from the successor, one layer per message (a serialised layer at a time on each side, not a stage)."""
        before, after = replica_peers(layout, rank, kept_stages)
        successor = held_stage(layout, rank, kept_stages)
        wanted = layout.layers_of_stage(successor) if successor is not None else range(0)
        # 1. lineages go the way the stages go: a node learns whether its successor's layers are its own copies
        successor_lineage = exchange_objects(stage_lineage, send_to=before, recv_from=after)
        same = lineage is not None and successor_lineage == lineage
        kept = {i: pool[i] for i in wanted if same and i in pool}
        lacking = [i for i in wanted if i not in kept]
        # 2. each node tells its successor what it lacks, and learns what its predecessor lacks
        to_send = exchange_objects(lacking, send_to=after, recv_from=before) or []
        # 3. the layers, one per message each way (the stage's own tensors, serialised as they are)
        own = engine.own_states(copy=False)
        received: States = {}
        for k in range(max(len(to_send), len(lacking))):
            payload = {to_send[k]: own[to_send[k]]} if k < len(to_send) else None
            got = exchange_objects(payload, send_to=before if k < len(to_send) else None,
                                   recv_from=after if k < len(lacking) else None)
            if got is not None:
                received.update(got)
        del own
        log.info("%s: replica ring restored: %d layer(s) kept, %d received, %d sent", self.node, len(kept),
                 len(received), len(to_send))
        return {**{i: held[i] for i in kept}, **received}, kept

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
            torch_dist.all_gather_object(reports, report)  # trusted: the job's own process group, as torch.distributed
        else:
            reports = [report]
        # an armed engine's layout keeps the replicas ``kept`` says, no more, no fewer
        kept = self.kept(layout) if engine.kept is not None else None
        audit.check([audit.NodeDigest(**r) for r in reports], self.host.global_step(), when, kept)
        self.audits += 1

    def stand_by(self) -> None:
        """Leave the layout and wait as a standby node (``Session.stand_by``): the generation's communication is
        aborted (the others re-formed without this node) and the stage, its engine and replica are dropped; an
        admission builds the stage again from the running nodes' layers."""
        session = self.require_session()
        session.groups.abort()
        if self.engine is not None:
            self.engine.release_exchange()
        self.engine, self.layout = None, None
        session.stand_by()

    def close(self) -> None:
        """Drop the engine and the session (the runner stopped it): the process is ending or leaving the job."""
        self.engine, self.session = None, None

    def gather(self, obj: Any, send: bool = True) -> list[Any]:
        """Every node's ``obj`` (None for a node that does not ``send``), in rank order, through the store (as JSON
        and raw tensors: ``runtime.collectives``; nothing read back is unpickled)."""
        return gather_values(self.require_session(), obj, send)



@contextmanager
def _deepspeed_device(device: torch.device) -> Iterator[None]:
    """DeepSpeed puts a pipeline module and its engine on GPU ``$LOCAL_RANK``; the stage's GPU is the runner's
    (several nodes of one host may share a GPU, or a node may use another than its local rank)."""
    if device.type != "cuda":
        yield
        return
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(device.index or 0)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved
