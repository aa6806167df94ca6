"""Measure the demo-scale simulator parameters with real `lightning-bamboo demo` runs on this machine.

Four demo runs of one 6-stage pipeline (the demo's built-in 8-layer GPT, 8 samples per step,
checkpoints every 4 steps), each line ``step N/K`` of the demo's progress stamped as it arrives:

* Bamboo (lazy replicas), three far-apart kills (SIGKILL) -> step time at depths 4 and 3 (after
  the second and third failover); checkpoint-save pause; failover pause (demo's recovery time
  minus the first step at the new depth: the step in flight is redone). The step after each
  redone step starts with the RebalanceCallback evening out the layers: its extra time over a
  plain step is the reconfiguration pause.
* ``--no-redundancy``, one kill at step 80 of 160 -> step time at depths 6 and 5 without replicas
  (long segments); restart pause (recovery time minus the first step after the restart).
* two adjacent kills (node1 and its replica holder node2) at step 22 of 40 -> the pause of a
  restart in place (the four survivors reload the step-20 checkpoint in their running processes).
* a join: node2 killed at step 4, spare1 started at step 40 of 160 -> step time at depth 5 (steps
  8-40) and at depth 6 (from 2 steps after spare1's admission to step 160: about 60 steps): the
  long segments the simulator's steady state needs; from starting a node to its admission at a step start; the training time
  its start-up costs the busy cores.

The numbers go to the ``demo`` section of lightning_bamboo/data/sim_params.json through
``record_measurement(..., section="demo")``: they describe the demo on this machine, NOT a GPU
cluster, and only ``benchmarks/sim_validation.py`` uses them. The GPT-2/p3 defaults (``params``)
are left as they are.

    python benchmarks/sim_calibrate.py [--dry-run] [--runs-json runs.json] [--from-json runs.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from lightning_bamboo.sim.calibration import clean_steps, mean_of, parse_progress, save_steps, step_intervals
from lightning_bamboo.sim.params import record_measurement
from lightning_bamboo.testing.job_output import run_demo

ROOT = Path(__file__).resolve().parents[1]
SAMPLES_PER_STEP = 8  # the demo's global batch
CHECKPOINT_EVERY = 4
FATAL_AT = 22  # node1 and its replica holder node2 die together: back to the step-20 checkpoint
# (name, steps, kills as --preempt, extra flags)
RUNS = {
    "bamboo": (36, "node2@9,node4@18,node0@27", ()),
    "no_redundancy": (160, "node2@80", ("--no-redundancy",)),
    "join": (160, "node2@4", ("--join", "spare1@40")),
    "fatal": (40, f"node1@{FATAL_AT},node2@{FATAL_AT}", ()),
}
JOIN_AT = 40
NO_REDUNDANCY_KILL = 80


def timed_demo(steps: int, preempt: str, extra: tuple[str, ...], workdir: Path) -> dict:
    """Run the demo, stamping every stdout line; returns its report and the stamped lines."""
    report = workdir / "report.json"
    cmd = ["--nodes", "6", "--steps", str(steps), "--preempt", preempt, "--checkpoint-every", str(CHECKPOINT_EVERY),
           "--report", str(report),
           # the simulator's demo model starts each joined node's interpreter when it joins (no warm pool)
           "--warm-pool", "0", *extra]
    lines: list[tuple[float, str]] = []
    code = run_demo(cmd, None, 3600, env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}, cwd=ROOT,
                    lines=lines)
    if not report.exists():
        raise RuntimeError(f"the demo wrote no report (exit {code}); run lightning-bamboo demo {' '.join(cmd)} by hand")
    return {"cmd": cmd, "lines": lines, "report": json.loads(report.read_text())}


def end_seconds(run: dict) -> float:
    """Seconds the demo counts after its last progress line (final save, consolidation, exit)."""
    progress = parse_progress(run["lines"])
    rep = run["report"]
    wall = rep["steps_completed"] * SAMPLES_PER_STEP / rep["samples_per_second"]
    return wall - (progress[-1][0] - progress[0][0])


def from_bamboo(run: dict) -> dict:
    """Depth-6..3 step times, save pause and failover pause from the run with three failovers."""
    iv = step_intervals(parse_progress(run["lines"]))
    kills = [9, 18, 27]
    # step kills[i] + 1 holds the failover, kills[i] + 2 the rebalance (RebalanceCallback) before it
    bounds = [(2, 9), (12, 18), (21, 27), (30, 36)]
    depths = {
        6 - i: mean_of(iv, clean_steps(a, b, CHECKPOINT_EVERY), f"depth {6 - i}")
        for i, (a, b) in enumerate(bounds)
    }
    rebalance = [iv[k + 2] - depths[5 - i] for i, k in enumerate(kills) if k + 2 in clean_steps(k + 2, k + 2, CHECKPOINT_EVERY)]
    saves = [
        iv[s] - depths[6 - i]
        for i, (a, b) in enumerate(bounds)
        for s in save_steps(a, b, CHECKPOINT_EVERY)
        if s in iv
    ]
    recov = run["report"]["recovery_seconds"]
    if len(recov) != len(kills):
        raise RuntimeError(f"expected {len(kills)} recoveries in the bamboo run, got {recov}; see its report")
    failover = [r - depths[5 - i] for i, r in enumerate(recov)]
    return {"step_seconds": depths, "saves": saves, "failover": failover, "rebalance": rebalance, "end": end_seconds(run)}


def from_join(run: dict) -> dict:
    """From the join run (node2 lost at step 4, spare1 started when step JOIN_AT is done):

    * depth-5 step time over steps 8..JOIN_AT and depth-6 step time from two steps after spare1's
      admission to the end: the long segments of the calibration;
    * ``join``: seconds from starting spare1 to the step boundary it was admitted at;
    * ``standby_start``: training time lost to spare1's start-up: the extra time of the steps it
      overlapped over the depth-5 step time (saves excluded, scaled to every step of the window).
    """
    admitted = [r["step"] for r in run["report"]["reconfigurations"] if "spare1" in r["order"]]
    if not admitted:
        raise RuntimeError(f"spare1 was never admitted in the join run: {run['report']['reconfigurations']}")
    at = admitted[0]
    progress = parse_progress(run["lines"])
    done = {step: t for t, step in progress}
    iv = step_intervals(progress)
    steps = run["report"]["steps_completed"]
    depth5 = mean_of(iv, clean_steps(8, JOIN_AT, CHECKPOINT_EVERY), "depth 5 before the join")
    depth6 = mean_of(iv, clean_steps(at + 2, steps, CHECKPOINT_EVERY), "depth 6 after the join")
    window = list(range(JOIN_AT + 1, at))
    clean = [s for s in clean_steps(JOIN_AT + 1, at - 1, CHECKPOINT_EVERY) if s in iv]
    if not clean:
        raise RuntimeError(f"no clean step while spare1 started (steps {window}); the join run needs more steps")
    extra = sum(iv[s] - depth5 for s in clean) * len(window) / len(clean)
    return {"step_seconds": {6: depth6, 5: depth5}, "join": done[at] - done[JOIN_AT], "standby_start": max(0.0, extra),
            "saves": [iv[s] - depth5 for s in save_steps(8, JOIN_AT, CHECKPOINT_EVERY) if s in iv]
            + [iv[s] - depth6 for s in save_steps(at + 2, steps, CHECKPOINT_EVERY) if s in iv]}


def from_no_redundancy(run: dict) -> dict:
    """Depth-6/5 step times without replicas, save pause and restart pause from the run with one restart."""
    iv = step_intervals(parse_progress(run["lines"]))
    steps, kill = run["report"]["steps_completed"], NO_REDUNDANCY_KILL
    after = kill + 4  # the restart goes back to the last checkpoint; steps from here on ran after it
    depths = {
        6: mean_of(iv, clean_steps(2, kill - 1, CHECKPOINT_EVERY), "depth 6"),
        5: mean_of(iv, clean_steps(after, steps, CHECKPOINT_EVERY), "depth 5"),
    }
    saves = [iv[s] - depths[6] for s in save_steps(2, kill - 1, CHECKPOINT_EVERY) if s in iv] + [
        iv[s] - depths[5] for s in save_steps(after, steps, CHECKPOINT_EVERY) if s in iv
    ]
    recov = run["report"]["recovery_seconds"]
    if len(recov) != 1 or run["report"]["recoveries"]["checkpoint"] != 1:
        raise RuntimeError(f"expected one checkpoint restart, got {run['report']['recoveries']} {recov}")
    return {"step_seconds": depths, "saves": saves, "restart": recov[0] - depths[5], "end": end_seconds(run)}


def from_fatal(run: dict, depth4: float) -> dict:
    """The pause of a restart in place: node1 and node2 die together; node0, node3, node4 and node5
    restart from the last checkpoint in their running processes, at depth 4."""
    report = run["report"]
    recov = report["recovery_seconds"]
    if report["recoveries"]["checkpoint"] != 1 or report.get("processes_kept") != 4 or not recov:
        raise RuntimeError(f"expected one restart in place keeping 4 processes, got {report['recoveries']}, "
                           f"{report.get('processes_kept')} kept, recoveries {recov}")
    return {"restart_in_place": recov[0] - depth4}


def derive(runs: dict) -> dict:
    b, n, j = from_bamboo(runs["bamboo"]), from_no_redundancy(runs["no_redundancy"]), from_join(runs["join"])
    f = from_fatal(runs["fatal"], b["step_seconds"][4])
    # depths 6 and 5 from the join run's long segments; 4 and 3 exist only after the bamboo run's failovers
    depths = {**b["step_seconds"], **j["step_seconds"]}
    return {
        "reconfigure_seconds": round(statistics.fmean(b["rebalance"]), 3),
        "join_seconds": round(j["join"], 3),
        "standby_start_seconds": round(j["standby_start"], 3),
        "step_seconds": {str(k): round(v, 3) for k, v in sorted(depths.items(), reverse=True)},
        "step_seconds_no_redundancy": {str(k): round(v, 3) for k, v in n["step_seconds"].items()},
        "checkpoint_save_seconds": round(statistics.fmean(b["saves"] + n["saves"] + j["saves"]), 3),
        "failover_seconds": round(statistics.fmean(b["failover"]), 3),
        "restart_seconds": round(n["restart"], 3),
        "restart_in_place_seconds": round(f["restart_in_place"], 3),
        "end_seconds": round(statistics.fmean([b["end"], n["end"]]), 3),
        "startup_timeout_seconds": STARTUP_TIMEOUT,
        "_detail": {"bamboo": b, "no_redundancy": n, "join": j, "fatal": f},
    }


# Not measured: the demo's configuration. BambooStrategy(timeout=60) in lightning_bamboo/demo/worker.py; a worker
# that dies while a restarted job starts leaves the others waiting for it at the rendezvous that long.
STARTUP_TIMEOUT = 60.0

PROVENANCE = {
    "step_seconds": "mean step interval (no checkpoint in it) per pipeline depth with lazy replicas: depths 6 and 5 over "
    "long segments of the join run (depth 5 for 33 steps after a failover, depth 6 for about 60 steps after the admission), "
    "depths 4 and 3 after the bamboo run's second and third failovers",
    "step_seconds_no_redundancy": "mean step interval per depth with --no-redundancy (depth 6 for 78 steps, depth 5 for 76 after a restart: long segments, the step time varies by 10-20% over a few seconds on this machine)",
    "standby_start_seconds": "training time lost while spare1 started (join run; the demo starts it at idle CPU priority): the "
    "extra time of the steps its start-up overlapped over the depth-5 step time, saves excluded and scaled to every step of that window",
    "checkpoint_save_seconds": "mean extra time of a step interval that follows a checkpoint (ModelCheckpoint every 4 steps), both runs",
    "failover_seconds": "mean over 3 kills of (demo recovery time - step time at the new depth): the step in flight is redone",
    "restart_seconds": "demo recovery time of one --no-redundancy kill (node2@80) minus one depth-5 step: stop, respawn 5 workers, load the checkpoint",
    "restart_in_place_seconds": f"demo recovery time of two adjacent kills (node1@{FATAL_AT},node2@{FATAL_AT}) minus one depth-4 "
    "step: the 4 survivors restart from the last checkpoint in their running processes",
    "startup_timeout_seconds": "CONFIGURED, not measured: the demo's rendezvous timeout (BambooStrategy(timeout=60) in "
    "lightning_bamboo/demo/worker.py); a worker lost while a restart starts leaves the others waiting that long",
    "reconfigure_seconds": "mean extra time of the step interval after each redone step (no checkpoint in it): the RebalanceCallback evening out the layers",
    "join_seconds": "from the step at which the demo started spare1 (--join spare1@40) to the step boundary it was admitted at: start-up and standby registration, 5 workers busy",
    "end_seconds": "seconds the demo's wall time counts after the last step (final save, consolidation, exit), mean of the runs with replicas and without",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="print the values, do not write sim_params.json"
    )
    parser.add_argument("--runs-json", default=None, help="also save the raw stamped runs here")
    parser.add_argument(
        "--from-json", default=None, help="derive from saved runs instead of running the demo"
    )
    args = parser.parse_args()
    if args.from_json:
        runs = json.loads(Path(args.from_json).read_text())
    else:
        runs = {}
        for name, (steps, preempt, extra) in RUNS.items():
            with tempfile.TemporaryDirectory() as tmp:
                print(f"demo run {name}: {steps} steps, kills {preempt} ...", flush=True)
                runs[name] = timed_demo(steps, preempt, extra, Path(tmp))
        if args.runs_json:
            Path(args.runs_json).write_text(json.dumps(runs))
    values = derive(runs)
    print(json.dumps(values, indent=1))
    if args.dry_run:
        return
    where = (
        f"benchmarks/sim_calibrate.py, {datetime.date.today().isoformat()}, {platform.node() or 'this machine'}: "
        f"{os.cpu_count()}-core CPU, no GPU, gloo; DEMO SCALE (lightning-bamboo demo, built-in 8-layer GPT, "
        f"6 worker processes, 8 samples/step), not a GPU-cluster number"
    )
    for key, text in PROVENANCE.items():
        record_measurement(key, values[key], f"{where}: {text}", section="demo")
    print("recorded in the 'demo' section of lightning_bamboo/data/sim_params.json")


if __name__ == "__main__":
    main()
