"""The demo's controller: runs the jobs of a run through the cluster's events and reports what happened."""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lightning_bamboo.demo.events import ClusterEvent
from lightning_bamboo.demo.recovery import RecoveryClock
from lightning_bamboo.demo.shape import DEMO_LAYERS, STANDBY_PROCESSES, layout_for
from lightning_bamboo.errors import BambooConfigError, BambooError
from lightning_bamboo.membership.keys import JobKeys
from lightning_bamboo.membership.protocol import StoreUnavailableError
from lightning_bamboo.membership.records import Failover, Reconfiguration, Restart, failover_record

EXIT_FATAL = 75  # lightning_bamboo.errors.FATAL_EXIT_CODE
#: the module every node's process runs (``python -m``)
WORKER_MODULE = "lightning_bamboo.demo.worker"
#: seconds the controller waits for a store that stopped answering (an etcd restart) before it gives up
STORE_PATIENCE = 60.0
EXIT_AUDIT = 76  # lightning_bamboo.demo.worker.EXIT_AUDIT: the replica audit found a difference
#: restarts in a row with no step finished and no node lost in between, after which the demo stops: the
#: job fails by itself, and restarting it again would go on without end
MAX_FRUITLESS_RESTARTS = 3


@dataclass
class DemoState:
    target_steps: int
    global_batch: int
    nodes: list[str]
    preempted: list[str] = field(default_factory=list)
    #: the job's step count when each of ``preempted`` was taken
    preempted_at: list[int] = field(default_factory=list)
    #: ``[step, seconds since the first finished step]`` each time the job's step count grew (as polled)
    step_times: list[list[float]] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    recoveries: dict[str, int] = field(default_factory=lambda: {"redundant": 0, "checkpoint": 0, "restart": 0})
    recovery: RecoveryClock = field(default_factory=RecoveryClock)
    recomputed_steps: int = 0
    processes_kept: int = 0  # worker processes that ran on after a fatal loss (restarts in place)
    processes_pooled: int = 0  # nodes that ran in a warm pool's process (demo.pool)
    failovers: list[Failover | Restart] = field(default_factory=list)
    reconfigurations: list[dict[str, Any]] = field(default_factory=list)
    progress: int = 0
    log: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    quiet: bool = False

    def event(self, text: str) -> None:
        """Record ``text`` for the report and show it now, with the time and the seconds since the start."""
        self.log.append(text)
        if not self.quiet:
            print(f"  {_stamp(self.started)}  {text}", flush=True)


