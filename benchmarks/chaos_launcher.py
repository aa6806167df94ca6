"""Chaos on the main path: the launcher a user runs, one supervisor per emulated machine, a user's Lightning script.

Machines are network namespaces (``lightning_bamboo/testing/netns.py``: an address and a host name of their own on one bridge, etcd on
an address of its own). Three machines of two workers start the job (``--workers 2 --min-nodes 6``) of
``benchmarks/spot_user.py`` (``examples/gpt.py``'s model, lazy replicas, ``RebalanceCallback``, ``AsyncCheckpoint``,
``PreemptionCallback``): one pipeline of six stages, or with ``--pipelines 2`` two of three. Spare machines join
with ``--join``. For every seed a schedule of ``--changes`` membership changes is drawn and fired at the steps it
names, each on a target picked then from what runs:

- ``kill_worker``: SIGKILL a training worker; ``kill_machine``: SIGKILL every process of a machine (its supervisor
  too); ``partition``: cut a machine off the network (its processes run on; it is killed when the job has ended);
  ``notice``: SIGTERM to a training worker (a spot notice); ``join``: start a spare machine's supervisor;
  ``kill_pair``: a worker and its replica holder at once (the checkpoint's case); ``in_failover`` /
  ``in_reconfiguration``: a worker armed at the start (``BAMBOO_FAIL_AT``) dies inside the first failover or
  reconfiguration it takes part in (a loss inside a recovery).

A change that would leave fewer than three live workers becomes a join of a spare machine (skipped when none is
left). Every run is judged against a clean run of the same steps (``python -m lightning_bamboo.launcher --nodes 6``;
weights do not depend on where the nodes run):

- the job finished, and every supervisor of a machine that was neither killed nor cut off exited 0;
- its final weights (``consolidate_checkpoint``) equal the clean run's bit for bit with one pipeline, and its AdamW
  state too; with two, they are within the noise floor measured in the same call: the larger difference from the
  clean run of the same global batch trained by one pipeline of three stages (every gradient summed in the other
  grouping) and of the clean job with one weight one ulp higher at the start, the attention's key biases left out
  of both (see ``without_key_biases``; their difference is printed apart);
- every step trained on the clean run's samples (each record's batch digest equals the clean run's for its step).

    python benchmarks/chaos_launcher.py [--pipelines 1|2] [--seeds 5] [--changes 20] [--steps 300] [--first-seed 0]
    python benchmarks/chaos_launcher.py --scenario machines --pipelines 2   # issue 61's: kill 60, join 100, cut 180
    python benchmarks/chaos_launcher.py --scenario machines --secure        # the same against etcd as deployed

``--secure``: etcd as it is deployed (TLS only, client certificates its CA signed, authentication on), and every
supervisor connects as an etcd user whose role may touch only the job's prefix (``/bamboo/chaos/``), its password
from ``$ETCDCTL_PASSWORD``; certificates and passwords are made for the run.

Prints one line per run and a table; exits 1 if any run fails its judgement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import HOST_VARIABLES, launcher_command, launcher_env  # noqa: E402  (benchmarks/: the script's folder)

from lightning_bamboo import checkpoint as ckpt  # noqa: E402
from lightning_bamboo import consolidate_checkpoint  # noqa: E402
from lightning_bamboo.membership.credentials import PASSWORD_ENV  # noqa: E402
from lightning_bamboo.runtime.config import DEFAULT_DETECTION_SECONDS  # noqa: E402
from lightning_bamboo.testing.chaos import (  # noqa: E402
    IDLE_SECONDS,
    idle_spells,
    max_difference,
    optimizer_states,
    start_ups,
)
from lightning_bamboo.testing.job_output import run_in_group  # noqa: E402

PYTHON = sys.executable
WORKERS = 2  # workers per machine
MACHINES = 3  # machines the job starts with
SPARES = 8  # spare machines that can join
PRELOAD = "torch,deepspeed,lightning.pytorch,lightning_bamboo.strategy"
KINDS = ("kill_worker", "kill_machine", "partition", "notice", "join", "kill_pair", "in_failover",
         "in_reconfiguration")
#: seconds a run may take before it is stopped and judged as not finished
RUN_LIMIT = 1500.0


@dataclass(frozen=True)
class Change:
    step: int
    kind: str


def draw(seed: int, changes: int, steps: int) -> list[Change]:
    """A seeded schedule: ``changes`` changes at distinct steps spread over the run (none in its last tenth)."""
    rng = random.Random(seed)
    weights = {"kill_worker": 3, "kill_machine": 2, "partition": 1, "notice": 2, "join": 4, "kill_pair": 1,
               "in_failover": 1, "in_reconfiguration": 1}
    at = sorted(rng.sample(range(5, int(steps * 0.9)), changes))
    kinds = rng.choices(list(weights), weights=list(weights.values()), k=changes)
    return [Change(step, kind) for step, kind in zip(at, kinds, strict=True)]


SCENARIOS = {"machines": [Change(60, "kill_machine:host1"), Change(100, "join"), Change(180, "partition:host2")]}


@dataclass
class Run:
    """One job on the namespaces of ``net``: its machines, what happened to them, and what it left in ``out``."""

    net: Any
    url: str
    out: Path
    stages: int
    steps: int
    armed: list[str] = field(default_factory=list)
    #: the user's script's ``BambooStrategy(detection_timeout=...)`` (its default unless ``--detection-timeout``)
    detection_timeout: float = DEFAULT_DETECTION_SECONDS
    #: with ``--secure``: the launcher's store options (CA, client certificate, user) and the user's password
    secure: tuple[list[str], str] | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)
    cut: set[str] = field(default_factory=set)
    events: list[str] = field(default_factory=list)
    #: when each change took effect (wall clock): a machine's join, its kill or cut, a worker signalled
    joined_at: dict[str, float] = field(default_factory=dict)
    down_at: dict[str, float] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        extra = {"PYTHONUNBUFFERED": "1", "BAMBOO_PRELOAD": PRELOAD}
        if self.secure is not None:
            extra[PASSWORD_ENV] = self.secure[1]
        return launcher_env(kills=self.armed, once_dir=self.out / "fired", extra=extra,
                            unset=(*HOST_VARIABLES, "BAMBOO_FORK_SERVER"))

    def start(self, machine: str, join: bool = False) -> None:
        user = [PYTHON, str(REPO / "benchmarks" / "spot_user.py"), "--stages", str(self.stages), "--steps",
                str(self.steps), "--out", str(self.out), "--detection-timeout", str(self.detection_timeout)]
        cmd = launcher_command(user, node=machine, store=self.url, job="chaos", workers=WORKERS, join=join,
                               min_nodes=None if join else MACHINES * WORKERS, addr=self.net.addrs[machine],
                               pid_dir=self.out / "pids", options=self.secure[0] if self.secure is not None else ())
        with open(self.out / f"{machine}.log", "w") as log:
            self.procs[machine] = self.net.popen(machine, cmd, env=self.env(), cwd=REPO, stdout=log,
                                                 stderr=subprocess.STDOUT)

    # ------------------------------------------------------------------ what runs
    def latest(self) -> dict[str, Any] | None:
        records = step_records(self.out)
        return max(records, key=lambda r: (r["step"], len(r["nodes"]))) if records else None

    def progress(self) -> int:
        latest = self.latest()
        return latest["step"] if latest else -1

    def alive(self) -> list[str]:
        """Machines still up and connected (their supervisor runs)."""
        return [m for m, p in self.procs.items() if m not in self.killed | self.cut and p.poll() is None]

    def training(self) -> list[str]:
        latest = self.latest()
        up = set(self.alive())
        return [n for n in (latest["nodes"] if latest else []) if n.split(".")[0] in up]

    def pid(self, node: str) -> int | None:
        try:
            return int((self.out / "pids" / f"{node}.pid").read_text())
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ changes
    def workers(self) -> list[str]:
        """Workers running on machines that are up: a worker's pid file is there while it runs (``--pid-dir``)."""
        up = set(self.alive())
        return [p.stem for p in (self.out / "pids").glob("*.pid") if p.stem.split(".")[0] in up]

    def fire(self, change: Change, rng: random.Random, spares: list[str]) -> None:
        kind, _, target = change.kind.partition(":")
        training, workers = self.training(), self.workers()
        # what the change would take: at least one training node must survive it (the job restarts from it) and
        # three workers in all (else the change becomes a join)
        takes = {"kill_worker": (1, 1), "notice": (1, 1), "kill_pair": (2, 2), "kill_machine": (WORKERS, WORKERS),
                 "partition": (WORKERS, WORKERS)}.get(kind, (0, 0))
        if kind in ("kill_machine", "partition") and not target and training:
            target = rng.choice(sorted({n.split(".")[0] for n in training}))
        if kind in ("kill_machine", "partition") and target:
            on = [n for n in training if n.split(".")[0] == target]
            takes = (len(on), len([n for n in workers if n.split(".")[0] == target]))
        if len(training) - takes[0] < 1 or len(workers) - takes[1] < 3 or (takes[0] and not training):
            self.events.append(f"step {self.progress()}: {kind} held back ({len(training)} training, {len(workers)} "
                               f"workers up): a join instead")
            kind = "join"
        step = self.progress()
        if kind == "join":
            if not spares:
                self.events.append(f"step {step}: no spare machine left to join; skipped")
                return
            machine = spares.pop(0)
            self.start(machine, join=True)
            self.joined_at[machine] = time.time()
            self.events.append(f"step {step}: {machine} joins")
        elif kind in ("kill_machine", "partition"):
            machine = target
            self.down_at[machine] = time.time()
            if kind == "kill_machine":
                self.net.kill_machine(machine)
                self.killed.add(machine)
            else:
                self.net.partition(machine)
                self.cut.add(machine)
            self.events.append(f"step {step}: {machine} {'killed' if kind == 'kill_machine' else 'cut off'}")
        elif kind == "kill_pair":
            latest = self.latest()
            assert latest is not None
            nodes, stages = latest["nodes"], latest["stages"]
            pipelines = len(nodes) // stages
            rank = rng.randrange(len(nodes))
            stage, pipeline = rank // pipelines, rank % pipelines
            holder = nodes[((stage - 1) % stages) * pipelines + pipeline]
            pair = [nodes[rank], holder]
            self._signal(pair, signal.SIGKILL)
            self.events.append(f"step {step}: {pair[0]} and its replica holder {pair[1]} SIGKILLed")
        else:
            node = rng.choice(self.training())
            self._signal([node], signal.SIGTERM if kind == "notice" else signal.SIGKILL)
            self.events.append(f"step {step}: {node} {'notice (SIGTERM)' if kind == 'notice' else 'SIGKILLed'}")

    def _signal(self, nodes: list[str], sig: int) -> None:
        for node in nodes:
            self.down_at[node] = time.time()  # gone (a kill) or leaving (a notice): not idle from here
            pid = self.pid(node)
            if pid is not None:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ the end
    def wait(self, limit: float) -> bool:
        """Wait for every machine's supervisor that is neither killed nor cut off; True if all ended in time."""
        deadline = time.monotonic() + limit
        for machine, proc in self.procs.items():
            if machine in self.killed | self.cut:
                continue
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True


