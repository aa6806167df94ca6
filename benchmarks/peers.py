"""Bamboo against what a user runs today: plain DeepSpeed under torchrun elastic, on one compressed spot-trace slice.

Three runs of the same model (the demo's GPT, 8 layers), the same global batch (8 samples in 4
micro-batches of 2), the same steps and the same slice of a Bamboo trace (its first ``--nodes`` nodes
start; a removal is a SIGKILL of that machine, a later node joins), on this machine:

- **(a) bamboo**: ``lightning-bamboo demo`` with its default redundancy (``lazy``), RebalanceCallback and
  checkpoints every K steps (``benchmarks/preemption.py``'s run);
- **(b) torchrun**: ``benchmarks/peer_train.py``, a plain DeepSpeed pipeline script, under one
  ``torchrun --nnodes=1:N --nproc-per-node=1 --max-restarts=R --rdzv-backend=c10d`` agent per machine.
  A preemption SIGKILLs the machine: the agent's process group and its worker's (torchrun starts each
  worker in a session of its own). A node that joins starts a new agent (at most N agents run; a joined
  node beyond them waits and replaces the next one preempted, as the demo's standby nodes do). The
  script saves a DeepSpeed checkpoint every K steps and loads the latest at every (re)start, its depth
  the live world size; the rendezvous store runs here, in this process, as on a machine no one preempts
  (the demo's store lives in its controller too), and an agent that fails on a machine still there (its
  rendezvous timed out) is started again, as a supervisor would. The rendezvous waits 2 s for late agents
  (``last_call_timeout``; torch's 30 s would add 28 s to every restart) and keeps torch's heartbeat (5 s);
  each round's workers get a fresh store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the shared default
  breaks when rank 0 moves to another machine, pytorch/pytorch#135712; see peer_train.py);
- **(c) demo --no-redundancy**: our emulation of checkpoint-restart, to see how close it comes to (b).

K is Young/Daly's interval: K = sqrt(2 × save time × MTBF) / step time, save and step time measured
in a short first run of (b) without preemptions, the MTBF from the slice (its kills of running nodes).
``--save-every K`` skips that run.

Prints for each: useful samples/s ((steps - 1) × 8 samples from the first to the last finished step,
the demo's own measure; every step of the end survived), preemptions, restarts, recomputed steps,
p50/max recovery (a kill to the first step finished after it by the job that recovered), the time lost
per preemption, for (b) its split into detection, restart, reload, first step and recomputed steps, and
the ratios a/b and a/c (target a/b >= 2x: exit status 1 below it).

    python benchmarks/peers.py --trace p3 [--nodes 6] [--steps 300] [--time-scale 100]
    python benchmarks/peers.py --trace g4dn

``--mtbf 10m`` replaces the slice with a synthetic trace of the simulator's own model (the ``--nodes`` nodes'
cluster loses one every 10 minutes of trace time on average, replacements after ``--replacement-delay``): the
failure rate of one point of ``lightning-bamboo simulate --sweep mtbf=...``, compressed by ``--time-scale``. With
``--wall``, the simulator then replays the events each run saw with that run's measured inputs (its undisturbed
step time, its mean recovery per kind, its reconfigurations, the peer's save time and interval) under the policy
that describes it (``bamboo`` for (a), ``elastic``, torchrun's one pipeline as deep as the live nodes, for (b))
and prints each run's ETTR (its samples in the wall time over what its undisturbed steps make) measured against
predicted; the target is within 15% (exit status 1 beyond it).

    python benchmarks/peers.py --mtbf 10m --time-scale 10 --wall 300 --step-delay 0.5 --only ab
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning_bamboo.demo.cli import exit_on_stop_signals
from lightning_bamboo.demo.shape import GLOBAL_BATCH  # peer_train.GLOBAL_BATCH too
from lightning_bamboo.sim.measured import (
    kills_of_running,
    own_pace_ettr,
    predict_samples,
    progress_at,
    sim_inputs,
    steps_for,
    summarize_peer,
    young_daly,
)
from lightning_bamboo.testing.job_output import run_demo as run_demo_process

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "lightning_bamboo" / "data"
PEER_SCRIPT = Path(__file__).resolve().parent / "peer_train.py"
#: torchrun's rendezvous: the store is external (here); a restart's last call for late agents, in seconds
LAST_CALL_SECONDS = 2
#: ... and the interval of its heartbeats (torch's default): an agent that missed 3 is dropped from the next round.
#: 1 or 2 s would drop a lost agent sooner, but on this shared, loaded machine they dropped live agents too and the
#: job's start failed (its agents waited on one another's rendezvous keys until they timed out)
KEEP_ALIVE_SECONDS = 5
#: seconds the agents get to exit once the job trained its last step (torchrun's exit barrier)
EXIT_GRACE_SECONDS = 30.0


def trace_path(name: str) -> Path:
    """``p3``, ``g4dn`` or a path to a Bamboo trace CSV."""
    if name in ("p3", "g4dn"):
        return DATA / f"aws-{name}-trace.csv"
    path = Path(name)
    if not path.exists():
        raise SystemExit(f"--trace {name}: no such file; give p3, g4dn or the path of a Bamboo trace CSV")
    return path


# ---------------------------------------------------------------------------------------------- the slice
def slice_events(path: Path, nodes: list[str], time_scale: float) -> list:
    """The slice's events exactly as the demo replays them (``lightning_bamboo.demo.events.events_from_trace``)."""
    from lightning_bamboo.demo.events import events_from_trace
    from lightning_bamboo.sim.trace import read_trace

    return sorted(events_from_trace(read_trace(str(path)), nodes, time_scale), key=lambda e: e.at_seconds)


