"""Chaos: seeded random membership changes replayed by the demo, each run checked against a clean run.

For every seed, a schedule of at least ``--changes`` membership changes is drawn and replayed by
``lightning-bamboo demo --audit --optimizer adamw --dropout 0.1`` (4 nodes, one 4-stage pipeline, checkpoints
every 4 steps; dropout in every layer, so that a layer's random numbers must follow it too): SIGKILLs, preemption notices, frozen nodes (SIGSTOP, never continued), joins, a kill soon
after a join, two non-neighbours at once, a node and its replica holder at once (the checkpoint
fallback), a kill a few steps after that restart, and kills at points inside the runtime
(``BAMBOO_FAIL_AT``): during a failover, during a live reconfiguration, inside a checkpoint save, and
between a step's commit and its update. The membership lives in a real etcd server, which the
schedule kills and starts again (same data) at up to two steps (``--store embedded`` skips that).
The replica audit runs after every step and membership change. Each run is compared with a run of
the same steps without preemptions:

- weights and every optimizer state tensor (AdamW's moments and step counts), max absolute difference;
- the samples of every step, in every process and job that ran it (none lost, none repeated);
- every step finished; every recovery's seconds (a loss to the next finished step).

Prints a table (seeds, changes, mismatches, recoveries by kind, p50/p99/max recovery) and exits 1 if
any run differs, stops short, or recovers slower than ``--max-recovery`` seconds, restarts that found no process
of the job ready and waited for one to start (listed apart) included unless ``--max-cold-restart`` allows them more
(``--no-bounds``: recoveries are printed, not judged).

With ``--pipelines P`` (2 or more) the demo runs ``3 * P`` nodes as P pipelines of 3 stages, and a
*machine* is the P nodes of one stage row (the demo places node ``i`` on stage ``i // P`` of pipeline
``i % P``, so a machine holds a node of every pipeline, as a machine of P GPUs would). The schedule
then also draws whole machines killed at once and replacement machines of P nodes joining, besides
the kinds above. Every run of a seed has the same steps, and is judged against a noise floor
measured in the same call (``benchmarks/noise_floor.py``): when the number of pipelines changes, the
step's gradients are summed in another grouping and the weights leave the clean run's by rounding,
so the floor is the larger difference of two clean runs that differ only in that way (one weight one
ulp up at step 0; the job on one pipeline). A run beyond it fails; samples, steps and exit status
are checked as with one pipeline.

With ``--precision bf16`` (or ``fp16``) every demo run of the call, the clean runs included, computes its
layers under autocast in that precision with fp32 master weights, and clips the gradients by their global
norm to ``--clip`` (default 0.5 then, which the demo model's norm of 0.47-0.86 exceeds; 0 turns it off). The worker reads them from ``BAMBOO_DEMO_PRECISION``
and ``BAMBOO_DEMO_CLIP`` (the demo's command line has no flag for them). The judgement is unchanged: on one
pipeline the chaos run must equal the clean run of the same precision bit for bit.

    python benchmarks/chaos.py [--seeds 10] [--changes 30] [--first-seed 0] [--store etcd|embedded] [--json]
    python benchmarks/chaos.py --pipelines 2 --seeds 5
    python benchmarks/chaos.py --seeds 3 --precision bf16 [--clip 0.5]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_bamboo.testing import faults  # noqa: E402
from lightning_bamboo.testing.chaos import (  # noqa: E402
    CHECKPOINT_EVERY,
    NODES,
    Schedule,
    final_checkpoint,
    make_schedule,
    max_difference,
    optimizer_states,
    sample_problems,
    samples_by_step,
)
from lightning_bamboo.testing.job_output import run_demo  # noqa: E402

PERTURB_ENV = "BAMBOO_DEMO_PERTURB"  # read by lightning_bamboo/demo/worker.py: "ulp" nudges one weight
PRECISION_ENV = "BAMBOO_DEMO_PRECISION"  # read by the worker too: "bf16" or "fp16" (unset: fp32)
CLIP_ENV = "BAMBOO_DEMO_CLIP"  # and the global norm to clip the gradients to (unset: no clipping)


@dataclass(frozen=True)
class Numerics:
    """How every demo run of a call computes: ``precision`` "32", "bf16" or "fp16"; ``clip``: the global norm (0: off)."""

    precision: str = "32"
    clip: float = 0.0

    def environment(self) -> dict[str, str]:
        """The worker's environment variables for it (none for fp32 without clipping)."""
        env = {PRECISION_ENV: self.precision} if self.precision != "32" else {}
        return {**env, CLIP_ENV: repr(self.clip)} if self.clip else env


