"""``lightning-bamboo demo``: N local worker processes train a GPT while nodes are preempted and replaced."""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_bamboo.demo.events import (
    ClusterEvent,
    events_from_trace,
    parse_freeze,
    parse_join,
    parse_preempt,
)
from lightning_bamboo.errors import BambooConfigError, BambooError

EXIT_FATAL = 75  # lightning_bamboo.errors.FATAL_EXIT_CODE
#: seconds the controller waits for a store that stopped answering (an etcd restart) before it gives up
STORE_PATIENCE = 60.0
EXIT_AUDIT = 76  # lightning_bamboo.demo.worker.EXIT_AUDIT: the replica audit found a difference
#: standby processes beyond a full pipeline (joined nodes past that wait without a process until a place frees)
STANDBY_PROCESSES = 1
#: seconds of notice the default preemption with notice gets (see default_preempt)
DEFAULT_NOTICE = 2
#: samples per step over all pipelines (each of P pipelines loads GLOBAL_BATCH / P; the worker's micro-batch is 2)
GLOBAL_BATCH = 8
#: the demo GPT's pipeline layers (lightning_bamboo.demo.worker.CONFIG: 6 blocks + embedding + head)
DEMO_LAYERS = 8
PLAN_HINT = "lightning-bamboo plan --example gpt --n-layer 6 --n-embd 48 --n-head 2 --block-size 16 --world-size N --json"  # what `make demo` shows: a kill, and a preemption with notice


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=4, help="worker processes, one per node (default 4)")
    parser.add_argument("--stages", type=int, default=None, help="pipeline depth (default: --nodes)")
    parser.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    parser.add_argument("--trace", default=None, help="Bamboo trace CSV (ms,add|remove,node) to replay")
    parser.add_argument("--time-scale", type=float, default=600.0, help="trace seconds per real second (default 600)")
    parser.add_argument("--preempt", default=None, help="NODE@STEP[:notice],... e.g. node2@7,node1@12:3; '' for none "
                        "(default: a middle node killed at a quarter of the steps, and with one pipeline of 4 or more "
                        "nodes its last node preempted with 2 s notice at 7/12 of them)")
    parser.add_argument("--join", default=None, help="NAME@STEP,... new nodes that join, e.g. spare1@9")
    parser.add_argument("--store", default="embedded", help="embedded (default) or etcd://HOST:PORT")
    parser.add_argument("--report", default=None, help="write the run's report JSON here")
    parser.add_argument("--save-weights", default=None, help="write the final consolidated fp32 state_dict here")
    parser.add_argument("--redundancy", choices=("off", "lazy", "eager"), default="lazy",
                        help="lazy (default): replicas, failover from them; eager: also the successor's forward in the "
                        "pipeline bubbles; off: no replicas, every loss restarts from a checkpoint")
    parser.add_argument("--no-redundancy", dest="redundancy", action="store_const", const="off",
                        help="the same as --redundancy off")
    parser.add_argument("--verify", action="store_true", help="then train the same steps without preemptions and "
                        "print the largest difference of the final weights (exit status 1 unless it is 0)")
    parser.add_argument("--checkpoint-every", type=int, default=4, help="steps between checkpoints (default 4)")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds each node pauses per step, to watch")
    parser.add_argument("--workdir", default=None, help="keep checkpoints and logs here (default: a temporary dir)")
    parser.add_argument("--plan", default=None, help="train with the layout of a `lightning-bamboo plan --json` file")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--freeze", default=None, help="NODE@STEP,...: stop these nodes (SIGSTOP, never continued), "
                        "a machine that hangs instead of vanishing, e.g. node2@7")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                        help="the demo model's optimizer (default sgd with momentum)")
    parser.add_argument("--audit", action="store_true", help="compare every replica with its stage, bit for bit, "
                        "after every step and membership change; a difference stops the run naming layer, step, node")


def default_preempt(nodes: int, stages: int, steps: int) -> str:
    """What ``make demo`` shows when no ``--preempt`` or ``--trace`` is given, for any cluster.

    A middle node (``node{nodes // 2}``) is SIGKILLed when a quarter of the steps are done; one pipeline
    of 4 or more nodes also loses its last node with a 2-second notice at 7/12 of the steps (4 nodes,
    24 steps: ``node2@6,node3@14:2``). One node, or fewer than 2 steps: nothing to show, no preemption.
    """
    if nodes < 2 or steps < 2:
        return ""
    events = [f"node{nodes // 2}@{max(1, steps // 4)}"]
    if nodes == stages and nodes >= 4:
        events.append(f"node{nodes - 1}@{max(1, steps * 7 // 12)}:{DEFAULT_NOTICE}")
    return ",".join(events)