# ---------------------------------------------------------------------------------------------- processes
def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_machine(proc: subprocess.Popen) -> None:
    """SIGKILL a machine: the agent's process group and those of everything it started, stopped first so that
    none of them sees the others go."""
    groups = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGSTOP)
        groups.append(proc.pid)
    for pid in descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            os.killpg(group, signal.SIGSTOP)
            groups.append(group)
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------- (a), (c)
def run_demo(label: str, args: argparse.Namespace, trace: Path | None, every: int, workdir: Path, *extra: str,
             steps: int | None = None) -> dict:
    """``lightning-bamboo demo`` on the slice (None: no preemption); its report (``--report``), with ``"wall"``."""
    report = workdir / f"{label}.json"
    events = ["--trace", str(trace), "--time-scale", str(args.time_scale)] if trace is not None else ["--preempt", ""]
    demo_args = ["--nodes", str(args.nodes), "--steps", str(steps or args.steps), *events, "--checkpoint-every",
                 str(every), "--step-delay", str(args.step_delay), "--quiet", "--report", str(report),
                 "--workdir", str(workdir / "demo"), *extra]
    log = workdir / f"{label}.log"
    began = time.monotonic()
    code = run_demo_process(demo_args, log, args.run_timeout, cwd=REPO)
    if code != 0 or not report.exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        workers = sorted((workdir / "demo").glob("run*/workers.log"))
        if workers:  # why its workers failed
            tail += f"{workers[-1]} ends:\n" + "".join(workers[-1].read_text(errors="replace").splitlines(keepends=True)[-25:])
        why = f"timed out after {args.run_timeout:.0f} s" if code is None else f"exit status {code}"
        return {"failed": f"{label}: {why}; its output ends:\n{tail}"}
    result = json.loads(report.read_text())
    result["wall"] = time.monotonic() - began
    return result