@dataclass(frozen=True)
class Shape:
    """The demo's size: ``nodes`` in pipelines of ``stages`` (None: one pipeline); ``perturb``: one weight one ulp up."""

    nodes: int = NODES
    stages: int | None = None
    perturb: bool = False

    @classmethod
    def of(cls, pipelines: int) -> Shape:
        return cls() if pipelines == 1 else cls(3 * pipelines, 3)


def demo(out: Path, steps: int, schedule: Schedule | None, timeout: float, step_delay: float = 0.0,
         etcd: bool = False, detection_timeout: float = 5.0, dropout: float = 0.0, shape: Shape | None = None,
         numerics: Numerics = Numerics()) -> dict:
    """Run the demo (``schedule`` None: no preemptions) in ``out``; its report, with where its files are.

    With ``etcd`` the membership lives in a real etcd server started here, which the schedule's
    ``etcd_restarts`` kill and start again (same data dir) when the job reaches those steps. ``shape``: the
    nodes and stages (default: ``NODES`` nodes in one pipeline), and the one-ulp perturbation of a floor run;
    ``numerics``: the precision and gradient clipping of every node.
    """
    shape = shape or Shape()
    if not etcd:
        return _demo(out, steps, schedule, timeout, step_delay, "embedded", detection_timeout, dropout, shape, numerics)
    from lightning_bamboo.testing.etcd_server import EtcdServer

    with EtcdServer() as server:
        done = threading.Event()
        restarts = threading.Thread(target=_restart_etcd, args=(server, schedule.etcd_restarts if schedule else [], done),
                                    daemon=True)
        restarts.start()
        try:
            return _demo(out, steps, schedule, timeout, step_delay, server.url, detection_timeout, dropout, shape,
                         numerics)
        finally:
            done.set()
            restarts.join(30)


def _restart_etcd(server, steps: list[int], done: threading.Event) -> None:
    """Kill and start the etcd server again as the job (any of its restarts) first reaches each of ``steps``."""
    from lightning_bamboo.membership import connect

    pending = sorted(steps)
    while pending and not done.is_set():
        try:
            client = connect(server.url, timeout=2.0)
            try:
                progress = [int(kv.value) for kv in client.get_prefix("/bamboo/").kvs if "/progress/" in kv.key]
            finally:
                client.close()
        except Exception:  # noqa: BLE001 - the server is between a kill and a start, or busy: ask again
            progress = []
        if progress and max(progress) >= pending[0]:
            pending.pop(0)
            server.restart()
            print(f"etcd restarted at step {max(progress)}", flush=True)
        done.wait(0.2)