def run_job(root: Path, name: str, stages: int, steps: int, schedule: list[Change], seed: int,
            secure: bool = False, detection_timeout: float = DEFAULT_DETECTION_SECONDS) -> dict[str, Any]:
    """One chaos run on fresh namespaces (``secure``: against etcd with TLS and authentication); what the judge needs
    of it."""
    from lightning_bamboo.testing.netns import NetnsCluster

    out = root / name
    (out / "fired").mkdir(parents=True)
    rng = random.Random(seed * 7919 + 1)
    machines = [f"host{i}" for i in range(MACHINES)]
    spares = [f"host{i}" for i in range(MACHINES, MACHINES + SPARES)]
    initial = [f"{m}.{w}" for m in machines for w in range(WORKERS)]
    # one worker armed for each kind of recovery at most: every armed item fires in the first recovery of its kind
    # its node takes part in, so several would be one loss of several nodes at once (a whole pipeline gone in one
    # failover); a later one of the same kind is a drawn kill instead
    armed: list[str] = []
    pending: list[Change] = []
    free = rng.sample(initial, len(initial))
    for change in schedule:
        if change.kind in ("in_failover", "in_reconfiguration"):
            point = "failover" if change.kind == "in_failover" else "reconfigure"
            if not any(item.endswith("@" + point) for item in armed):
                armed.append(f"{free.pop()}@{point}")
                continue
            change = Change(change.step, "kill_worker")
        pending.append(change)
    started = time.monotonic()
    with NetnsCluster(machines + spares) as net:
        if secure:
            url, options, password = secured_etcd(net, out / "pki")
            job = Run(net, url, out, stages, steps, armed=armed, secure=(options, password),
                      detection_timeout=detection_timeout)
        else:
            job = Run(net, net.start_etcd(), out, stages, steps, armed=armed, detection_timeout=detection_timeout)
        job.events += [f"armed: {item}" for item in armed]
        for machine in machines:
            job.start(machine)
        while pending and time.monotonic() - started < RUN_LIMIT:
            if job.progress() >= pending[0].step:
                job.fire(pending.pop(0), rng, spares)
            elif not job.alive():
                break
            else:
                time.sleep(0.2)  # polls the workers' step files; the run's own pace decides
        ended = job.wait(max(1.0, RUN_LIMIT - (time.monotonic() - started)))
        codes = {m: p.poll() for m, p in job.procs.items()}
    return {"name": name, "ended": ended, "codes": codes, "killed": sorted(job.killed), "cut": sorted(job.cut),
            "events": job.events, "records": step_records(out), "final": out / "final",
            "seconds": time.monotonic() - started, "joined_at": job.joined_at, "down_at": job.down_at,
            "started_at": worker_starts(out),
            "fired": sorted(path.name for path in (out / "fired").iterdir())}


