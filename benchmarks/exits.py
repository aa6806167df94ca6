"""How a job ends (issue 41): every node's exit code, the launcher's status, and every process's end after the last step.

The job is ``tests/scripts/slow_mlp.py`` (an 11-layer MLP under ``BambooStrategy``, each step slowed to
``--sleep`` seconds; each worker prints a JSON line per step and one when it leaves ``main``). The matrix:

* local launcher (``python -m lightning_bamboo.launcher --nodes N``): N in ``--nodes``, one pipeline of N
  stages, every redundancy of ``--modes``, clean and with ``node1`` SIGKILLed at the start of step
  ``steps // 2`` (``BAMBOO_FAIL_AT``);
* a cluster of network namespaces (``lightning_bamboo/testing/netns.py``, needs root; ``--no-netns`` skips it): 2 machines of 2
  workers (one supervisor ``--node M --workers 2`` per machine, etcd on an address of its own) as one pipeline
  of 4 stages, lazy, clean and with every process of machine ``m1`` SIGKILLed once ``m1.0`` reported step
  ``steps // 2``.

A case is judged on what the job did. It finished if a worker left ``fit`` after the last step; then every
node exits 0 but a killed one (-9), and the launcher's status is 0 (each surviving machine's supervisor's
on the cluster). A job that failed (``redundancy=off`` has no replica to fail over from) must end with a
non-zero status; a clean job, or a killed one with a replica, that fails is wrong. Every process the case
started (workers, their communication processes, the launchers) must have ended within ``BOUND`` seconds
of the last step's end (the bound of a hang, not a speed target). A machine's supervisor reports one code
for its workers (0 if every one exited 0, else the first other), so a cluster's node codes are its
supervisor's (and -9 for the killed machine's workers).

Each case runs in a process group of its own with a timeout; the group is SIGKILLed at its end, whatever
happened (a cluster case runs in a child process that removes its namespaces; namespaces a killed child
left are removed by ``lightning_bamboo.testing.netns.sweep_stale``). Prints a table, the output's end of each wrong case,
which cases missed the bound, and exits 1 if any case is wrong.

    python benchmarks/exits.py [--nodes 2,3,4,6] [--modes off,lazy,eager] [--steps 10] [--sleep 0.3]
                               [--no-netns] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from common import HOST_VARIABLES, add_worker_flag, launcher_command, launcher_env, self_command  # noqa: E402

from lightning_bamboo.testing.job_output import json_reports, launcher_exit_codes, run_in_group  # noqa: E402

PYTHON = sys.executable

JOB = [PYTHON, str(REPO / "tests" / "scripts" / "slow_mlp.py")]
#: seconds from the last step's end to the end of every process of a finished job (issue 41's acceptance)
BOUND = 15.0
#: seconds a case may run before its process group is killed (6 nodes start in about a minute on 2 busy cores)
CASE_TIMEOUT = 400.0
#: the cluster's machines and workers per machine
MACHINES, WORKERS = ("m0", "m1"), 2
#: BambooStrategy(detection_timeout) on the cluster: a killed machine's peers learn of it when its lease ends (its
#: supervisor died with it); shorter leases end spuriously when heartbeats starve on 2 oversubscribed cores
DETECTION = 15.0
RESULT = "exits-case-result: "
#: an exception's line in a traceback: its (qualified) name and message
ERROR = re.compile(r"([\w.]*(?:Error|Exception|Loss|Fenced)): (.*)")


@dataclass(frozen=True)
class Case:
    """One cell: ``nodes`` workers, ``mode`` of redundancy, ``kill`` one node (a machine on the cluster)."""

    where: str  # "local" or "netns"
    nodes: int
    mode: str
    kill: bool

    def __str__(self) -> str:
        shape = f"{self.nodes} nodes" if self.where == "local" else f"{len(MACHINES)}x{WORKERS} workers"
        return f"{self.where} {shape} {self.mode} {'kill' if self.kill else 'clean'}"


@dataclass
class Outcome:
    """What a case printed and what is wrong with it. Seconds are after the last step's end."""

    case: str
    codes: dict[str, int | None]
    statuses: dict[str, int | None]
    steps: int
    finished: bool
    node_ends: dict[str, float] = field(default_factory=dict)
    end: float | None = None
    wrong: list[str] = field(default_factory=list)
    why: str = ""  # a job that failed: the last error it printed
    tail: str = ""