def _demo(out: Path, steps: int, schedule: Schedule | None, timeout: float, step_delay: float, store: str,
          detection_timeout: float, dropout: float, shape: Shape, numerics: Numerics) -> dict:
    report = out / "report.json"
    cmd = ["--nodes", str(shape.nodes), "--steps", str(steps),
           "--checkpoint-every", str(CHECKPOINT_EVERY), "--optimizer", "adamw", "--quiet", "--workdir", str(out / "work"),
           "--store", store, "--detection-timeout", str(detection_timeout), "--dropout", str(dropout),
           "--report", str(report), "--save-weights", str(out / "weights.pt"),
           "--preempt", ",".join(schedule.preempt) if schedule else ""]
    cmd += ["--stages", str(shape.stages)] if shape.stages else []
    if schedule is not None:
        cmd += ["--freeze", ",".join(schedule.freeze)] if schedule.freeze else []
        cmd += ["--audit", "--step-delay", str(step_delay)] + (["--join", ",".join(schedule.join)] if schedule.join else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in (*faults.ENV_NAMES, PERTURB_ENV, PRECISION_ENV, CLIP_ENV):
        env.pop(name, None)
    if shape.perturb:
        env[PERTURB_ENV] = "ulp"
    env.update(numerics.environment())  # every run of the call, clean and chaos alike
    if schedule is not None and schedule.fail_at:
        (out / "fired").mkdir()
        env.update(faults.environment(schedule.fail_at, once_dir=out / "fired"))  # a node started again is spared
    # its own process group: a run over the timeout is stopped with every worker it started
    status = run_demo(cmd, out / "demo.log", timeout, env=env, cwd=REPO)
    code: int | str = f"none: stopped after the {timeout:g} s timeout" if status is None else status
    result = json.loads(report.read_text()) if report.exists() else {"steps_completed": 0, "recovery_seconds": []}
    result["exit_code"] = code
    result["log_tail"] = (out / "demo.log").read_text(errors="replace")[-3000:]
    return result



def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def seed_schedule(seed: int, args: argparse.Namespace) -> Schedule:
    schedule = make_schedule(seed, args.changes, nodes=Shape.of(args.pipelines).nodes, etcd=args.store == "etcd",
                             pipelines=args.pipelines)
    if args.pipelines > 1:  # every seed as long as the longest, so that one clean run and one floor serve them all
        schedule.steps = max(make_schedule(s, args.changes, nodes=Shape.of(args.pipelines).nodes,
                                           etcd=args.store == "etcd", pipelines=args.pipelines).steps
                             for s in range(args.first_seed, args.first_seed + args.seeds))
    return schedule


def numerics_of(args: argparse.Namespace) -> Numerics:
    return Numerics(args.precision, args.clip)


def clean_run(out: Path, steps: int, args: argparse.Namespace, shape: Shape) -> dict:
    """A run of ``steps`` without preemptions: its weights, AdamW state, samples by step and samples/s."""
    out.mkdir()
    report = demo(out, steps, None, args.timeout, dropout=args.dropout, shape=shape, numerics=numerics_of(args))
    if report["exit_code"] != 0 or report["steps_completed"] != steps:
        raise SystemExit(f"the clean run of {steps} steps ({shape}) failed: exit {report['exit_code']}\n"
                         f"{report['log_tail']}")
    return {"weights": torch.load(out / "weights.pt"), "optimizer": optimizer_states(final_checkpoint(out / "work")),
            "samples": samples_by_step(out / "work"), "samples_per_second": report["samples_per_second"]}


def clean_and_floor(steps: int, args: argparse.Namespace, root: Path) -> dict:
    """The clean run of ``steps``; with several pipelines, the noise floor as ``floor`` too: the larger difference
    from it of the same job with one weight one ulp up, and of the same job on one pipeline of the same depth."""
    shape = Shape.of(args.pipelines)
    clean = clean_run(root / f"clean-{steps}", steps, args, shape)
    clean["floor"] = 0.0
    if args.pipelines > 1:
        ulp = clean_run(root / f"floor-ulp-{steps}", steps, args, Shape(shape.nodes, shape.stages, perturb=True))
        one = clean_run(root / f"floor-one-{steps}", steps, args, Shape(shape.stages, shape.stages))
        clean["floor"] = max(max_difference(ulp["weights"], clean["weights"]), max_difference(one["weights"], clean["weights"]))
        print(f"noise floor after {steps} steps: {clean['floor']:.3g} (one ulp: "
              f"{max_difference(ulp['weights'], clean['weights']):.3g}, one pipeline: "
              f"{max_difference(one['weights'], clean['weights']):.3g})", flush=True)
    return clean


def run_seed(seed: int, args: argparse.Namespace, root: Path, clean_runs: dict[int, dict]) -> dict:
    schedule = seed_schedule(seed, args)
    if schedule.steps not in clean_runs:
        clean_runs[schedule.steps] = clean_and_floor(schedule.steps, args, root)
    clean = clean_runs[schedule.steps]
    out = root / f"seed-{seed}"
    out.mkdir()
    report = demo(out, schedule.steps, schedule, args.timeout, args.step_delay, etcd=args.store == "etcd",
                  detection_timeout=args.detection_timeout, dropout=args.dropout, shape=Shape.of(args.pipelines),
                  numerics=numerics_of(args))
    row: dict = {"seed": seed, "steps": schedule.steps, "target_steps": schedule.steps,
                 "steps_completed": report.get("steps_completed", 0), "changes": schedule.changes,
                 "kinds": dict(schedule.kinds), "exit_code": report["exit_code"],
                 "recoveries": report.get("recoveries", {}), "recovery_seconds": report.get("recovery_seconds", []),
                 "preempt": schedule.preempt, "join": schedule.join, "fail_at": schedule.fail_at, "freeze": schedule.freeze,
                 "etcd_restarts": schedule.etcd_restarts, "floor": clean["floor"], "precision": args.precision,
                 "clip": args.clip}
    problems = []
    if report["exit_code"] != 0 or row["steps_completed"] != schedule.steps:
        problems.append(f"exit {report['exit_code']}, {row['steps_completed']} of {schedule.steps} steps; "
                        f"log tail:\n{report['log_tail']}")
    else:
        row["weights_difference"] = max_difference(torch.load(out / "weights.pt"), clean["weights"])
        row["optimizer_difference"] = max_difference(optimizer_states(final_checkpoint(out / "work")), clean["optimizer"])
        if args.pipelines == 1 and (row["weights_difference"] or row["optimizer_difference"]):
            problems.append(f"weights differ by {row['weights_difference']:.3g}, optimizer state by "
                            f"{row['optimizer_difference']:.3g}")
        if args.pipelines > 1 and row["weights_difference"] > clean["floor"]:
            problems.append(f"weights differ by {row['weights_difference']:.3g}, beyond the noise floor "
                            f"{clean['floor']:.3g} (optimizer state by {row['optimizer_difference']:.3g})")
        sample_issues = sample_problems(clean["samples"], samples_by_step(out / "work"), schedule.steps)
        row["sample_problems"] = len(sample_issues)
        problems += sample_issues[:5]
    row["recovery_kinds"] = report.get("recovery_kinds", ["failover"] * len(row["recovery_seconds"]))
    cold_bound = args.max_recovery if args.max_cold_restart is None else args.max_cold_restart
    slow = [s for s, kind in zip(row["recovery_seconds"], row["recovery_kinds"], strict=True)
            if s > (cold_bound if kind == "cold_restart" else args.max_recovery)]
    row["over_bound"] = slow
    if slow and not args.no_bounds:
        problems.append(f"recoveries over {args.max_recovery} s, or {cold_bound} s for a restart that "
                        f"waited for a process to start: {slow}")
    row["cold_over_bound"] = [s for s, kind in zip(row["recovery_seconds"], row["recovery_kinds"], strict=True)
                              if kind == "cold_restart" and s > args.max_recovery]
    row["problems"] = problems
    return row


def table(rows: list[dict]) -> str:
    lines = [f"{'seed':>4} {'steps':>5} {'changes':>7} {'kept':>5} {'w diff':>7} {'opt diff':>8} {'samples':>7} "
             f"{'redundant':>9} {'ckpt':>4} {'p50 s':>6} {'max s':>6}  result"]
    for r in rows:
        rec = r["recoveries"]
        lines.append(
            f"{r['seed']:>4} {r['steps_completed']:>2}/{r['target_steps']:<2} {r['changes']:>7} "
            f"{r['changes'] if not r['problems'] else '-':>5} {r.get('weights_difference', float('nan')):>7.1g} "
            f"{r.get('optimizer_difference', float('nan')):>8.1g} {r.get('sample_problems', '-'):>7} "
            f"{rec.get('redundant', 0):>9} {rec.get('checkpoint', 0):>4} {percentile(r['recovery_seconds'], 0.5):>6.2f} "
            f"{max(r['recovery_seconds'], default=0.0):>6.2f}  {'ok' if not r['problems'] else 'FAILED'}")
    seconds = [s for r in rows for s, k in zip(r["recovery_seconds"], r["recovery_kinds"], strict=True) if k == "failover"]
    restarts = [s for r in rows for s, k in zip(r["recovery_seconds"], r["recovery_kinds"], strict=True) if k == "restart"]
    cold = [s for r in rows for s, k in zip(r["recovery_seconds"], r["recovery_kinds"], strict=True) if k == "cold_restart"]
    cold_over = [r["seed"] for r in rows if r.get("cold_over_bound")]
    kinds = collections.Counter()
    for r in rows:
        kinds.update(r["kinds"])
    failed = [r["seed"] for r in rows if r["problems"]]
    lines += [
        "",
        f"seeds {len(rows)}, changes survived {sum(r['changes'] for r in rows if not r['problems'])} of "
        f"{sum(r['changes'] for r in rows)}, runs with a mismatch, short or over a bound {len(failed)} {failed if failed else ''}",
        f"noise floor (several pipelines; weights beyond it fail): {max(r.get('floor', 0.0) for r in rows):.3g}, largest "
        f"difference of a run {max((r.get('weights_difference', 0.0) for r in rows), default=0.0):.3g}",
        f"recoveries over their bound {sum(len(r.get('over_bound', [])) for r in rows)}"
        f" {[s for r in rows for s in r.get('over_bound', [])] or ''}",
        "changes drawn by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())),
        "recoveries by kind: " + ", ".join(
            f"{k} {sum(r['recoveries'].get(k, 0) for r in rows)}" for k in ("redundant", "checkpoint", "restart")),
        f"recovery seconds, failovers ({len(seconds)}): p50 {percentile(seconds, 0.5):.2f}, "
        f"p99 {percentile(seconds, 0.99):.2f}, max {max(seconds, default=0.0):.2f}",
        f"recovery seconds, restarts from a checkpoint in ready processes ({len(restarts)}): "
        f"p50 {percentile(restarts, 0.5):.2f}, max {max(restarts, default=0.0):.2f}",
        f"recovery seconds, restarts from a checkpoint that waited for a process to start, none ready ({len(cold)}): "
        f"p50 {percentile(cold, 0.5):.2f}, max {max(cold, default=0.0):.2f}; over the failover bound in runs "
        f"{cold_over if cold_over else '-'}",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--pipelines", type=int, default=1,
                   help="2 or more: that many pipelines of 3 stages, whole machines lost and joining, runs judged "
                        "against a noise floor measured in the same call (default 1: one 4-stage pipeline, bit-exact)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--changes", type=int, default=30, help="membership changes per seed (at least)")
    p.add_argument("--max-recovery", type=float, default=6.0,
                   help="seconds any recovery (a loss to the next finished step: a failover, or a restart from the "
                        "checkpoint when a node and its replica holder are lost) may take: 5 s plus about one step")
    p.add_argument("--max-cold-restart", type=float, default=None,
                   help="seconds a restart from a checkpoint that found no process of the job ready may take (it "
                        "waits for one to start; listed apart). Default: --max-recovery, no exception (the demo's "
                        "warm pool keeps started processes for nodes that join)")
    p.add_argument("--no-bounds", action="store_true",
                   help="print the recoveries over a bound, but judge the runs by exactness, samples and steps alone "
                        "(the test suite's run: a loaded machine may recover late, never wrongly)")
    p.add_argument("--detection-timeout", type=float, default=2.5,
                   help="the demo's --detection-timeout: a frozen node is found within it, so that its recovery "
                        "fits the bound (SIGKILLed nodes are found at once)")
    p.add_argument("--step-delay", type=float, default=0.4,
                   help="seconds each node pauses per step, so that joining processes start while the job trains")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout in every layer of the demo model (0 turns it off): each layer's masks must follow it "
                        "through failovers, moves and restarts for the weights to stay exact")
    p.add_argument("--precision", choices=("32", "bf16", "fp16"), default="32",
                   help="every demo run of the call (the clean runs too) computes its layers in this precision under "
                        "autocast, with fp32 master weights (default 32: fp32 throughout)")
    p.add_argument("--clip", type=float, default=None,
                   help="clip every step's gradients by their global norm to this (0: off; default 0.5 with "
                        "--precision bf16 or fp16, where the demo model's norm (0.47-0.86) is clipped, else 0)")
    p.add_argument("--store", choices=("etcd", "embedded"), default="etcd",
                   help="membership in a real etcd server that the schedule restarts (default), or the embedded store")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one demo run may take")
    p.add_argument("--keep", default=None, help="keep every run's files in this directory")
    p.add_argument("--json", action="store_true", help="also print every run as a JSON line")
    args = p.parse_args()
    if args.clip is None:
        args.clip = 0.0 if args.precision == "32" else 0.5
    if args.clip < 0:
        raise SystemExit(f"--clip must be 0 (off) or more (got {args.clip:g})")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bamboo-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    rows, clean_runs = [], {}
    if args.pipelines < 1:
        raise SystemExit(f"--pipelines must be 1 or more (got {args.pipelines})")
    shape = Shape.of(args.pipelines)
    print(f"demo: {shape.nodes} nodes in {args.pipelines} pipeline(s), AdamW, dropout {args.dropout}, precision "
          f"{args.precision}, gradient clipping {args.clip:g}, replica audit on, detection timeout "
          f"{args.detection_timeout} s, store {args.store}; bounds: recovery {args.max_recovery} s", flush=True)
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        row = run_seed(seed, args, root, clean_runs)
        rows.append(row)
        print(f"seed {seed}: {row['changes']} changes, {row['steps_completed']}/{row['target_steps']} steps, "
              + ("ok" if not row["problems"] else "FAILED:\n  " + "\n  ".join(row["problems"])), flush=True)
        if args.json:
            print(json.dumps({"chaos_run": row}), flush=True)
    print(table(rows))
    failed = any(r["problems"] for r in rows)
    if not args.keep:
        if failed:  # a failed run's logs, stores and checkpoints are what a reader debugs it with
            print(f"the runs' files are kept in {root}; remove it when done", flush=True)
        else:  # every run's checkpoints and logs (about 90 MB a seed)
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