class RecoveryClock:
    """Seconds from each kill to the completed step that recovered from it.

    A step that a restart from a checkpoint then undoes (a survivor may complete one before the loss
    is found) does not count: those kills are recovered when the restarted job completes a step, as
    checkpoint-restart's kills are.
    """

    def __init__(self) -> None:
        self._done: list[tuple[float, float]] = []  # (kill time, seconds): recoveries no restart can undo any more
        self._open: list[float] = []  # kill times not recovered from yet
        self._job: list[tuple[float, int, float]] = []  # (kill time, recovering step, seconds) in the running job
        self._restarted: set[float] = set()  # kill times whose recovery went through a restart from a checkpoint

    def killed(self, at: float) -> None:
        self._open.append(at)

    def stepped(self, step: int, at: float) -> None:
        self._job += [(kill, step, at - kill) for kill in self._open]
        self._open.clear()

    def restarted(self, from_step: int) -> None:
        """The job restarts from the checkpoint of ``from_step``: steps after it are undone."""
        for kill, step, seconds in self._job:
            if step > from_step:
                self._open.append(kill)
            else:
                self._done.append((kill, seconds))
        self._job.clear()
        self._restarted.update(self._open)

    def _all(self) -> list[tuple[float, float]]:
        return self._done + [(kill, seconds) for kill, _, seconds in self._job]

    @property
    def seconds(self) -> list[float]:
        return [seconds for _, seconds in self._all()]

    @property
    def kinds(self) -> list[str]:
        """Per recovery in ``seconds``: "restart" if it went through a restart from a checkpoint, else "failover"."""
        return ["restart" if kill in self._restarted else "failover" for kill, _ in self._all()]


@dataclass
class DemoState:
    target_steps: int
    global_batch: int
    nodes: list[str]
    preempted: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    recoveries: dict[str, int] = field(default_factory=lambda: {"redundant": 0, "checkpoint": 0, "restart": 0})
    recovery: RecoveryClock = field(default_factory=RecoveryClock)
    recomputed_steps: int = 0
    processes_kept: int = 0  # worker processes that ran on after a fatal loss (restarts in place)
    failovers: list[dict[str, Any]] = field(default_factory=list)
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