class Followed:
    """Processes in sessions of their own, read as they print; when each reporting worker and each session ended."""

    def __init__(self, procs: Mapping[str, subprocess.Popen[str]],
                 on_report: Callable[[str, dict], None] | None = None) -> None:
        self.procs, self.on_report = dict(procs), on_report
        self.output = {name: [] for name in procs}
        self.pids: set[int] = set()
        self.pid_ends: dict[int, float] = {}
        self.group_ends: dict[str, float] = {}
        self.lock = threading.Lock()
        self.readers = [threading.Thread(target=self._read, args=(name,), daemon=True) for name in procs]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str) -> None:
        stream = self.procs[name].stdout
        assert stream is not None
        for line in stream:
            reports = json_reports(line)
            with self.lock:
                self.output[name].append(line)
                self.pids.update(r["pid"] for r in reports)
            for report in reports:
                if self.on_report is not None:
                    self.on_report(name, report)

    def wait(self, timeout: float) -> bool:
        """Until every session is empty; False if ``timeout`` passed first (every session is killed either way)."""
        deadline = time.monotonic() + timeout
        try:
            while len(self.group_ends) < len(self.procs):
                now, table = time.time(), _process_table()
                with self.lock:
                    for pid in self.pids - set(self.pid_ends):
                        if pid not in table:
                            self.pid_ends[pid] = now
                for name, proc in self.procs.items():
                    if name not in self.group_ends and proc.poll() is not None \
                            and not any(group == proc.pid for group in table.values()):
                        self.group_ends[name] = now
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
            return True
        finally:
            for proc in self.procs.values():
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            for reader in self.readers:
                reader.join(10)

    def text(self, name: str) -> str:
        with self.lock:
            return "".join(self.output[name])


def _process_table() -> dict[int, int]:
    """Every live (not zombie) process's id and its process group."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                state, _, group = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:3]
            except (OSError, IndexError, ValueError):
                continue
            if state != "Z":
                table[int(entry)] = int(group)
    return table


def job_args(case: Case, steps: int, sleep: float) -> list[str]:
    return [*JOB, "--stages", str(case.nodes), "--steps", str(steps), "--sleep", str(sleep), "--redundancy", case.mode]


def child_env(kills: list[str] | None = None) -> dict[str, str]:
    """A case's environment (unbuffered: its lines are read as they come), the faults of ``kills`` armed."""
    return launcher_env(kills=kills or (), extra={"PYTHONUNBUFFERED": "1"})


def judge(case: Case, output: str, followed: Followed, codes: dict[str, int | None], statuses: dict[str, int | None],
          killed_nodes: set[str], killed_statuses: set[str], steps: int, timed_out: bool) -> Outcome:
    """The case's outcome: the job finished or not, the codes and statuses it should have had, its processes' end."""
    reports = json_reports(output)
    finished_nodes = {r["node"] for r in reports if r.get("global_step") == steps}
    outcome = Outcome(str(case), codes, statuses, max((r.get("step", 0) for r in reports), default=0),
                      bool(finished_nodes), tail="\n".join(output.splitlines()[-40:]))
    if not outcome.finished:
        errors = ERROR.findall(output)
        outcome.why = f"{errors[-1][0].rsplit('.', 1)[-1]}: {errors[-1][1]}" if errors else ""
    if timed_out:
        outcome.wrong.append(f"did not end within {CASE_TIMEOUT:g} s (killed)")
    for node, code in codes.items():
        want = -signal.SIGKILL if node in killed_nodes and node not in finished_nodes else 0
        if outcome.finished and code != want:
            outcome.wrong.append(f"{node} exited {code}, not {want}")
    for name, status in statuses.items():
        if name in killed_statuses:
            ok, want_text = status == -signal.SIGKILL, "-9 (killed)"
        else:
            ok = status == 0 if outcome.finished else status not in (0, None)
            want_text = "0 (the job finished)" if outcome.finished else "non-zero (the job failed)"
        if not ok:
            outcome.wrong.append(f"{name}'s status is {status}, not {want_text}")
    if not outcome.finished and (not case.kill or case.mode != "off"):
        outcome.wrong.append("the job failed" + (" with a replica to fail over from" if case.kill else ""))
    last_steps = [r["last_step"] for r in reports if "last_step" in r]
    if outcome.finished and last_steps:
        last = max(last_steps)
        latest = {r["node"]: r["pid"] for r in reports}  # each node's last process
        outcome.node_ends = {node: round(followed.pid_ends[pid] - last, 1) for node, pid in sorted(latest.items())
                             if pid in followed.pid_ends and followed.pid_ends[pid] > last}
        if len(followed.group_ends) == len(followed.procs):
            outcome.end = round(max(followed.group_ends.values()) - last, 1)
    return outcome


