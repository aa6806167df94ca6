"""Ways to run a job: on-demand, checkpoint-restart on spot (run-time or oracle interval), Bamboo on spot.

A policy reacts to membership events (``on_add``, ``on_ready``, ``on_remove``) as they happen and
decides at ``settle``, once every event of that instant is known (a step boundary).
"""

from __future__ import annotations

from lightning_bamboo.sim.ledger import Ledger
from lightning_bamboo.sim.model import policy_config, runtime_interval, samples_per_second, step_rate
from lightning_bamboo.sim.params import SimParams
from lightning_bamboo.sim.trace import TraceEvent
from lightning_bamboo.topology.layout import even_parts
from lightning_bamboo.topology.policy import Placement, fresh_placement, reconfigure


class Policy:
    """Base: tracks which nodes are ready; subclasses decide layouts."""

    name = "policy"

    def __init__(self, params: SimParams, ledger: Ledger) -> None:
        self.params = params
        self.ledger = ledger
        self.config = policy_config(params)
        self.ready: list[str] = []  # usable nodes, in the order they became ready
        self.layout: Placement | None = None
        self.started = False
        #: nodes that left the layout alive and stand by to be admitted again: the replay makes each
        #: ready again ``rejoin_seconds`` later (:func:`lightning_bamboo.sim.simulate.run_policy`)
        self.restarting: list[str] = []

    def on_add(self, event: TraceEvent) -> None:
        """A node was added (billed from now; usable after ``node_ready_seconds``)."""

    def on_ready(self, node: str) -> None:
        self.ready.append(node)

    def on_remove(self, event: TraceEvent) -> None:
        if event.node in self.ready:
            self.ready.remove(event.node)

    def settle(self) -> None:
        """Decide after every event of the current instant."""

    def _restart(self, nodes: set[str]) -> None:
        """``nodes`` leave the layout and come back as standby processes (not ready until then)."""
        for node in sorted(nodes):
            if node in self.ready:
                self.ready.remove(node)
                self.restarting.append(node)

    def _set_layout(self, layout: Placement | None, **rate: bool) -> None:
        self.layout = layout
        self.ledger.active = len(layout.nodes) if layout else 0
        self.ledger.rate = samples_per_second(layout, self.params, **rate)
        self.ledger.step_rate = step_rate(layout, self.params, **rate)
        self.ledger.mark()


class OnDemand(Policy):
    """A fixed cluster that is never preempted, at the on-demand price."""

    name = "on_demand"

    def settle(self) -> None:
        if self.layout is None and self.ready:
            self._set_layout(reconfigure(self.ready, self.ready, None, (), self.config).layout)


class CheckpointRestart(Policy):
    """Fixed depth; a loss rolls back to the last checkpoint, a chance to grow saves first.

    A removal of a node in the layout rolls every worker back to the last checkpoint and restarts
    them (as torchelastic and Varuna do); a removal with a notice long enough for a save loses
    nothing. A join that allows one more pipeline is voluntary: the job saves, then restarts wider,
    and loses no work. Nodes beyond whole pipelines wait. The checkpoint interval is chosen as the
    job runs (:func:`~lightning_bamboo.sim.model.runtime_interval`, from the preemptions it has
    seen) unless ``checkpoint_interval_seconds`` fixes it.
    """

    name = "checkpoint"
    adaptive = True  # choose the interval at run time (see checkpoint_oracle)

    def __init__(self, params: SimParams, ledger: Ledger) -> None:
        super().__init__(params, ledger)
        self.disrupted = False
        if self.adaptive and not params.checkpoint_interval_seconds:
            if params.checkpoint_save_seconds > 0:
                save = params.checkpoint_save_seconds
                ledger.interval_rule = lambda now: runtime_interval(save, now, ledger.preemptions)
            else:
                ledger.checkpoint_interval = params.step_seconds  # free saves: after every step

    def on_remove(self, event: TraceEvent) -> None:
        super().on_remove(event)
        if self.layout is not None and event.node in self.layout.nodes:
            self.ledger.preemptions += 1
            # a notice long enough for a save saves; a removal without one cannot, however cheap a save is
            notice = event.notice_seconds
            if not self.disrupted and notice > 0 and notice >= self.params.checkpoint_save_seconds:
                self.ledger.commit_now()
            self.disrupted = True

    def _pipelines(self) -> int:
        pipelines = len(self.ready) // self.params.stages
        cap = self.config.max_pipelines
        return pipelines if cap is None else min(pipelines, cap)

    def settle(self) -> None:
        pipelines = self._pipelines()
        current = self.layout.pipelines if self.layout is not None else 0
        if not self.disrupted and pipelines <= current:
            return
        voluntary = not self.disrupted and current > 0
        if self.disrupted:
            self.ledger.rollback()
            self.ledger.recoveries["checkpoint"] += 1
        elif voluntary:
            self.ledger.save(self.params.checkpoint_save_seconds)  # grow without losing work
            self.ledger.reconfigurations += 1
        self.disrupted = False
        layout = fresh_placement(self.ready, pipelines, self.params.stages, self.config) if pipelines else None
        if layout is not None and self.started:
            # a voluntary restart keeps the save queued before it; a recovery drops what was queued
            self.ledger.pause("restart", self.params.restart_seconds, restart=not voluntary)
        elif layout is None:
            self.ledger.pause("restart", 0.0, restart=True)  # nothing runs: drop queued pauses
        self.started = self.started or layout is not None
        self._set_layout(layout)