def secured_etcd(net: Any, pki: Path) -> tuple[str, list[str], str]:
    """etcd as it is deployed, in ``net``'s etcd namespace: TLS with client certificates (a PKI made in ``pki`` for
    its address) and authentication, a ``trainer`` user whose role may read and write only the job's prefix. Returns
    its URL, the launcher's options for it (CA, client certificate, user) and the trainer's password."""
    import secrets

    from lightning_bamboo.testing.etcd_server import Certificates
    from lightning_bamboo.testing.netns import ETCD

    tls = Certificates.make(pki, ips=[net.addrs[ETCD]])
    url = net.start_etcd(tls=tls)
    password = secrets.token_hex(12)
    net.enable_auth(secrets.token_hex(12), {"trainer": (password, [("READWRITE", "/bamboo/chaos/")])})
    pem, key = tls.pair("client")
    return url, ["--cacert", str(tls.ca), "--cert", str(pem), "--key", str(key), "--user", "trainer"], password


def clean_run(root: Path, name: str, nodes: int, stages: int, steps: int, batch: int = 16,
              nudge: bool = False) -> dict[str, Any]:
    """The job without changes, on this machine (``--nodes``): its final checkpoint and its step records."""
    out = root / name
    out.mkdir(parents=True)
    env = launcher_env(extra={"PYTHONUNBUFFERED": "1", "BAMBOO_PRELOAD": PRELOAD})
    cmd = launcher_command([PYTHON, str(REPO / "benchmarks" / "spot_user.py"), "--stages", str(stages), "--steps",
                            str(steps), "--out", str(out), "--batch-size", str(batch), *(["--nudge"] if nudge else [])],
                           nodes=nodes)
    # in a process group of its own, killed at the end: a run stopped meanwhile leaves none of its processes behind
    done = run_in_group(cmd, RUN_LIMIT, env=env, cwd=REPO)
    (out / "launcher.log").write_text(done.stdout)
    code = done.returncode
    if code != 0:
        raise SystemExit(f"the clean run {name} failed (exit {code}); see {out / 'launcher.log'}")
    return {"final": out / "final", "records": step_records(out)}