# ---------------------------------------------------------------------------------------------- (b)
@dataclass
class PeerRun:
    """Plain DeepSpeed under one torchrun agent per machine, through the slice's events."""

    args: argparse.Namespace
    events: list
    nodes: list[str]
    workdir: Path
    save_every: int
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    alive: list[str] = field(default_factory=list)  # nodes on the market: running an agent or waiting for a place
    kills: list[tuple[float, str]] = field(default_factory=list)  # (time, node)
    joins: int = 0
    agent_restarts: int = 0  # agents that exited with an error on a machine not preempted, started again
    codes: dict[str, int | None] = field(default_factory=dict)
    steps: int = 0  # the steps it trains (0: args.steps)

    def command(self, port: int) -> list[str]:
        a = self.args
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{a.nodes}", "--nproc-per-node=1",
                f"--max-restarts={a.max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=peer{port}", f"--rdzv-conf=is_host=false,last_call_timeout={a.last_call},"
                f"keep_alive_interval={a.keep_alive},keep_alive_max_attempt=3",
                str(PEER_SCRIPT), "--steps", str(self.steps or a.steps), "--save-dir", str(self.workdir / "ckpt"),
                "--save-every", str(self.save_every), "--events", str(self.workdir / "events.jsonl"),
                "--step-delay", str(a.step_delay)]

    def start(self, node: str, cmd: list[str]) -> None:
        env = {**os.environ, "PEER_NODE": node, "PYTHONUNBUFFERED": "1",
               # a fresh store per rendezvous round (see peer_train.py: the shared one breaks when rank 0 moves)
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               # the demo launcher's rule for workers sharing this machine's cores (launcher.cluster)
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                 str(max(1, len(os.sched_getaffinity(0)) // (self.args.nodes + 1))))}
        log = (self.workdir / f"agent-{node}.log").open("a")
        self.agents[node] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        log.close()

    def run(self) -> dict:
        from torch.distributed import TCPStore

        (self.workdir / "events.jsonl").touch()
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
        cmd = self.command(store.port)
        self.args.peer_command = " ".join(cmd)
        pending = list(self.events)
        began, first_step, deadline = time.monotonic(), None, time.monotonic() + self.args.run_timeout
        lines: list[dict] = []
        offset, finished, finished_at = 0, False, None
        try:
            self.alive = list(self.nodes)
            for node in self.nodes:
                self.start(node, cmd)
            while True:
                with (self.workdir / "events.jsonl").open() as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                offset += len(complete.encode())
                lines += [json.loads(x) for x in complete.splitlines() if x]
                if first_step is None and any(e["event"] == "step" for e in lines):
                    first_step = min(e["t"] for e in lines if e["event"] == "step")
                finished = finished or any(e["event"] == "done" and e["rank"] == 0 for e in lines)
                if finished and finished_at is None:
                    finished_at = time.monotonic()  # trained: the trace goes no further; the agents end by themselves
                if first_step is not None and not finished:
                    elapsed = time.time() - first_step
                    while pending and pending[0].at_seconds <= elapsed:
                        self.fire(pending.pop(0), cmd)
                for node, proc in list(self.agents.items()):
                    if proc.poll() is not None and node not in self.codes:
                        self.codes[node] = proc.returncode
                        if proc.returncode != 0 and node in self.alive and not finished:
                            # an agent that failed on a machine still there (its rendezvous timed out) is started
                            # again, as a supervisor (systemd, a Kubernetes pod) would
                            self.agent_restarts += 1
                            del self.codes[node]
                            self.start(node, cmd)
                running = [n for n, p in self.agents.items() if p.poll() is None]
                if not running:
                    break
                if finished_at is not None and time.monotonic() > finished_at + EXIT_GRACE_SECONDS:
                    break  # the agents' exit barrier waits for agents that are gone; the finally kills them
                if self.args.wall and first_step is not None and time.time() - first_step > self.args.wall + 1.0:
                    break  # equal wall time: what it trained later is not counted; the finally kills the agents
                if time.monotonic() > deadline:
                    where = self.dump_workers()
                    return {"failed": f"torchrun: not finished after {self.args.run_timeout:.0f} s ({where})", "lines": lines}
                time.sleep(0.05)
        finally:
            for node, proc in self.agents.items():
                if proc.poll() is None:
                    kill_machine(proc)
                    self.codes.setdefault(node, proc.returncode)
            # a worker whose agent is gone (reparented): every worker that wrote an event, if it still runs
            for pid in {e["pid"] for e in lines if e["event"] == "start"}:
                with contextlib.suppress(OSError):
                    if str(PEER_SCRIPT) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                        os.killpg(pid, signal.SIGKILL)
            del store
        result = summarize_peer(lines, self.kills, self.steps or self.args.steps)
        result.update(wall=time.monotonic() - began, joins=self.joins, codes=dict(self.codes),
                      agent_restarts=self.agent_restarts)
        return result

    def dump_workers(self) -> str:
        """Where each worker of a run that overran is (their tracebacks go to the agents' logs)."""
        for proc in self.agents.values():
            for pid in descendants(proc.pid) if proc.poll() is None else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(2.0)
        return f"the workers' tracebacks are in {self.workdir}/agent-*.log"

    def fire(self, event, cmd: list[str]) -> None:
        node, width = event.node, self.args.nodes
        if event.kind == "join":
            self.joins += 1
            self.alive.append(node)
        elif node in self.agents and self.agents[node].poll() is None:
            self.kills.append((time.time(), node))
            kill_machine(self.agents[node])
            self.codes[node] = self.agents[node].returncode
            self.alive.remove(node)
        elif node in self.alive:
            self.alive.remove(node)
        running = [n for n, p in self.agents.items() if p.poll() is None]
        for spare in [n for n in self.alive if n not in self.agents][: max(0, width - len(running))]:
            self.start(spare, cmd)  # a machine that joined takes a free place: a new agent, a new rendezvous round


def calibrate(args: argparse.Namespace, workdir: Path) -> dict:
    """A short run of (b) on all nodes, no preemption, saving every other step: its step and save times."""
    steps = args.calibration_steps
    saved = args.steps
    args.steps = steps
    try:
        for attempt in (1, 2):  # a job whose start fails is started again, as its user would
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir()
            run = PeerRun(args, [], [f"node{i}" for i in range(args.nodes)], workdir, save_every=2).run()
            if "failed" not in run and run["steps_completed"] == steps:
                break
            why = run.get("failed") or f"exit codes {run['codes']}"
            print(f"calibration attempt {attempt}: the torchrun job did not train its {steps} steps ({why})", flush=True)
    finally:
        args.steps = saved
    if "failed" in run or run["steps_completed"] != steps:
        why = run.get("failed") or f"exit codes {run['codes']}"
        raise SystemExit(f"the calibration run of torchrun failed ({why}); its agents' logs are in {workdir} "
                         "(keep them with --workdir DIR), or give --save-every K")
    lines = [json.loads(x) for x in (workdir / "events.jsonl").read_text().splitlines() if x]
    # a save holds the step for its slowest rank: the longest per save step, their median
    by_step: dict[int, float] = {}
    for e in lines:
        if e["event"] == "saved":
            by_step[e["step"]] = max(by_step.get(e["step"], 0.0), e["seconds"])
    return {"step_seconds": run["step_seconds"], "save_seconds": statistics.median(by_step.values())}


# ---------------------------------------------------------------------------------------------- the simulator's ETTR
def ettr_check(args: argparse.Namespace, views: dict, results: dict, events: list, every: int, steps: dict,
               save: float) -> float:
    """Prints measured against predicted ETTR per run (samples in the first ``--wall`` s over those of the run's
    undisturbed step time); returns the largest relative error."""
    from lightning_bamboo.demo.shape import STANDBY_PROCESSES

    print(f"\nthe simulator's ETTR against these runs (the same events, each run's measured inputs; ETTR = samples in "
          f"the first {args.wall:g} s over {args.wall:g} s at the run's undisturbed step time; the pause of "
          f"{args.step_delay:g} s a step does not scale with the depth; torchrun's restart: the mean of the recoveries "
          "no other kill interrupted)")
    print(f"{'run':<14}{'policy':>9}{'step s':>8}{'failover s':>11}{'restart s':>10}{'reconf s':>9}"
          f"{'measured':>10}{'predicted':>10}{'error':>8}")
    worst = 0.0
    for name, view in views.items():
        if name not in steps:
            continue
        inputs = sim_inputs(name, results[name], every, steps[name], save)
        cap = args.nodes if name == "torchrun" else args.nodes + STANDBY_PROCESSES
        predicted = predict_samples(inputs, events, args.nodes, args.wall, args.step_delay, cap)
        measured = view["samples_per_second"] * args.wall
        clean = args.wall / steps[name] * GLOBAL_BATCH
        error = abs(predicted - measured) / measured if measured else float("inf")
        worst = max(worst, error)
        print(f"{name:<14}{inputs['policy']:>9}{steps[name]:>8.3f}{inputs['failover_seconds']:>11.2f}"
              f"{inputs['restart_seconds']:>10.2f}{inputs['reconfigure_seconds']:>9.2f}{measured / clean:>10.3f}"
              f"{predicted / clean:>10.3f}{error:>8.1%}")
    print(f"largest ETTR error: {worst:.1%} (target <= 15%)")
    return worst


# ---------------------------------------------------------------------------------------------- report
def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def lost_per_preemption(r: dict, steps: int, step_seconds: float) -> float:
    """Seconds the run took beyond its steps at the undisturbed step time, per preemption."""
    return (r["span"] - (steps - 1) * step_seconds) / r["preemptions"] if r["preemptions"] else float("nan")


def demo_view(r: dict) -> dict:
    times = r.get("step_times") or []
    span = times[-1][1] - times[0][1] if len(times) > 1 else 0.0
    intervals = [b[1] - a[1] for a, b in itertools.pairwise(times) if b[0] == a[0] + 1]
    rec = r["recoveries"]
    return {"steps_completed": r["steps_completed"], "samples_per_second": r["samples_per_second"], "span": span,
            "step_seconds": p50(intervals), "preemptions": r["preemptions"],
            "restarts": rec["checkpoint"] + rec["restart"], "failovers": rec["redundant"],
            "recomputed_steps": r["recomputed_steps"], "recovery_seconds": r["recovery_seconds"],
            "joins": r["joins"], "wall": r["wall"], "step_times": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="p3", help="p3, g4dn or the path of a Bamboo trace CSV (default p3)")
    parser.add_argument("--nodes", type=int, default=6, help="the slice's first nodes that start (default 6)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--time-scale", type=float, default=100.0, help="trace seconds per real second (default 100)")
    parser.add_argument("--save-every", type=int, default=0, help="K; default 0: Young/Daly from a calibration run")
    parser.add_argument("--calibration-steps", type=int, default=12)
    parser.add_argument("--max-restarts", type=int, default=100, help="torchrun's --max-restarts per agent")
    parser.add_argument("--last-call", type=int, default=LAST_CALL_SECONDS,
                        help="torchrun's rendezvous last_call_timeout in seconds (default %(default)s; torch's is 30)")
    parser.add_argument("--keep-alive", type=int, default=KEEP_ALIVE_SECONDS,
                        help="torchrun's rendezvous keep_alive_interval in seconds: a lost agent leaves the "
                        "rendezvous after 3 of them (default %(default)s, torch's)")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds any one run may take")
    parser.add_argument("--workdir", default=None, help="keep every run's logs, events and checkpoints here (a new "
                        "directory; default: a temporary one, removed)")
    parser.add_argument("--only", default="abc", help="which runs: any of a, b, c (default abc)")
    parser.add_argument("--wall", type=float, default=0.0,
                        help="equal wall time: compare the samples each run trained in its first WALL seconds from "
                        "its first step, each run given the steps its own undisturbed step time needs for longer "
                        "(default 0: every run trains --steps steps)")
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds every node pauses after each step, in (a), (b) and (c) alike: a step as long as "
                        "a GPU's, whose compute hides a per-step fixed cost (default 0)")
    parser.add_argument("--mtbf", default="",
                        help="instead of --trace: a synthetic trace of the simulator's model whose cluster loses a "
                        "node every MTBF of trace time on average (e.g. 10m), as `lightning-bamboo simulate --sweep "
                        "mtbf=...`; with --wall, the simulator's ETTR is checked against the runs")
    parser.add_argument("--replacement-delay", type=float, default=60.0,
                        help="--mtbf: mean trace seconds until a lost node's replacement joins (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="--mtbf: the synthetic trace's seed")
    parser.add_argument("--from", dest="from_dir", default=None, metavar="DIR",
                        help="run nothing: report again the runs kept in DIR (a run's --workdir)")
    args = parser.parse_args(argv)
    if args.from_dir:
        return report_again(args.from_dir)
    args.run_steps, args.clean_steps, args.save_seconds = {}, {}, 0.0
    nodes = [f"node{i}" for i in range(args.nodes)]
    with exit_on_stop_signals(), contextlib.ExitStack() as stack:
        work = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bamboo-peers-")))
        work.mkdir(parents=True, exist_ok=True)
        if args.mtbf:
            from lightning_bamboo.sim.sweep import mtbf_trace, parse_duration
            from lightning_bamboo.sim.trace import write_trace

            # trace hours: three times the longest a run may be given, at this compression
            hours = max(1.0, 3.0 * max(args.wall, 600.0) * args.time_scale / 3600.0)
            trace = work / "trace.csv"
            write_trace(mtbf_trace(parse_duration(args.mtbf), args.nodes, hours, args.replacement_delay, args.seed), trace)
            print(f"trace: the simulator's model, {args.nodes} nodes, one lost every {args.mtbf} of trace time on "
                  f"average, replaced after {args.replacement_delay:g} s (mean), seed {args.seed}", flush=True)
        else:
            trace = trace_path(args.trace)
        events = slice_events(trace, nodes, args.time_scale)
        length = (f"the samples of the first {args.wall:g} s after each run's first step" if args.wall else
                  f"{args.steps} steps")
        print(f"trace {trace.name}: first {args.nodes} nodes start, {length}, steps of {GLOBAL_BATCH} samples "
              f"(4 micro-batches of 2), one pipeline as deep as the live nodes (at most {args.nodes}), "
              f"1 trace second = {1 / args.time_scale:.4f} s, a pause of {args.step_delay:g} s after each step; "
              f"{os.cpu_count()} CPU cores, gloo", flush=True)
        if args.wall:
            (work / "calibrate").mkdir()
            cal = calibrate(args, work / "calibrate")
            (work / "calibrate-demo").mkdir()
            clean = run_demo("calibrate-demo", args, None, 1000, work / "calibrate-demo", steps=3 * args.calibration_steps)
            if "failed" in clean:
                raise SystemExit(f"the calibration run of the demo failed: {clean['failed']}")
            demo_step = demo_view(clean)["step_seconds"]
            args.run_steps = {"bamboo": steps_for(args.wall, demo_step), "demo-restart": steps_for(args.wall, demo_step),
                              "torchrun": steps_for(args.wall, cal["step_seconds"])}
            args.clean_steps = {"bamboo": demo_step, "torchrun": cal["step_seconds"]}
            args.save_seconds = cal["save_seconds"]
            print(f"undisturbed steps: demo {demo_step:.3f} s, torchrun {cal['step_seconds']:.3f} s; steps given "
                  f"(1.2 x {args.wall:g} s of them): " + ", ".join(f"{k} {v}" for k, v in args.run_steps.items()),
                  flush=True)
        if args.save_every:
            every = args.save_every
            print(f"K = {every} steps (--save-every)", flush=True)
        else:
            if not args.wall:
                (work / "calibrate").mkdir()
                cal = calibrate(args, work / "calibrate")
            horizon = max(e.at_seconds for e in events)  # the whole slice: the trace's own rate of losses
            kills = kills_of_running(events, nodes, args.nodes, horizon)
            mtbf = horizon / kills if kills else float("inf")
            every = min(args.steps, young_daly(cal["save_seconds"], mtbf, cal["step_seconds"]))
            print(f"K = {every} steps: Young/Daly sqrt(2 x save {cal['save_seconds']:.3f} s x MTBF {mtbf:.1f} s) / "
                  f"step {cal['step_seconds']:.3f} s; save and step time from a {args.calibration_steps}-step "
                  f"torchrun run on {args.nodes} nodes saving every 2 steps, MTBF = the slice's {horizon:.0f} s / "
                  f"its {kills} kills of running nodes", flush=True)
        results: dict[str, dict] = {}
        for key, label in (("a", "bamboo"), ("b", "torchrun"), ("c", "demo-restart")):
            if key not in args.only:
                continue
            (work / label).mkdir()
            if key in "ac":
                extra = ("--no-redundancy",) if key == "c" else ()
                steps = args.run_steps.get(label)
                results[label] = run_demo(label, args, trace, every, work / label, *extra, steps=steps)
                if "before their first step" in results[label].get("failed", ""):  # it never started: once more
                    print(f"{label}: the demo's workers failed before their first step; started again. "
                          f"{results[label]['failed']}", flush=True)
                    shutil.rmtree(work / label)
                    (work / label).mkdir()
                    results[label] = run_demo(label, args, trace, every, work / label, *extra, steps=steps)
            else:
                results[label] = PeerRun(args, events, nodes, work / label, every,
                                         steps=args.run_steps.get(label, 0)).run()
                print(f"peer command (per machine): {args.peer_command}", flush=True)
            if "failed" in results[label]:
                print(f"{label} FAILED: {results[label]['failed']}", flush=True)
            else:
                print(f"{label}: done in {results[label]['wall']:.0f} s", flush=True)
        saved = {"args": {k: v for k, v in vars(args).items() if k != "from_dir"}, "trace_file": str(trace),
                 "every": every, "results": results}
        (work / "results.json").write_text(json.dumps(saved, default=str))
        return report(args, results, events, every)


def report_again(directory: str) -> int:
    """The report of the runs whose ``--workdir`` was ``directory`` (its ``results.json``), printed again."""
    path = Path(directory) / "results.json"
    if not path.exists():
        raise SystemExit(f"--from {directory}: no results.json there; it is written by a run with --workdir DIR")
    saved = json.loads(path.read_text())
    args = argparse.Namespace(**saved["args"])
    print(f"the runs of {directory} (their results.json), reported again", flush=True)
    events = slice_events(Path(saved["trace_file"]), [f"node{i}" for i in range(args.nodes)], args.time_scale)
    return report(args, saved["results"], events, saved["every"])


def report(args: argparse.Namespace, results: dict[str, dict], events: list | None = None, every: int = 0) -> int:
    views = {k: (demo_view(v) if k != "torchrun" else v) for k, v in results.items() if "failed" not in v}
    clean = min((v["step_seconds"] for v in views.values() if v["step_seconds"] == v["step_seconds"]), default=float("nan"))
    if args.wall:  # equal wall time: the samples of the first WALL seconds after each run's first step
        for v in views.values():
            v["samples_per_second"] = progress_at(v["step_times"], args.wall) * GLOBAL_BATCH / args.wall
    print(f"\n{'run':<14}{'steps':>6}{'samples/s':>10}{'preempt':>8}{'restarts':>9}{'failovers':>10}{'redone':>7}"
          f"{'p50 rec s':>10}{'max rec s':>10}{'lost s/preempt':>15}{'step s':>8}")
    for name, v in views.items():
        rec = v["recovery_seconds"]
        steps = args.run_steps.get(name, args.steps)
        print(f"{name:<14}{v['steps_completed']:>6}{v['samples_per_second']:>10.2f}{v['preemptions']:>8}"
              f"{v['restarts']:>9}{v.get('failovers', 0):>10}{v['recomputed_steps']:>7}{p50(rec):>10.2f}"
              f"{max(rec, default=float('nan')):>10.2f}{lost_per_preemption(v, steps, v['step_seconds']):>15.2f}"
              f"{v['step_seconds']:>8.3f}")
    if args.wall:
        print(f"(samples/s: the most steps finished {args.wall:g} s after the run's first step x {GLOBAL_BATCH} / "
              f"{args.wall:g} s; steps: all it finished, preemptions included after those {args.wall:g} s)")
    print("(lost s/preempt: (first to last step) - (steps - 1) x the run's own median step, over the preemptions; "
          "restarts to take in joining nodes count in it)")
    peer = views.get("torchrun")
    if peer:
        print("\ntorchrun, each preemption: detection (kill -> the last survivor's worker failed), restart (-> the "
              "job that recovered starts loading its checkpoint), reload, first step, recomputed steps")
        for k in peer["per_kill"]:
            if k["recovery"] is None:
                print(f"  {k['node']} at step {k['progress']}: no job recovered from it")
                continue
            print(f"  {k['node']:<8} at step {k['progress']:>4}: recovery {k['recovery']:6.2f} s = detection "
                  f"{k['detection']:5.2f} + restart {k['restart']:6.2f} + reload {k['reload']:5.2f} + first step "
                  f"{k['first_step']:5.2f}; then {k['redone']} steps redone ({k['redone'] * clean:.2f} s), "
                  f"resumed at step {k['resumed_at']} with optimizer state {'/'.join(k['optimizer'])}")
        print(f"  restarts {peer['restarts']} (joins {peer['joins']}), depths {peer['depths']}, optimizer state "
              f"reset at {peer['optimizer_resets']} (the depth changed); agents that failed on a machine still there "
              f"and were started again: {peer['agent_restarts']}; last exit codes {peer['codes']}")
    for name, v in results.items():
        if "failed" in v:
            print(f"{name}: FAILED ({v['failed'].splitlines()[0]})")
    ok = True
    a, b, c = (views.get(k) for k in ("bamboo", "torchrun", "demo-restart"))
    if a and b:
        ratio = a["samples_per_second"] / b["samples_per_second"] if b["samples_per_second"] else float("inf")
        target = "" if args.mtbf else " (target >= 2x)"
        print(f"\nuseful throughput a/b, bamboo / torchrun + DeepSpeed checkpoints: {ratio:.2f}x{target}")
        ok = ratio >= 2.0
    if a and c:
        print(f"useful throughput a/c, bamboo / demo --no-redundancy: "
              f"{a['samples_per_second'] / c['samples_per_second']:.2f}x")
    if b and c:
        print(f"the emulation against the peer, c/b: {c['samples_per_second'] / b['samples_per_second']:.2f}x")
    if args.wall and args.mtbf and events is not None:  # the simulator's ETTR checked against the runs
        # the target of an --mtbf run is the simulator's (its failure rate is not a slice's)
        ok = ettr_check(args, views, results, events, every, args.clean_steps, args.save_seconds) <= 0.15
    if args.wall:
        own = ", ".join(f"{name} {own_pace_ettr(v['step_times'], args.wall):.3f}" for name, v in views.items()
                        if v.get("step_times"))
        print(f"ETTR at each run's own pace (the steps of its first {args.wall:g} s x its own median step / "
              f"{args.wall:g} s: the share of the time it trained at its pace; on {os.cpu_count()} shared cores a clean "
              f"run's step depends on how many processes run, and a lost node speeds the others up): {own}")
    unfinished = [] if args.wall else [name for name, v in views.items() if v["steps_completed"] < args.steps]
    if unfinished:
        print(f"did not train all their steps: {', '.join(unfinished)}")
    failed = any("failed" in v for v in results.values()) or bool(unfinished)
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