def _stamp(started: float) -> str:
    """``18:57:03.2 +12.4s``: the wall-clock time and the seconds since ``started`` (a monotonic time)."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 10) % 10} +{time.monotonic() - started:.1f}s"


def drive(args: argparse.Namespace, stages: int, nodes: list[str], events: list[ClusterEvent], workdir: Path,
          prefix: str = "demo") -> dict[str, Any]:
    """Run the job (jobs ``{prefix}0``, ``{prefix}1``... one per restart) through ``events``; its report."""
    run = _Run(args, stages, nodes, events, workdir, prefix)
    try:
        final: dict[str, Any] | None = None
        while final is None:
            run.start_job()
            run.watch_job()
            final = run.end_job()
    finally:
        run.pool.close()
        run.cluster.close()
        run.preload_log.close()
    return run.report(final)


class _Run:
    """The controller's state through one run: the cluster, the nodes alive, the events still to come."""

    # the job of the current generation (set by start_job)
    job: str
    keys: JobKeys
    out: Path
    depth: int
    waiting: list[str]
    grows = False  # this job is a lone survivor that grows back by admissions
    command: list[str]
    logs: IO[str]
    fatal_at: int | None
    rescale: bool
    joiners: set[str]

    def __init__(self, args: argparse.Namespace, stages: int, nodes: list[str], events: list[ClusterEvent],
                 workdir: Path, prefix: str) -> None:
        from lightning_bamboo.demo.pool import WarmPool
        from lightning_bamboo.launcher import Cluster
        from lightning_bamboo.membership.node import idle_priority_supported

        self.args, self.stages, self.workdir, self.prefix = args, stages, workdir, prefix
        self.width = len(nodes)  # the nodes of the layout the job starts with: width // stages pipelines of stages
        # the depth the policy brings the job back to (``--preferred-stages``): the start's; a job that starts on one
        # node grows past it, one pipeline as deep as the nodes that join make it (exact: its pipeline count stays 1)
        joins = sum(1 for e in events if e.kind == "join")
        self.preferred = min(1 + joins, DEMO_LAYERS) if self.width == 1 and joins else stages
        self.state = state = DemoState(args.steps, args.global_batch, list(nodes), quiet=args.quiet)
        self.no_redundancy = args.redundancy == "off"
        workdir.mkdir(parents=True, exist_ok=True)
        if not self.no_redundancy and not idle_priority_supported():
            state.event("step 0: standby processes start at normal CPU priority (this user may not raise a thread back "
                        "from idle priority: needs root, CAP_SYS_NICE or RLIMIT_NICE 20); their start-up slows the "
                        "pipeline on these shared cores")
        self.ckpt_dir = workdir / "checkpoints"
        self.pending = sorted(events, key=lambda e: (e.at_step if e.at_step is not None else e.at_seconds or 0.0))
        self.generation = 0
        self.alive = list(nodes)
        self.resume: str | None = None
        self.started = time.monotonic()
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None
        self.notices: dict[str, float] = {}
        self.frozen: set[str] = set()  # nodes stopped by --freeze: their processes never exit by themselves
        # every node's process is a fork of one interpreter that imported the worker's modules once (4-5 s of a core
        # each on these shared cores otherwise): a local cluster's machines come up as booted ones would
        self.preload_log = open(workdir / "preload.log", "ab")  # noqa: SIM115 - closed with the cluster
        self.cluster = Cluster(args.store, job=f"{prefix}{self.generation}", local_workers=self.width + STANDBY_PROCESSES,
                               preload=[WORKER_MODULE], preload_log=self.preload_log)
        self.cluster.store = PatientStore(self.cluster.store, STORE_PATIENCE)  # an etcd restarted under the demo is waited for
        # joined nodes, and restarts that find no process ready, take a started process (no imports to wait for)
        self.pool = WarmPool(self.cluster, 0 if self.no_redundancy or not events else args.warm_pool,
                             [sys.executable, "-m", WORKER_MODULE], f"{prefix}pool", workdir / "pool.log")
        self.shown: set[str] = set()  # failover and reconfiguration records already shown
        self.kept: set[str] = set()  # processes of the last job that run the next one (a restart in place)
        self.cold = False  # the last job's loss found no process ready: the restart waited for one to start
        self.fruitless = 0  # jobs in a row that ended with no step finished and no node lost
        self.losses = 0  # nodes lost (preempted) by the last restart
        self.stepped = False  # the current job finished a step

    # ------------------------------------------------------------------ a job starts
    def start_job(self) -> None:
        """Start this generation's job: the pipelines of the start on the pool of nodes; other nodes stand by."""
        args, cluster = self.args, self.cluster
        self.job = job = f"{self.prefix}{self.generation}"
        previous_job = cluster.job
        cluster.new_job(job)
        self.out = self.workdir / f"run{self.generation}"
        self.out.mkdir(exist_ok=True)
        # the pipelines of the start; other nodes stand by (see STANDBY_PROCESSES). After a fatal loss
        # the survivors' processes, kept, form it (no start-up); the other nodes join it as standby nodes.
        pool = [n for n in self.alive if n in self.kept] if self.kept else self.alive
        count, self.depth = layout_for(len(pool), self.stages, self.width, args.global_batch, args.micro_batch)
        running = pool[:count]
        # a lone node keeps its redundancy on, so it grows by admissions: a survivor of a fatal loss back to pipelines,
        # a job that starts on one node past its start
        self.grows = not self.no_redundancy and count == 1 and (bool(self.kept) or self.preferred > 1)
        self.waiting = [n for n in self.alive if n not in running] if not self.no_redundancy and (count > 1 or self.grows) else []
        self.worker_args = worker_args = self._worker_args(count)
        self.command = [sys.executable, "-m", WORKER_MODULE, *worker_args]
        log = self.out / "workers.log"
        log.write_text("")
        # appended to by every process of the job: those it starts, and those it is given (kept, pooled)
        self.logs = open(log, "a")
        started = False  # a rank's process has its imports to do: the job waits for them
        for rank, name in enumerate(running):
            if name in self.kept:
                cluster.reuse(name, worker_args, rank, running, offered_in=previous_job, log=str(log))
                continue
            taken = self.generation and self.pool.take(name, worker_args, rank, running, log)  # a restart's, not the start's
            self.state.processes_pooled += bool(taken)
            if not taken:
                cluster.spawn(name, self.command, rank, running, stdout=self.logs, stderr=self.logs)
            started = started or taken != "ready"
        if started and self.generation:
            self.state.recovery.started_cold()
        self.joiners = set()  # started as standby processes in this generation
        for name in sorted(self.kept - set(running)):  # kept, no place in the start's layout: standby nodes
            cluster.reuse(name, worker_args, None, running, offered_in=previous_job, log=str(log))
            self.joiners.add(name)
            self.waiting.remove(name)
        self.kept, self.cold, self.stepped = set(), False, False
        self.keys = JobKeys(job)
        self.fatal_at = None
        self.rescale = False
        self.progress_revision = 0  # the store's revision at the last look at the progress (``_wait_for_progress``)

    def _worker_args(self, count: int) -> list[str]:
        """The worker's command line for a job of ``count`` nodes in pipelines of ``self.depth``."""
        args, depth, no_redundancy = self.args, self.depth, self.no_redundancy
        worker_args = [
            "--stages", str(depth), "--steps", str(args.steps), "--batch-size", str(args.global_batch // (count // depth)),
            "--global-batch", str(args.global_batch),
            "--redundancy", "off" if no_redundancy or (depth == 1 and not self.grows) else args.redundancy, "--checkpoint-dir", str(self.ckpt_dir),
            "--checkpoint-every", str(args.checkpoint_every), "--out", str(self.out), "--step-delay", str(args.step_delay),
            "--preferred-stages", str(self.preferred),
        ] + (["--resume", self.resume] if self.resume else []) + (args.worker_extra if depth == self.stages else [])
        worker_args += ["--optimizer", args.optimizer, "--dropout", str(args.dropout),
                        "--detection-timeout", str(args.detection_timeout)]
        worker_args += ["--audit"] if args.audit else []
        if not no_redundancy:
            # Bamboo keeps its processes through a fatal loss too; checkpoint-restart (torchelastic,
            # Varuna) starts new ones
            worker_args.append("--restart-in-place")
        return worker_args

    # ------------------------------------------------------------------ while it trains
    def watch_job(self) -> None:
        """Follow the job until it ends or must restart, firing the events that come due."""
        while True:
            exited = self.cluster.poll()
            if EXIT_AUDIT in exited.values():
                raise BambooError(f"replica audit failed at step {self.state.progress}; the workers' error is in "
                                  f"{self.workdir}: {_audit_error(self.workdir)}")
            progress = self._follow_progress()
            for event in self._due_events(progress):
                if event.kind == "preempt":
                    self._preempt(event)
                elif event.kind == "join":
                    self._join(event)
            self._start_standby()
            self._end_notices()
            if any(code == EXIT_FATAL for code in exited.values()) or self.rescale or (
                    not self.no_redundancy and self.cluster.offered(self.job)):
                self.fatal_at = self.state.progress
            if self._job_over():
                return
            self._wait_for_progress(0.05)

    def _wait_for_progress(self, seconds: float) -> None:
        """Wait until a node puts its progress or ``seconds`` pass: a step is seen when it finishes, so the step
        times in the report are the steps' (polled every 0.05 s, each came out on that grid: 0.565, 0.617 or 0.670 s
        for one step of 0.6 s)."""
        try:
            self.cluster.store.wait_for_change(self.keys.progress(), self.progress_revision, seconds)
        except StoreUnavailableError:
            pass  # the next look at the progress meets it as before

    def _follow_progress(self) -> dict[str, int]:
        """Show the steps finished since the last look; each node's step count."""
        state = self.state
        snap = self.cluster.store.get_prefix(self.keys.progress())
        self.progress_revision = snap.revision
        steps = [int(kv.value) for kv in snap.kvs]
        now = max(steps, default=state.progress)
        if now > state.progress:
            self.stepped = True
            self.last_step_at = time.monotonic()
            if self.first_step_at is None:
                self.first_step_at = time.monotonic()
            state.step_times.append([now, round(self.last_step_at - self.first_step_at, 4)])
            state.recovery.stepped(now, time.monotonic())
            state.progress = now
            _show(self.args, state, [n for n in self.cluster.running if n not in self.frozen])
            _show_records(self.cluster.store, self.keys, state, self.shown)
        return {kv.key.rsplit("/", 1)[1]: int(kv.value) for kv in snap.kvs}

    def _due_events(self, progress: dict[str, int]) -> list[ClusterEvent]:
        """The pending events that came due, taken off the list: a join at the job's step, a preemption at
        its node's step, a trace's event at its time."""
        elapsed = time.monotonic() - (self.first_step_at or self.started)
        due = []
        for event in list(self.pending):
            reached = self.state.progress if event.kind == "join" else progress.get(event.node, 0)
            if (event.at_step is not None and reached >= event.at_step) or (
                event.at_seconds is not None and self.first_step_at is not None and elapsed >= event.at_seconds
            ):
                self.pending.remove(event)
                due.append(event)
        return due

    def _preempt(self, event: ClusterEvent) -> None:
        """A standby node goes quietly; a running one is frozen, given notice, or killed."""
        cluster, state, node = self.cluster, self.state, event.node
        if node in self.alive and node not in cluster.running:
            self.alive.remove(node)
            if node in self.waiting:
                self.waiting.remove(node)
            state.event(f"step {state.progress}: standby {node} preempted")
        elif node in cluster.running and node in _standing_by(cluster, self.keys, self.joiners):
            cluster.kill(node, signal.SIGKILL)  # a standby process: nothing to recover
            self.alive.remove(node)
            state.event(f"step {state.progress}: standby {node} preempted")
        elif node in cluster.running:
            if event.frozen:
                cluster.kill(node, signal.SIGSTOP)
                self.frozen.add(node)
                state.event(f"step {state.progress}: {node} frozen (SIGSTOP, never continued)")
            elif event.notice:
                cluster.kill(node, signal.SIGTERM)
                self.notices[node] = time.monotonic() + event.notice
                state.event(f"step {state.progress}: {node} preempted with {event.notice:g} s notice")
            else:
                cluster.kill(node, signal.SIGKILL)
                state.event(f"step {state.progress}: {node} preempted (SIGKILL)")
            state.recovery.killed(time.monotonic())
            state.preempted.append(node)
            state.preempted_at.append(state.progress)
            self.alive.remove(node)

    def _join(self, event: ClusterEvent) -> None:
        """A new node: admitted by the policy from standby, or, without replicas, taken in by a restart."""
        state, no_replicas = self.state, self.no_redundancy or (self.depth == 1 and not self.grows)
        state.joined.append(event.node)
        self.alive.append(event.node)
        if no_replicas and len(self.cluster.running) < self.width:
            # checkpoint-restart scales up as torchelastic and Varuna do: restart everyone
            state.event(f"step {state.progress}: {event.node} joined: restart to take it in")
            self.rescale = True
        elif no_replicas:
            state.event(f"step {state.progress}: {event.node} joined (standby until the next restart)")
        else:  # started as a standby node; the policy admits it at a step start
            self.waiting.append(event.node)
            state.event(f"step {state.progress}: {event.node} joined")

    def _start_standby(self) -> None:
        """Start waiting nodes as standby processes while there is room for them."""
        # Standby nodes are real processes here, on the same cores as the pipeline: start as many
        # as can be used (the pipeline's missing stages, plus one spare), the rest when a place frees.
        while self.waiting and len(self.cluster.running) < max(self.width, self.preferred) + STANDBY_PROCESSES:
            name = self.waiting.pop(0)
            self.joiners.add(name)
            if self.pool.take(name, self.worker_args, None, [name], self.out / "workers.log"):
                self.state.processes_pooled += 1
            else:
                self.cluster.spawn_joiner(name, self.command, idle=True, stdout=self.logs, stderr=self.logs)

    def _end_notices(self) -> None:
        """SIGKILL the nodes whose notice is over."""
        for name, deadline in list(self.notices.items()):
            if time.monotonic() >= deadline:
                self.cluster.kill(name, signal.SIGKILL)  # the grace period is over
                del self.notices[name]

    def _job_over(self) -> bool:
        """Whether the job is over (only frozen or standby processes left, or a fatal loss); stops what is left."""
        cluster, frozen = self.cluster, self.frozen
        if set(cluster.running) <= frozen:  # a frozen process never ends by itself
            for name in frozen & set(cluster.running):
                cluster.kill(name, signal.SIGKILL)
            return True
        if self.joiners and set(cluster.running) - frozen <= _standing_by(cluster, self.keys, self.joiners):
            if self.no_redundancy or cluster.job_finished():
                _stop_within(cluster, 0.0)  # the job is over; standby nodes wait for nothing
                return True
            self.fatal_at = self.state.progress  # the pipeline is gone: the standby nodes restart it
        if self.fatal_at is not None:
            for name in frozen & set(cluster.running):
                cluster.kill(name, signal.SIGKILL)  # a frozen process cannot save or offer anything
            if self.no_redundancy or self.rescale:
                self.kept = _stop_within(cluster, 0.0 if self.rescale else 15.0)  # new processes: start_job says so
                return True
            # Standby processes have imported torch, DeepSpeed and Lightning: told that the job was abandoned,
            # they offer themselves to the next job as the survivors do (killing them made a restart with no
            # survivor start every process anew, 15-25 s on these cores). A joiner still starting is waited
            # for only while no process is kept at all and the warm pool has none ready: a new one would start no sooner.
            from lightning_bamboo.membership.lease import abandon_job

            abandon_job(cluster.store, self.job, f"a fatal loss at step {self.state.progress}")
            starting = functools.partial(_starting, cluster, self.keys, self.joiners)
            was_starting = starting()
            self.kept = _stop_within(cluster, 15.0, keep=functools.partial(cluster.offered, self.job),
                                     unless_kept=starting, spare=lambda: bool(self.pool.ready()))
            # no process was ready when the job was lost: its restart waited for one to start (a cold restart)
            self.cold = not self.kept - was_starting and not self.pool.ready()
            return True
        return False

    # ------------------------------------------------------------------ the job ended
    def end_job(self) -> dict[str, Any] | None:
        """Record the job's failovers and reconfigurations; its final report if it finished, else restart (None)."""
        cluster, state, keys, out = self.cluster, self.state, self.keys, self.out
        cluster.poll()
        _show_records(cluster.store, keys, state, self.shown)
        # keyed by generation, which the store lists as text ("10" before "4"): in the generations' order
        failovers = [failover_record(kv.value) for kv in sorted(cluster.store.get_prefix(keys.failovers()).kvs,
                                                                key=lambda kv: int(kv.key.rsplit("/", 1)[1]))]
        state.failovers += failovers
        state.recoveries["redundant"] += len(failovers)
        state.reconfigurations += sorted(
            (json.loads(kv.value) for kv in cluster.store.get_prefix(keys.reconfigurations()).kvs),
            key=lambda r: r["step"])
        report_file = out / "report.json"
        if state.progress == 0 and self.first_step_at is None and not report_file.exists() and self.generation == 0:
            codes = ", ".join(f"{n}={c}" for n, c in cluster.codes.items())
            raise BambooConfigError(
                f"the workers failed before their first step (exit codes: {codes}); see {out / 'workers.log'}"
                + ("" if self.args.workdir else " (run with --workdir DIR to keep it)")
            )
        if report_file.exists() and self.fatal_at is None:
            final: dict[str, Any] = json.loads(report_file.read_text())
            final["weights"] = str(out / "weights.pt")
            return final
        self._restart()
        return None

    def _restart(self) -> None:
        """A fatal loss (or no redundancy): the survivors start the next job from the last checkpoint."""
        cluster, state = self.cluster, self.state
        # Preemptions that came due while the job was down hit their nodes before they restart.
        elapsed = time.monotonic() - (self.first_step_at or self.started)
        for event in [e for e in self.pending if e.kind == "preempt" and e.at_seconds is not None and e.at_seconds <= elapsed]:
            self.pending.remove(event)
            if event.node in self.alive:
                self.alive.remove(event.node)
                state.preempted.append(event.node)
                state.preempted_at.append(state.progress)
                state.event(f"step {state.progress}: {event.node} preempted while the job restarted")
                cluster.kill(event.node, signal.SIGKILL)  # a kept process goes with its node
        self.fruitless = 0 if self.stepped or len(state.preempted) > self.losses or self.rescale else self.fruitless + 1
        self.losses = len(state.preempted)
        if self.fruitless > MAX_FRUITLESS_RESTARTS:
            raise BambooError(f"the job failed {self.fruitless} times in a row without finishing a step or losing a "
                              f"node; it would fail again: see the workers' errors in {self.out / 'workers.log'}")
        runnable = [n for n in self.alive if n not in state.preempted]
        # One survivor kept restarts alone, one stage, and the others join it as standby nodes, as after a
        # failover to one node (starting every process afresh costs the import time of torch and DeepSpeed).
        self.kept &= set(runnable)
        if not runnable:
            raise BambooConfigError("every node is gone and no replacement joined; the run stops at its last checkpoint")
        self.resume = resume = _last_checkpoint(self.ckpt_dir)
        restart_from = _checkpoint_step(resume) if resume else 0
        state.recomputed_steps += max(0, state.progress - restart_from)
        state.recovery.restarted(restart_from, cold=self.cold)
        state.recoveries["checkpoint" if resume else "restart"] += 1
        state.event(
            f"step {state.progress}: "
            + ("restart to add the nodes that joined: " if self.rescale else "no replica left for a lost stage: ")
            + f"restart {len(runnable)} nodes from " + (f"checkpoint step {restart_from}" if resume else "the beginning")
            + (f" ({len(self.kept)} in their running processes)" if self.kept else "")
        )
        state.progress = restart_from
        state.processes_kept += len(self.kept)
        self.alive = runnable
        self.generation += 1

    # ------------------------------------------------------------------ the run's report
    def report(self, final: dict[str, Any]) -> dict[str, Any]:
        """The run's report (``weights``: the final weights in the workdir, for --save-weights and --verify)."""
        state = self.state
        # training time: first to last finished step (start-up and the final save are not training)
        wall = (self.last_step_at or time.monotonic()) - (self.first_step_at or self.started)
        report = {
            "steps_completed": int(final.get("steps_completed", 0)),
            "target_steps": self.args.steps,
            "preemptions": len(state.preempted),
            "preemption_steps": state.preempted_at,
            "step_times": state.step_times,
            "joins": len(state.joined),
            "recoveries": state.recoveries,
            "processes_kept": state.processes_kept,
            "processes_pooled": state.processes_pooled,
            "recomputed_steps": state.recomputed_steps + sum(1 for f in state.failovers if isinstance(f, Failover) and f.redone),
            "recovery_seconds": [round(s, 3) for s in state.recovery.seconds],
            "recovery_kinds": state.recovery.kinds,
            "samples_per_second": max(0, final.get("steps_completed", 0) - 1) * state.global_batch / wall if wall > 0 else 0.0,
            "final_loss": final.get("final_loss"),
            "failovers": [f.as_dict() for f in state.failovers],
            "reconfigurations": [{k: r.get(k) for k in ("step", "reason", "order", "parts", "seconds")} for r in state.reconfigurations],
            "events": state.log,
            "nodes_at_end": final.get("world_size"),
            "parts_at_end": final.get("parts"),
            "micro_batches": final.get("micro_batches"),
        }
        report["weights"] = final["weights"]  # in the workdir: copied by run() for --save-weights, read by --verify
        return report

class PatientStore:
    """The controller's store client: a call the store does not answer (a restarting etcd) is tried again,
    every 0.2 s for up to ``patience`` seconds, before its error stops the demo."""

    def __init__(self, store: Any, patience: float) -> None:
        self._store, self._patience = store, patience

    def __getattr__(self, name: str) -> Any:
        from lightning_bamboo.membership.protocol import StoreUnavailableError

        attr = getattr(self._store, name)
        if not callable(attr) or name == "close":
            return attr

        def patient(*args: Any, **kwargs: Any) -> Any:
            deadline = time.monotonic() + self._patience
            while True:
                try:
                    return attr(*args, **kwargs)
                except StoreUnavailableError:  # timeouts too
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

        return patient


def _audit_error(workdir: Path) -> str:
    """The replica audit's error as a worker printed it (a JSON line with ``"audit"``) in a log of ``workdir``
    (a process writes to the log of the job it started in, or to the warm pool's)."""
    for log in [*sorted(workdir.glob("run*/workers.log")), workdir / "pool.log"]:
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            if line.startswith("{") and '"audit"' in line:
                return str(json.loads(line)["audit"])
    return "(no audit line in the logs)"


def _standing_by(cluster: Any, keys: JobKeys, joiners: set[str]) -> set[str]:
    """Nodes waiting as standby: the ``joiners`` (started as standby processes) that no reconfiguration has
    admitted yet, and nodes registered as standby (a node released from a dropped pipeline is one)."""
    registered = _registered(cluster, keys)
    return (joiners - _admitted(cluster, keys)) | registered if joiners else registered


def _starting(cluster: Any, keys: JobKeys, joiners: set[str]) -> set[str]:
    """The ``joiners`` still starting: running, neither registered as standby nodes nor admitted yet."""
    return (joiners & set(cluster.running)) - _registered(cluster, keys) - _admitted(cluster, keys)


def _registered(cluster: Any, keys: JobKeys) -> set[str]:
    return {kv.key.rsplit("/", 1)[1] for kv in cluster.store.get_prefix(keys.standby()).kvs}


def _admitted(cluster: Any, keys: JobKeys) -> set[str]:
    return {n for kv in cluster.store.get_prefix(keys.admit()).kvs for n in json.loads(kv.value)["order"]}


def _stop_within(cluster: Any, seconds: float, keep: Callable[[], set[str]] = set,
                 unless_kept: Callable[[], set[str]] = set, spare: Callable[[], bool] = lambda: False) -> set[str]:
    """Wait (at most ``seconds``) until every worker exited or is in ``keep()``; SIGKILL the others.
    Returns the kept ones (after a fatal loss: the workers that offered their process to the next job).
    Workers in ``unless_kept()`` are waited for only while none is kept and ``spare()`` (another process
    ready) is false."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        kept = keep()
        left = set(cluster.running) - kept
        if not left or ((kept or spare()) and left <= unless_kept()):
            break
        cluster.poll()
        time.sleep(0.05)
    kept = keep() & set(cluster.running)
    for name in set(cluster.running) - kept:
        cluster.kill(name, signal.SIGKILL)
    cluster.poll()
    return kept


def _checkpoint_step(path: str) -> int:
    return int(Path(path).name.removeprefix("step").removesuffix(".ckpt"))


def _last_checkpoint(directory: Path) -> str | None:
    done = [p for p in directory.glob("step*.ckpt") if (p / "meta.pt").exists()]
    return str(max(done, key=lambda p: _checkpoint_step(str(p)))) if done else None


def _show(args: argparse.Namespace, state: DemoState, running: list[str]) -> None:
    if args.quiet:
        return
    width = 30
    filled = int(width * state.progress / max(1, state.target_steps))
    # the line starts with "step N/M" (lightning_bamboo.sim.calibration reads it); the time goes last
    print(f"  step {state.progress:>4}/{state.target_steps}  [{'#' * filled}{'.' * (width - filled)}]  "
          f"live: {' '.join(sorted(running))}  ({_stamp(state.started)})", flush=True)


def _show_records(store: Any, keys: JobKeys, state: DemoState, shown: set[str]) -> None:
    """Show the failovers and reconfigurations the workers recorded in the store since the last call."""
    if state.quiet:
        return
    for prefix in (keys.failovers(), keys.reconfigurations()):
        for kv in store.get_prefix(prefix).kvs:
            if kv.key not in shown:
                shown.add(kv.key)
                state.event(record_line(failover_record(kv.value) if prefix == keys.failovers()
                                      else Reconfiguration.from_json(kv.value)))


def record_line(record: Failover | Restart | Reconfiguration) -> str:
    """One line of the demo's events for a failover, a restart or a reconfiguration."""
    if isinstance(record, Reconfiguration):
        return (f"step {record.step}: reconfigured in {record.seconds or 0.0:.2f} s ({record.reason.split(':')[0]}): "
                f"{' -> '.join(record.order)} layers {list(record.parts)}")
    now = (" -> ".join(record.order) if record.pipelines == 1
           else f"{record.pipelines} pipelines of {', '.join(record.order)}")
    if isinstance(record, Restart):
        return f"restart in {record.seconds:.2f} s after a fatal loss of {', '.join(record.lost) or '-'}; now {now}"
    return (f"step {record.step}: failover in {record.seconds:.2f} s: lost {', '.join(record.lost) or '-'}; now {now}"
            + ("; the step in flight is redone" if record.redone else "")
            + (f"; released {', '.join(record.released)}" if record.released else ""))