class CheckpointOracle(CheckpointRestart):
    """Checkpoint-restart with Young's interval for the whole trace's mean time between removals.

    No running job knows that number (it needs the trace's future): an upper bound for the
    checkpoint-restart baseline, kept as a labelled option.
    """

    name = "checkpoint_oracle"
    adaptive = False


class ElasticRestart(CheckpointRestart):
    """Checkpoint-restart as ``torchrun --nnodes=MIN:MAX`` runs it: every change of the nodes it uses restarts.

    The layout is as many whole pipelines of ``stages`` as the ready nodes make (the rest wait), or,
    with fewer nodes, one pipeline as deep as they are (at least ``min_stages``): what
    ``benchmarks/peer_train.py`` does under torchrun's elastic agents (one pipeline, its depth the
    live world) and what ``lightning-bamboo demo --no-redundancy`` does. A removal of a node it runs,
    and a node that becomes ready when the layout can use it, stop every worker (torchrun restarts
    them when an agent is lost and when a new one waits; nothing is saved first): back to the last
    checkpoint, ``restart_seconds``, then on in the new layout. A node ready while a restart is under
    way joins that restart (its rendezvous round waits for a lost agent's heartbeats to expire, and
    takes in the agents that come meanwhile). The step time of a layout follows the 1F1B formula from
    the measured one.
    """

    name = "elastic"

    def _layout(self) -> Placement | None:
        nodes, stages = len(self.ready), self.params.stages
        if nodes >= stages:
            return fresh_placement(self.ready, self._pipelines(), stages, self.config)
        if nodes < self.params.min_stages:
            return None
        row = tuple(self.ready[:nodes])
        return Placement((row,), even_parts(self.params.layers, nodes), self.config.micro_batches(1))

    def settle(self) -> None:
        layout = self._layout()
        used = len(layout.nodes) if layout is not None else 0
        current = len(self.layout.nodes) if self.layout is not None else 0
        if not self.disrupted and used <= current:
            return
        if not self.disrupted and self.layout is not None and self.ledger.restarting:  # it joins that restart
            self._set_layout(layout)
            return
        if self.layout is not None:  # its workers stop: what they trained since the last save is lost
            self.ledger.rollback()
            if self.disrupted:
                self.ledger.recoveries["checkpoint"] += 1
            else:
                self.ledger.reconfigurations += 1
        self.disrupted = False
        if layout is not None and self.started:
            self.ledger.pause("restart", self.params.restart_seconds, restart=True)
        elif layout is None:
            self.ledger.pause("restart", 0.0, restart=True)
        self.started = self.started or layout is not None
        self._set_layout(layout)