def _apply_plan(args: argparse.Namespace) -> list[str]:
    """Worker arguments from a Plan JSON (``lightning-bamboo plan --json``); sets ``args.stages``, ``args.micro_batch``
    and ``args.global_batch`` (without a plan: micro-batches of 2, ``GLOBAL_BATCH``)."""
    args.micro_batch, args.global_batch = 2, GLOBAL_BATCH
    if not args.plan:
        return []
    try:
        plan = json.loads(Path(args.plan).read_text())
        stages, pipelines = int(plan["stages"]), int(plan.get("pipelines", 1))
        micro, count, parts = int(plan["micro_batch_size"]), int(plan["micro_batches"]), list(plan["partition"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BambooConfigError(
            f"--plan {args.plan}: expected the JSON of `lightning-bamboo plan --json` with stages, pipelines, "
            f"micro_batch_size, micro_batches and partition ({err})"
        ) from None
    if parts[-1] != DEMO_LAYERS:
        raise BambooConfigError(
            f"plan {args.plan} cuts a model of {parts[-1]} layers, the demo's GPT has {DEMO_LAYERS}; make the plan with "
            f"`{PLAN_HINT}`"
        )
    if stages * pipelines != args.nodes:
        raise BambooConfigError(
            f"plan {args.plan} lays out {pipelines} pipeline(s) of {stages} stages = {stages * pipelines} nodes, the "
            f"demo runs --nodes {args.nodes}; make the plan with --world-size {args.nodes}"
        )
    if args.stages not in (None, stages):
        raise BambooConfigError(f"--stages {args.stages} contradicts the plan's {stages} stages; drop --stages")
    args.stages = stages
    args.micro_batch, args.global_batch = micro, micro * count * pipelines
    return ["--micro-batch-size", str(micro), "--partition", ",".join(map(str, parts))]


def run(args: argparse.Namespace) -> int:
    args.worker_extra = _apply_plan(args)
    stages = args.stages or args.nodes
    if args.nodes < 1 or args.steps < 1:
        raise BambooConfigError(f"--nodes and --steps must be at least 1 (nodes: {args.nodes}, steps: {args.steps})")
    if args.nodes < stages:
        raise BambooConfigError(
            f"fewer nodes than one pipeline needs (nodes: {args.nodes}, stages: {stages}); use --stages {args.nodes}"
        )
    if args.nodes % stages:
        raise BambooConfigError(
            f"--nodes must be a multiple of --stages: the nodes form data-parallel pipelines of --stages stages "
            f"(nodes: {args.nodes}, stages: {stages}); use --nodes {stages * max(1, args.nodes // stages)}"
        )
    if _layout_for(args.nodes, stages, args.nodes, args.global_batch, args.micro_batch)[0] != args.nodes:
        raise BambooConfigError(
            f"{args.nodes // stages} pipelines cannot split the demo's global batch of {args.global_batch} samples "
            f"into whole micro-batches of {args.micro_batch} each; use --nodes up to "
            f"{args.global_batch // args.micro_batch * stages}, with pipelines dividing {args.global_batch // args.micro_batch}"
        )
    if args.trace and args.preempt:
        raise BambooConfigError("give either --trace or --preempt, not both")
    nodes = [f"node{i}" for i in range(args.nodes)]
    joins = parse_join(args.join, nodes) if args.join else []
    if args.trace:
        from lightning_bamboo.sim.trace import read_trace

        events = events_from_trace(read_trace(args.trace), nodes, args.time_scale)
    else:  # a node that joins may be preempted later too
        spec = default_preempt(args.nodes, stages, args.steps) if args.preempt is None else args.preempt
        events = parse_preempt(spec, nodes + [e.node for e in joins])
    events += joins + (parse_freeze(args.freeze, nodes + [e.node for e in joins]) if args.freeze else [])
    if args.store != "embedded":
        _check_store_reachable(args.store)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bamboo-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if not args.quiet:
        shown = ", ".join(f"{e.node}@{e.at_step if e.at_step is not None else f'{e.at_seconds:.1f}s'}"
                          + (f" ({e.notice:g} s notice)" if e.notice else "") for e in events if e.kind == "preempt")
        print(f"  {args.nodes} nodes as {args.nodes // stages} pipeline(s) of {stages} stages, redundancy "
              f"{args.redundancy}, {args.steps} steps; preemptions: {shown or 'none'}", flush=True)
    try:
        report = _drive(args, stages, nodes, events, workdir)
        _summary(report)
        ok = report["steps_completed"] == report["target_steps"]
        if args.verify and ok:
            report["verify_max_difference"] = difference = _verify(args, stages, nodes, workdir, report)
            ok = difference == 0.0
        if args.save_weights:
            _copy_atomically(report["weights"], args.save_weights)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report.pop("weights", None)
    if args.report:
        _write_atomically(args.report, json.dumps(report, indent=2))
    return 0 if ok else 1


def _verify(args: argparse.Namespace, stages: int, nodes: list[str], workdir: Path, report: dict[str, Any]) -> float:
    """Train the same steps on the same nodes without preemptions or joins; the largest absolute difference
    between its final weights and the run's (0: the run's preemptions changed nothing)."""
    import torch

    if not args.quiet:
        print(f"\n  verify: the same {args.steps} steps without preemptions", flush=True)
    clean = _drive(args, stages, nodes, [], workdir / "verify", prefix="verify")
    if clean["steps_completed"] != args.steps:
        raise BambooConfigError(f"--verify: the run without preemptions completed {clean['steps_completed']} of "
                                f"{args.steps} steps; see {workdir / 'verify'} (run with --workdir DIR to keep it)")
    ours, theirs = torch.load(report["weights"]), torch.load(clean["weights"])
    if sorted(ours) != sorted(theirs):
        raise BambooConfigError(f"--verify: the two runs saved different layers ({sorted(set(ours) ^ set(theirs))})")
    difference = max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in ours)
    if difference == 0.0:
        print("  weights equal a run without preemptions (max difference 0)", flush=True)
    else:
        print(f"  weights DIFFER from a run without preemptions (max difference {difference:.3g})", flush=True)
    return difference


def _write_atomically(path: str, text: str) -> None:
    partial = Path(f"{path}.partial")
    partial.write_text(text)
    partial.replace(path)


def _copy_atomically(source: str, path: str) -> None:
    partial = Path(f"{path}.partial")
    shutil.copyfile(source, partial)
    partial.replace(path)


def _stamp(started: float) -> str:
    """``18:57:03.2 +12.4s``: the wall-clock time and the seconds since ``started`` (a monotonic time)."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 10) % 10} +{time.monotonic() - started:.1f}s"


def _check_store_reachable(url: str) -> None:
    from lightning_bamboo.membership import connect

    store = connect(url, timeout=3.0)
    try:
        store.get("/bamboo/ping", timeout=3.0)
    finally:
        store.close()


def _drive(args: argparse.Namespace, stages: int, nodes: list[str], events: list[ClusterEvent], workdir: Path,
           prefix: str = "demo") -> dict[str, Any]:
    """Run the job (jobs ``{prefix}0``, ``{prefix}1``... one per restart) through ``events``; its report."""
    from lightning_bamboo.launcher import Cluster
    from lightning_bamboo.membership.node import idle_priority_supported
    from lightning_bamboo.membership.registry import job_prefix

    width = len(nodes)  # the nodes of the layout the job starts with: width // stages pipelines of stages
    state = DemoState(args.steps, args.global_batch, list(nodes), quiet=args.quiet)
    no_redundancy = args.redundancy == "off"
    workdir.mkdir(parents=True, exist_ok=True)
    if not no_redundancy and not idle_priority_supported():
        state.event("step 0: standby processes start at normal CPU priority (this user may not raise a thread back "
                         "from idle priority: needs root, CAP_SYS_NICE or RLIMIT_NICE 20); their start-up slows the "
                         "pipeline on these shared cores")
    ckpt_dir = workdir / "checkpoints"
    pending = sorted(events, key=lambda e: (e.at_step if e.at_step is not None else e.at_seconds or 0.0))
    generation = 0
    alive = list(nodes)
    resume: str | None = None
    started = time.monotonic()
    first_step_at: float | None = None
    last_step_at: float | None = None
    final: dict[str, Any] | None = None
    notices: dict[str, float] = {}
    frozen: set[str] = set()  # nodes stopped by --freeze: their processes never exit by themselves
    cluster = Cluster(args.store, job=f"{prefix}{generation}", local_workers=width + STANDBY_PROCESSES)
    cluster.store = PatientStore(cluster.store, STORE_PATIENCE)  # an etcd restarted under the demo is waited for
    shown: set[str] = set()  # failover and reconfiguration records already shown
    kept: set[str] = set()  # processes of the last job that run the next one (a restart in place)
    try:
        while final is None:
            job = f"{prefix}{generation}"
            previous_job = cluster.job
            cluster.new_job(job)
            out = workdir / f"run{generation}"
            out.mkdir(exist_ok=True)
            # the pipelines of the start; other nodes stand by (see STANDBY_PROCESSES). After a fatal loss
            # the survivors' processes, kept, form it (no start-up); the other nodes join it as standby nodes.
            pool = [n for n in alive if n in kept] if kept else alive
            count, depth = _layout_for(len(pool), stages, width, args.global_batch, args.micro_batch)
            running = pool[:count]
            waiting = [n for n in alive if n not in running] if not no_redundancy and len(running) > 1 else []
            worker_args = [
                "--stages", str(depth), "--steps", str(args.steps), "--batch-size", str(args.global_batch // (count // depth)),
                "--global-batch", str(args.global_batch),
                "--redundancy", "off" if no_redundancy or depth == 1 else args.redundancy, "--checkpoint-dir", str(ckpt_dir),
                "--checkpoint-every", str(args.checkpoint_every), "--out", str(out), "--step-delay", str(args.step_delay),
                "--preferred-stages", str(stages),
            ] + (["--resume", resume] if resume else []) + (args.worker_extra if depth == stages else [])
            worker_args += ["--optimizer", args.optimizer] + (["--audit"] if args.audit else [])
            if not no_redundancy:
                # Bamboo keeps its processes through a fatal loss too; checkpoint-restart (torchelastic,
                # Varuna) starts new ones
                worker_args.append("--restart-in-place")
            command = [sys.executable, "-m", "lightning_bamboo.demo.worker", *worker_args]
            logs = open(out / "workers.log", "w")
            for rank, name in enumerate(running):
                if name in kept:
                    cluster.reuse(name, worker_args, rank, running, offered_in=previous_job)
                else:
                    cluster.spawn(name, command, rank, running, stdout=logs, stderr=logs)
            kept = set()
            base = job_prefix(job)
            fatal_at: int | None = None
            rescale = False
            joiners: set[str] = set()  # started as standby processes in this generation
            while True:
                exited = cluster.poll()
                if EXIT_AUDIT in exited.values():
                    raise BambooError(f"replica audit failed at step {state.progress}; the workers' error is in "
                                      f"{out / 'workers.log'}: {_audit_error(out / 'workers.log')}")
                snap = cluster.store.get_prefix(f"{base}progress/")
                steps = [int(kv.value) for kv in snap.kvs]
                now = max(steps, default=state.progress)
                if now > state.progress:
                    last_step_at = time.monotonic()
                    if first_step_at is None:
                        first_step_at = time.monotonic()
                    state.recovery.stepped(now, time.monotonic())
                    state.progress = now
                    _show(args, state, [n for n in cluster.running if n not in frozen])
                    _show_records(cluster.store, base, state, shown)
                progress = {kv.key.rsplit("/", 1)[1]: int(kv.value) for kv in snap.kvs}
                elapsed = time.monotonic() - (first_step_at or started)
                for event in list(pending):
                    reached = state.progress if event.kind == "join" else progress.get(event.node, 0)
                    due = (event.at_step is not None and reached >= event.at_step) or (
                        event.at_seconds is not None and first_step_at is not None and elapsed >= event.at_seconds
                    )
                    if not due:
                        continue
                    pending.remove(event)
                    if event.kind == "preempt" and event.node in alive and event.node not in cluster.running:
                        alive.remove(event.node)
                        if event.node in waiting:
                            waiting.remove(event.node)
                        state.event(f"step {state.progress}: standby {event.node} preempted")
                    elif event.kind == "preempt" and event.node in cluster.running and event.node in _standing_by(cluster, base, joiners):
                        cluster.kill(event.node, signal.SIGKILL)  # a standby process: nothing to recover
                        alive.remove(event.node)
                        state.event(f"step {state.progress}: standby {event.node} preempted")
                    elif event.kind == "preempt" and event.node in cluster.running:
                        if event.frozen:
                            cluster.kill(event.node, signal.SIGSTOP)
                            frozen.add(event.node)
                            state.event(f"step {state.progress}: {event.node} frozen (SIGSTOP, never continued)")
                        elif event.notice:
                            cluster.kill(event.node, signal.SIGTERM)
                            notices[event.node] = time.monotonic() + event.notice
                            state.event(f"step {state.progress}: {event.node} preempted with {event.notice:g} s notice")
                        else:
                            cluster.kill(event.node, signal.SIGKILL)
                            state.event(f"step {state.progress}: {event.node} preempted (SIGKILL)")
                        state.recovery.killed(time.monotonic())
                        state.preempted.append(event.node)
                        alive.remove(event.node)
                    elif event.kind == "join":
                        state.joined.append(event.node)
                        alive.append(event.node)
                        if (no_redundancy or depth == 1) and len(cluster.running) < width:
                            # checkpoint-restart scales up as torchelastic and Varuna do: restart everyone
                            state.event(f"step {state.progress}: {event.node} joined: restart to take it in")
                            rescale = True
                        elif no_redundancy or depth == 1:
                            state.event(f"step {state.progress}: {event.node} joined (standby until the next restart)")
                        else:  # started as a standby node; the policy admits it at a step start
                            waiting.append(event.node)
                            state.event(f"step {state.progress}: {event.node} joined")
                # Standby nodes are real processes here, on the same cores as the pipeline: start as many
                # as can be used (the pipeline's missing stages, plus one spare), the rest when a place frees.
                while waiting and len(cluster.running) < width + STANDBY_PROCESSES:
                    joiners.add(waiting[0])
                    cluster.spawn_joiner(waiting.pop(0), command, idle=True, stdout=logs, stderr=logs)
                for name, deadline in list(notices.items()):
                    if time.monotonic() >= deadline:
                        cluster.kill(name, signal.SIGKILL)  # the grace period is over
                        del notices[name]
                if any(code == EXIT_FATAL for code in exited.values()) or rescale or (
                        not no_redundancy and cluster.offered(job)):
                    fatal_at = state.progress
                if set(cluster.running) <= frozen:  # a frozen process never ends by itself
                    for name in frozen & set(cluster.running):
                        cluster.kill(name, signal.SIGKILL)
                    break
                if joiners and set(cluster.running) - frozen <= _standing_by(cluster, base, joiners):
                    _stop_within(cluster, 0.0)  # the pipeline is gone; standby nodes wait for nothing
                    break
                if fatal_at is not None:
                    for name in (_standing_by(cluster, base, joiners) | frozen) & set(cluster.running):
                        cluster.kill(name, signal.SIGKILL)  # holds nothing to save (or cannot): do not wait for it
                    offered = set if no_redundancy else functools.partial(cluster.offered, job)
                    kept = _stop_within(cluster, 0.0 if rescale else 15.0, keep=offered)
                    break
                time.sleep(0.05)
            cluster.poll()
            _show_records(cluster.store, base, state, shown)
            # keyed by generation, which the store lists as text ("10" before "4"): in step order
            failovers = sorted((json.loads(kv.value) for kv in cluster.store.get_prefix(f"{base}failovers/").kvs),
                               key=lambda r: r["step"])
            state.failovers += failovers
            state.recoveries["redundant"] += len(failovers)
            state.reconfigurations += sorted(
                (json.loads(kv.value) for kv in cluster.store.get_prefix(f"{base}reconfigurations/").kvs),
                key=lambda r: r["step"])
            report_file = out / "report.json"
            if state.progress == 0 and first_step_at is None and not report_file.exists() and generation == 0:
                codes = ", ".join(f"{n}={c}" for n, c in cluster.codes.items())
                raise BambooConfigError(
                    f"the workers failed before their first step (exit codes: {codes}); see {out / 'workers.log'}"
                    + ("" if args.workdir else " (run with --workdir DIR to keep it)")
                )
            if report_file.exists() and fatal_at is None:
                final = json.loads(report_file.read_text())
                final["weights"] = str(out / "weights.pt")
                break
            # A fatal loss (or no redundancy): restart the survivors from the last checkpoint.
            # Preemptions that came due while the job was down hit their nodes before they restart.
            elapsed = time.monotonic() - (first_step_at or started)
            for event in [e for e in pending if e.kind == "preempt" and e.at_seconds is not None and e.at_seconds <= elapsed]:
                pending.remove(event)
                if event.node in alive:
                    alive.remove(event.node)
                    state.preempted.append(event.node)
                    state.event(f"step {state.progress}: {event.node} preempted while the job restarted")
                    cluster.kill(event.node, signal.SIGKILL)  # a kept process goes with its node
            runnable = [n for n in alive if n not in state.preempted]
            kept &= set(runnable)
            if len(kept) < 2:  # a pipeline with replicas needs two: start every node afresh
                for name in kept:
                    cluster.kill(name, signal.SIGKILL)
                kept = set()
            if not runnable:
                raise BambooConfigError("every node is gone and no replacement joined; the run stops at its last checkpoint")
            resume = _last_checkpoint(ckpt_dir)
            restart_from = _checkpoint_step(resume) if resume else 0
            state.recomputed_steps += max(0, state.progress - restart_from)
            state.recovery.restarted(restart_from)
            state.recoveries["checkpoint" if resume else "restart"] += 1
            state.event(
                f"step {state.progress}: "
                + ("restart to add the nodes that joined: " if rescale else "no replica left for a lost stage: ")
                + f"restart {len(runnable)} nodes from " + (f"checkpoint step {restart_from}" if resume else "the beginning")
                + (f" ({len(kept)} in their running processes)" if kept else "")
            )
            state.progress = restart_from
            state.processes_kept += len(kept)
            alive = runnable
            generation += 1
    finally:
        cluster.close()
    # training time: first to last finished step (start-up and the final save are not training)
    wall = (last_step_at or time.monotonic()) - (first_step_at or started)
    report = {
        "steps_completed": int(final.get("steps_completed", 0)),
        "target_steps": args.steps,
        "preemptions": len(state.preempted),
        "joins": len(state.joined),
        "recoveries": state.recoveries,
        "processes_kept": state.processes_kept,
        "recomputed_steps": state.recomputed_steps + sum(1 for f in state.failovers if f["redone"]),
        "recovery_seconds": [round(s, 3) for s in state.recovery.seconds],
        "recovery_kinds": state.recovery.kinds,
        "samples_per_second": max(0, final.get("steps_completed", 0) - 1) * state.global_batch / wall if wall > 0 else 0.0,
        "final_loss": final.get("final_loss"),
        "failovers": state.failovers,
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


def _audit_error(log: Path) -> str:
    """The replica audit's error as a worker printed it (a JSON line with ``"audit"``)."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"audit"' in line:
            return str(json.loads(line)["audit"])
    return "(no audit line in the log)"


def _layout_for(nodes: int, stages: int, width: int, global_batch: int, micro_batch: int) -> tuple[int, int]:
    """``(nodes used, depth)`` of a job started on ``nodes`` nodes: the start's layout (``width`` nodes in
    pipelines of ``stages``) when they are there, else as many whole pipelines as fit (and share the global
    batch in whole micro-batches), else one shallower pipeline of them all."""
    if nodes < stages:
        return nodes, nodes
    pipelines = min(width, nodes) // stages
    while global_batch % (pipelines * micro_batch):
        pipelines -= 1
    return pipelines * stages, stages


def _standing_by(cluster: Any, base: str, joiners: set[str]) -> set[str]:
    """Nodes waiting as standby: the ``joiners`` (started as standby processes) that no reconfiguration has
    admitted yet, and nodes registered as standby (a node released from a dropped pipeline is one)."""
    registered = {kv.key.rsplit("/", 1)[1] for kv in cluster.store.get_prefix(f"{base}standby/").kvs}
    if not joiners:
        return registered
    admitted = {n for kv in cluster.store.get_prefix(f"{base}admit/").kvs for n in json.loads(kv.value)["order"]}
    return (joiners - admitted) | registered


def _stop_within(cluster: Any, seconds: float, keep: Callable[[], set[str]] = set) -> set[str]:
    """Wait (at most ``seconds``) until every worker exited or is in ``keep()``; SIGKILL the others.
    Returns the kept ones (after a fatal loss: the workers that offered their process to the next job)."""
    deadline = time.monotonic() + seconds
    while set(cluster.running) - keep() and time.monotonic() < deadline:
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


def _show_records(store: Any, base: str, state: DemoState, shown: set[str]) -> None:
    """Show the failovers and reconfigurations the workers recorded in the store since the last call."""
    if state.quiet:
        return
    for kind in ("failovers", "reconfigurations"):
        for kv in store.get_prefix(f"{base}{kind}/").kvs:
            if kv.key in shown:
                continue
            shown.add(kv.key)
            r = json.loads(kv.value)
            if kind == "failovers":
                now = (" -> ".join(r["order"]) if r.get("pipelines", 1) == 1
                       else f"{r['pipelines']} pipelines of {', '.join(r['order'])}")
                state.event(f"step {r['step']}: failover in {r['seconds']:.2f} s: lost {', '.join(r['lost']) or '-'}; "
                            f"now {now}"
                            + ("; the step in flight is redone" if r.get("redone") else "")
                            + (f"; released {', '.join(r['released'])}" if r.get("released") else ""))
            else:
                state.event(f"step {r['step']}: reconfigured in {r['seconds']:.2f} s ({str(r['reason']).split(':')[0]}): "
                            f"{' -> '.join(r['order'])} layers {r['parts']}")


def _summary(report: dict[str, Any]) -> None:
    rows = [
        ("steps completed", f"{report['steps_completed']} / {report['target_steps']}"),
        ("preemptions", str(report["preemptions"])),
        ("joins", str(report["joins"])),
        ("reconfigurations", ", ".join(f"step {r['step']} {str(r['reason']).split(':')[0]} {r['seconds']:.2f} s"
                                       for r in report["reconfigurations"]) or "-"),
        ("recoveries", ", ".join(f"{k} {v}" for k, v in report["recoveries"].items())),
        ("recomputed steps", str(report["recomputed_steps"])),
        ("recovery seconds", ", ".join(f"{s:.2f}" for s in report["recovery_seconds"]) or "-"),
        ("samples / second", f"{report['samples_per_second']:.1f}"),
        ("final loss", f"{report['final_loss']:.4f}" if report["final_loss"] is not None else "-"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n  " + "-" * (width + 30))
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print("  " + "-" * (width + 30))