def run_local(case: Case, steps: int, sleep: float) -> Outcome:
    victim = "node1"
    env = child_env([f"{victim}@{steps // 2}"] if case.kill else None)
    proc = subprocess.Popen(launcher_command(job_args(case, steps, sleep), nodes=case.nodes), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    followed = Followed({"launcher": proc})
    timed_out = not followed.wait(CASE_TIMEOUT)
    output = followed.text("launcher")
    codes: dict[str, int | None] = {f"node{i}": None for i in range(case.nodes)}
    codes.update(launcher_exit_codes(output))
    return judge(case, output, followed, codes, {"launcher": proc.returncode}, {victim} if case.kill else set(), set(),
                 steps, timed_out)


def run_netns(case: Case, steps: int, sleep: float) -> Outcome:
    """The cluster case, in a child process of its own (its namespaces go with it)."""
    from lightning_bamboo.testing.netns import sweep_stale

    cmd = self_command(__file__, "netns-case", "--modes", case.mode, "--steps", steps, "--sleep", sleep)
    if case.kill:
        cmd.append("--kill")
    try:
        proc = run_in_group(cmd, timeout=CASE_TIMEOUT + 60, env=child_env(), cwd=REPO)
    except subprocess.TimeoutExpired as err:  # timed out: its group was killed
        sweep_stale()
        return Outcome(str(case), {}, {}, 0, False, wrong=[f"did not end within {CASE_TIMEOUT + 60:g} s"],
                       tail=(err.output or '')[-4000:])
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return Outcome(**json.loads(line.removeprefix(RESULT)))
    return Outcome(str(case), {}, {}, 0, False, wrong=[f"the cluster case exited {proc.returncode} without a result"],
                   tail="\n".join(proc.stdout.splitlines()[-40:]))


def machine_env() -> dict[str, str]:
    """A machine's launcher environment: its workers are forks of one interpreter that imported torch, DeepSpeed and
    Lightning (``--preload``: these machines have no GPU); the interface and the address are the launcher's to find."""
    from lightning_bamboo.launcher import PRELOAD_ENV

    preload = "torch,deepspeed,lightning.pytorch,lightning_bamboo.strategy"
    return launcher_env(extra={"PYTHONUNBUFFERED": "1", PRELOAD_ENV: preload}, unset=HOST_VARIABLES)


def netns_case(mode: str, kill: bool, steps: int, sleep: float) -> Outcome:
    """2 machines of 2 workers on network namespaces, one supervisor each; ``kill``: every process of m1 once m1.0
    reported step ``steps // 2``."""
    from lightning_bamboo.testing.netns import NetnsCluster

    case, victim = Case("netns", len(MACHINES) * WORKERS, mode, kill), MACHINES[-1]
    with NetnsCluster(MACHINES) as net:
        url = net.start_etcd()
        procs = {machine: net.popen(machine, launcher_command(
            [*job_args(case, steps, sleep), "--detection-timeout", str(DETECTION)], node=machine, store=url,
            job="exits", workers=WORKERS, peers=MACHINES, addr=net.addrs[machine]),
            env=machine_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True) for machine in MACHINES}
        killed = threading.Event()

        def on_report(machine: str, report: dict) -> None:  # on the victim's reader thread
            if kill and not killed.is_set() and report.get("node") == f"{victim}.0" and report.get("step", 0) >= steps // 2:
                killed.set()
                net.kill_machine(victim)

        followed = Followed(procs, on_report)
        timed_out = not followed.wait(CASE_TIMEOUT)
    outputs = {machine: followed.text(machine) for machine in MACHINES}
    statuses: dict[str, int | None] = {m: p.returncode for m, p in procs.items()}
    codes: dict[str, int | None] = {}
    for machine, output in outputs.items():
        said = [int(line.rsplit(":", 1)[1]) for line in output.splitlines()
                if line.startswith(f"[launcher] {machine} exit code: ")]
        for i in range(WORKERS):  # the supervisor's one code: 0 if every worker exited 0, else the first other
            codes[f"{machine}.{i}"] = -signal.SIGKILL if kill and machine == victim else (said[-1] if said else None)
    killed = {f"{victim}.{i}" for i in range(WORKERS)} if kill else set()
    return judge(case, "".join(outputs.values()), followed, codes, statuses, killed, {victim} if kill else set(),
                 steps, timed_out)


def row(outcome: Outcome) -> str:
    codes = " ".join(f"{node}={code}" for node, code in outcome.codes.items())
    statuses = " ".join(f"{code}" if name == "launcher" else f"{name}={code}" for name, code in outcome.statuses.items())
    ends = " ".join(f"{node} {s:.1f}" for node, s in outcome.node_ends.items())
    end = "-" if outcome.end is None else f"{outcome.end:.1f}"
    verdict = ("ok" if not outcome.wrong else "WRONG: " + "; ".join(outcome.wrong)) + (f" ({outcome.why})" if outcome.why else "")
    return (f"| {outcome.case} | {'finished' if outcome.finished else 'failed'} | {outcome.steps} | {codes} | "
            f"{statuses} | {ends or '-'} | {end} | {verdict} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2,3,4,6", help="local jobs' node counts, comma-separated")
    parser.add_argument("--modes", default="off,lazy,eager", help="redundancy modes, comma-separated")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.3, help="seconds each step sleeps (a step as long as a real one)")
    parser.add_argument("--no-netns", action="store_true", help="skip the cases on a cluster of network namespaces")
    parser.add_argument("--json", action="store_true", help="also print each case's outcome as a JSON line")
    add_worker_flag(parser, choices=["netns-case"])  # a cluster case (of the one mode --modes names), in a child process
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "netns-case":
        print(RESULT + json.dumps(asdict(netns_case(args.modes, args.kill, args.steps, args.sleep))), flush=True)
        return 0
    cases = [Case("local", int(n), mode, kill) for n in args.nodes.split(",") if n for mode in args.modes.split(",")
             for kill in (False, True)]
    if not args.no_netns:
        cases += [Case("netns", len(MACHINES) * WORKERS, "lazy", kill) for kill in (False, True)]
    print(f"slow_mlp.py: {args.steps} steps of {args.sleep:g} s; kill: node1 at step {args.steps // 2} (local), "
          f"every process of {MACHINES[-1]} once {MACHINES[-1]}.0 reported step {args.steps // 2} (netns); "
          f"bound: every process ends within {BOUND:g} s of the last step", flush=True)
    outcomes = []
    for case in cases:
        started = time.monotonic()
        outcome = (run_local if case.where == "local" else run_netns)(case, args.steps, args.sleep)
        if outcome.finished and (outcome.end is None or outcome.end > BOUND):
            outcome.wrong.append(f"a process ended {outcome.end} s after the last step (bound {BOUND:g} s)")
        outcomes.append(outcome)
        print(f"{case}: {'ok' if not outcome.wrong else '; '.join(outcome.wrong)} ({time.monotonic() - started:.0f} s)",
              flush=True)
    print("\n| case | job | steps | node exit codes | launcher status | node ends (s after last step) "
          "| every process ended (s) | verdict |\n|---|---|---:|---|---|---|---:|---|")
    for outcome in outcomes:
        print(row(outcome))
    wrong = [o for o in outcomes if o.wrong]
    slow = [o.case for o in outcomes if o.finished and (o.end is None or o.end > BOUND)]
    print(f"\nmissed the {BOUND:g} s bound: {', '.join(slow) or 'none'}")
    print(f"wrong: {', '.join(o.case for o in wrong) or 'none'}")
    for outcome in wrong:
        print(f"\n--- {outcome.case}: the end of its output ---\n{outcome.tail}")
    if args.json:
        for outcome in outcomes:
            print(json.dumps({k: v for k, v in asdict(outcome).items() if k != "tail"}))
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