class Bamboo(Policy):
    """Redundant computation, with the runtime's rules for a loss (``topology/failover.py``'s ``plan_loss``).

    With several pipelines, a pipeline that lost a node is dropped and the whole ones train on
    (more micro-batches each; the survivors wait as standby nodes). Only when every pipeline lost a
    node does one of them fail over: each lost node's predecessor, which holds its replica, runs
    both stages (slower steps), and the others are released. (The runtime fails over every pipeline that
    lost the same stages; the traces remove one node at a time, each its own machine, and the first loss
    in a layout of several pipelines drops its pipeline, so that never arises here.) A loss that no pipeline can fail over
    (a node lost together with its replica holder, or a node already running two stages) is
    fatal: back to the last asynchronous checkpoint and restart. As in the runtime, the released
    survivors of a dropped pipeline stand by in their processes (``runtime/failover.py``'s
    ``Released``): they are usable again ``rejoin_seconds`` later. Every later layout change is
    decided by :func:`lightning_bamboo.topology.policy.reconfigure`.
    """

    name = "bamboo"
    #: which replicas the runtime keeps: ``"lazy"`` one of every stage; ``"auto"`` only where a stage has no
    #: data-parallel copy on another machine, i.e. in a job of one pipeline (every node is a machine of its own here)
    redundancy = "lazy"

    def __init__(self, params: SimParams, ledger: Ledger) -> None:
        super().__init__(params, ledger)
        self.overloaded: set[str] = set()
        self.domains: dict[str, str] = {}  # nodes started at the same instant share a failure domain
        self.fatal = False
        self.decisions: list[tuple[float, str, str]] = []  # (seconds, action, reason)
        self.replicas_ready = 0.0  # when the layout's replicas exist (auto: built after a change to one pipeline)

    def on_add(self, event: TraceEvent) -> None:
        self.domains[event.node] = f"t{event.ms}"

    def _replicas(self, layout: Placement | None) -> bool:
        """Whether ``layout`` keeps replicas (pays the redundancy overhead, can fail a pipeline over)."""
        return layout is not None and (self.redundancy == "lazy" or layout.pipelines == 1)

    def _set_layout(self, layout: Placement | None, **rate: bool) -> None:
        if self._replicas(layout) and not self._replicas(self.layout):
            # auto left with one pipeline: its replicas are built in the pause that formed it; a loss before they are
            # is fatal (as a loss inside the runtime's failover)
            self.replicas_ready = self.ledger.paused_until
        super()._set_layout(layout, **rate)

    def _keep_damaged(self, lost: set[str], pause: float) -> bool:
        """A design in which a damaged pipeline trains on (:mod:`lightning_bamboo.sim.designs`); True when it did.
        The runtime drops it."""
        return False

    def _fail_over(self, row: tuple[str, ...], lost: set[str]) -> list[str] | None:
        """The replica holders that take over ``row``'s lost stages, or None when one cannot."""
        holders = []
        for s, node in enumerate(row):
            if node not in lost:
                continue
            holder = row[(s - 1) % len(row)]
            if holder == node or holder in lost or node in self.overloaded or holder in self.overloaded:
                return None
            holders.append(holder)
        return holders

    def on_remove(self, event: TraceEvent) -> None:
        alive_before = set(self.ready)
        super().on_remove(event)
        node = event.node
        if self.layout is None or node not in self.layout.nodes or node not in alive_before:
            return
        self.ledger.preemptions += 1
        if self.fatal:
            return
        pause = 0.0 if event.notice_seconds > 0 else self.params.failover_seconds
        lost = {n for n in self.layout.nodes if n not in self.ready}
        if self._keep_damaged(lost, pause):
            return
        whole = [row for row in self.layout.grid if not lost & set(row)]
        if whole:  # drop the broken pipelines; no data moves
            self._restart({n for row in self.layout.grid if row not in whole for n in row})
            layout = Placement(tuple(whole), self.layout.parts, self.config.micro_batches(len(whole)))
            self.overloaded &= set(layout.nodes)  # a holder of a dropped pipeline (a design that keeps them) goes
            self.ledger.recoveries["redundant"] += 1
            self.ledger.pause("failover", pause)
            self._set_layout(layout, redundancy=self._replicas(layout), overloaded=bool(self.overloaded))
            return
        rows = sorted(self.layout.grid, key=lambda r: -sum(n not in lost for n in r))
        replicas = self._replicas(self.layout) and self.ledger.t >= self.replicas_ready
        for row in rows if replicas else ():  # without replicas no pipeline can fail over
            holders = self._fail_over(row, lost)
            if holders is not None:
                self.overloaded.update(holders)
                self.ledger.recoveries["redundant"] += 1
                self.ledger.pause("failover", pause)
                parts, batches = self.layout.parts, self.config.micro_batches(1)
                # the layout keeps the lost nodes' places: their holders run them (see step_rate)
                layout = Placement((row,), parts, batches) if len(rows) > 1 else self.layout
                self._restart({n for other in self.layout.grid if other != row for n in other})
                self.overloaded = (self.overloaded - lost) & set(row)
                self._set_layout(layout, redundancy=self._replicas(layout), overloaded=True)
                return
        self.fatal = True
        self.overloaded.clear()
        self.ledger.recoveries["checkpoint"] += 1
        self.ledger.rollback()
        self.ledger.pause("restart", self.params.restart_seconds, restart=True)

    def settle(self) -> None:
        layout_nodes = set(self.layout.nodes) if self.layout is not None else set()
        standby = [n for n in self.ready if n not in layout_nodes]
        overloaded = [n for n in self.overloaded if n in self.ready]
        decision = reconfigure(self.ready, standby, self.layout, overloaded, self.config, self.domains)
        if decision.action == "recover" and not self.fatal:
            raise AssertionError(f"policy found a lost stage that the simulator did not: {decision.reason}")
        if decision.layout is not self.layout:  # a suspended job staying suspended is no decision
            self.decisions.append((self.ledger.t, decision.action, decision.reason))
        if decision.action == "keep" or (decision.layout is None and self.layout is None):
            self.fatal = False
            return
        if decision.action == "suspend":
            if self.layout is not None and not self.fatal:
                # too few nodes to hold the model: what they hold is of no use alone
                self.ledger.recoveries["checkpoint"] += 1
                self.ledger.rollback()
            self.ledger.pause("restart", 0.0, restart=True)
        elif decision.action == "start":
            if self.started:
                self.ledger.pause("restart", self.params.restart_seconds, restart=True)
        elif decision.action != "recover":
            self.ledger.reconfigurations += 1
            self.ledger.pause("reconfigure", self.params.reconfigure_seconds)
        self.started = self.started or decision.layout is not None
        self.fatal = False
        self.overloaded.clear()
        self._set_layout(decision.layout, redundancy=self._replicas(decision.layout))


class BambooAuto(Bamboo):
    """Bamboo as the runtime runs ``redundancy="auto"``: replicas only in a job of one pipeline. With several, no
    step pays for replicas; a pipeline that lost a node is dropped (its survivors stand by), and a loss in every
    pipeline at once is fatal (no pipeline has a replica to fail over from)."""

    name = "bamboo_auto"
    redundancy = "auto"