def worker_starts(out: Path) -> dict[str, float]:
    """When each worker's script first started (``benchmarks/spot_user.py``'s ``started-<node>.txt``), by node."""
    return {path.stem[len("started-"):]: min(float(line) for line in path.read_text().split())
            for path in out.glob("started-*.txt") if path.read_text().split()}


def step_records(out: Path) -> list[dict[str, Any]]:
    """Every worker's step records (``benchmarks/spot_user.py``), each with its ``node``."""
    found = []
    for path in out.glob("steps-*.jsonl"):
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # (a line being written is skipped until it is whole)
                found.append({**json.loads(line), "node": path.stem[len("steps-"):]})
    return found


def without_key_biases(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` less the attention's key biases (the middle third of every ``qkv.bias``). Adding a constant to
    every key leaves the attention's softmax unchanged, so their gradient is zero but for rounding, which AdamW
    divides by its own size into steps of the learning rate: across pipeline regroupings they walk at random by
    about ``lr * sqrt(steps)``, dwarfing every other weight's difference (1e-6 here) without changing what the
    model computes. Several-pipeline runs are judged on the rest."""
    out = dict(weights)
    for name, value in weights.items():
        if name.endswith("qkv.bias"):
            third = value.numel() // 3
            out[name] = torch.cat([value[:third], value[2 * third:]])
    return out


def judge(run: dict[str, Any], clean: dict[str, Any], steps: int, floor: float) -> list[str]:
    problems = []
    if not run["ended"]:
        problems.append("a supervisor of a machine that was neither killed nor cut off did not end in time")
    down = set(run["killed"]) | set(run["cut"])
    bad = {m: c for m, c in run["codes"].items() if m not in down and c != 0}
    if bad:
        problems.append(f"supervisors exited with {bad}")
    if not (run["final"] / ckpt.META).exists():
        problems.append("no final checkpoint: the job did not finish")
        return problems
    final, reference = consolidate_checkpoint(run["final"]), consolidate_checkpoint(clean["final"])
    run["all_weights_difference"] = max_difference(final, reference)
    if floor > 0.0:
        final, reference = without_key_biases(final), without_key_biases(reference)
    weights = max_difference(final, reference)
    state = max_difference(optimizer_states(run["final"]), optimizer_states(clean["final"]))
    run["weights_difference"], run["optimizer_difference"] = weights, state
    if (floor == 0.0 and (weights != 0.0 or state != 0.0)) or weights > floor:
        problems.append(f"weights differ by {weights:.3g} (optimizer state by {state:.3g}); bound {floor:.3g}")
    expected = {r["step"]: r["batch"] for r in clean["records"]}
    wrong = sorted({r["step"] for r in run["records"] if expected.get(r["step"]) != r["batch"]})
    missing = sorted(set(range(steps)) - {r["step"] for r in run["records"]})
    if wrong or missing:
        problems.append(f"steps on other samples than the clean run's: {wrong[:10]}; steps never trained: "
                        f"{missing[:10]}")
    return problems


def most_pipelines(run: dict[str, Any]) -> int:
    """The most pipelines the job of ``run`` trained with at any step (its step records)."""
    return max((len(r["nodes"]) // max(int(r["stages"]), 1) for r in run["records"]), default=1)


def measured_floor(root: Path, clean: dict[str, Any], name: str, nodes: int, stages: int, steps: int,
                   batch: int) -> float:
    """The noise floor of a regrouping: the larger difference from ``clean`` of the same global batch trained as
    ``nodes`` nodes of ``stages`` stages (``batch`` a pipeline), and of the clean job with one weight one ulp higher
    at the start; the attention's key biases left out (``without_key_biases``)."""
    other = clean_run(root, f"clean-{name}", nodes, stages, steps, batch=batch)
    ulp = clean_run(root, f"clean-{name}-one-ulp", MACHINES * WORKERS, stages, steps, nudge=True)
    weights = without_key_biases(consolidate_checkpoint(clean["final"]))
    floors = [max_difference(without_key_biases(consolidate_checkpoint(r["final"])), weights) for r in (other, ulp)]
    print(f"noise floor {max(floors):.3g} (the clean run against {nodes // stages} pipeline(s) of {stages}: "
          f"{floors[0]:.3g}; against itself with one weight one ulp higher: {floors[1]:.3g})", flush=True)
    return max(floors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipelines", type=int, choices=(1, 2), default=1)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--changes", type=int, default=20)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=None,
                   help="a fixed schedule instead of drawn ones (run --seeds times)")
    p.add_argument("--keep", default=None, help="keep every run's files in this directory")
    p.add_argument("--detection-timeout", type=float, default=DEFAULT_DETECTION_SECONDS,
                   help="the user's script's BambooStrategy(detection_timeout=...): the most seconds a survivor "
                        "needs to learn of a machine lost without a word (default %(default)s, the strategy's)")
    p.add_argument("--secure", action="store_true",
                   help="etcd with TLS, client certificates and authentication; the job runs as a user fenced to "
                        "its prefix")
    args = p.parse_args(argv)
    # a stopped run still removes its namespaces and processes (the cluster's context manager)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    stages = MACHINES * WORKERS // args.pipelines
    root = Path(args.keep or tempfile.mkdtemp(prefix="bamboo-chaos-launcher-"))
    root.mkdir(parents=True, exist_ok=True)
    clean = clean_run(root, "clean", MACHINES * WORKERS, stages, args.steps)
    floor = 0.0
    if args.pipelines > 1:
        # the same global batch (2 x 16) trained by one pipeline (every gradient regrouped), and the clean job with
        # one weight one ulp higher at the start: the larger difference from the clean run is the floor
        floor = measured_floor(root, clean, "one-pipeline", stages, stages, args.steps, batch=16 * args.pipelines)
    failed, grown_floor = 0, None
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        schedule = SCENARIOS[args.scenario] if args.scenario else draw(seed, args.changes, args.steps)
        run = run_job(root, f"seed{seed}", stages, args.steps, schedule, seed, secure=args.secure,
                      detection_timeout=args.detection_timeout)
        bound = floor
        if floor == 0.0 and most_pipelines(run) > 1:
            # joins grew the job to two pipelines (growth past the start): its gradients were summed in another
            # grouping from then on, so it is judged as several pipelines are, against a floor measured for it
            if grown_floor is None:
                grown_floor = measured_floor(root, clean, "grown", MACHINES * WORKERS * 2, stages, args.steps,
                                             batch=16 // 2)
            bound = grown_floor
            print(f"seed {seed} grew to {most_pipelines(run)} pipelines: judged against the floor {bound:.3g}",
                  flush=True)
        problems = judge(run, clean, args.steps, bound)
        failed += bool(problems)
        print(f"seed {seed}: {'FAILED' if problems else 'ok'} in {run['seconds']:.0f} s; weights "
              f"{run.get('weights_difference', float('nan')):.3g} (with the key biases "
              f"{run.get('all_weights_difference', float('nan')):.3g}), optimizer "
              f"{run.get('optimizer_difference', float('nan')):.3g}; codes {run['codes']}", flush=True)
        for event in run["events"]:
            print(f"    {event}")
        spells = idle_spells(run)
        print(f"    live workers idle over {IDLE_SECONDS:g} s: " + (", ".join(
            f"{node} {seconds:.1f} s {where}" for seconds, node, where in spells) or "none"), flush=True)
        longest = idle_spells(run, longer_than=0.0)[:1]
        print("    the longest spell of a live worker without a step: " + (
            "; ".join(f"{seconds:.2f} s, {node} {where}" for seconds, node, where in longest) or "none"), flush=True)
        starts = start_ups(run)
        if starts:
            print("    a joined machine's workers: from its supervisor's start to their script's start (not live "
                  "before), then to their first step: " + ", ".join(
                      f"{node} {to_start:.1f} s + {'never' if to_step is None else f'{to_step:.1f} s'}"
                      for node, to_start, to_step in starts), flush=True)
        for problem in problems:
            print(f"    PROBLEM: {problem}", flush=True)
    runs = args.seeds
    if args.keep is None and not failed:  # nothing to look into: the runs' files (tens of MB) go
        shutil.rmtree(root, ignore_errors=True)
    print(f"\npipelines {args.pipelines} ({stages} stages), {runs} runs of {args.steps} steps, "
          f"{'scenario ' + args.scenario if args.scenario else f'{args.changes} changes each'}"
          f"{', etcd with TLS, client certificates and authentication' if args.secure else ''}: {failed} failed; "
          + (f"files in {root}" if root.exists() else "files removed (--keep DIR keeps them)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
