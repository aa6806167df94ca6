"""How far several-pipeline runs may drift from their clean run by rounding alone, and the faults judged against it.

    python benchmarks/noise_floor.py [--steps 60] [--at 20] [--nodes 6] [--stages 3]
    python benchmarks/noise_floor.py --capacity-of DIR [--plot PNG]   # the capacity timelines of runs kept with --keep DIR

With one pipeline, every failover ends bit-equal to the clean run. With several, a run whose pipeline
count changes sums the same micro-batch gradients in another grouping: each pipeline accumulates its
own share, then the pipelines' sums are added. That changes the last bits of a step's gradient, and
training (AdamW most of all: it divides by the gradient's own size) carries those bits on. This script
measures that drift on the demo's model, so that a several-pipeline run can be judged against a
measured floor instead of an assumed tolerance:

- floor, one ulp: the clean run against itself with one weight one ulp higher at step 0;
- floor, regrouped: the clean run against the same job on one pipeline from step 0 (every step's
  gradient grouped otherwise: the most regrouping a run can see);
- a node of every pipeline SIGKILLed at once at step ``--at``, each of another stage (the pipelines fail over to
  different layer splits, so one trains on and the others' survivors are released, to be admitted again);
- a node of every pipeline SIGKILLed at once, all of the same stage (as a machine holding one stage of every
  pipeline): every pipeline fails over alike and trains on, so the pipelines never change: bit-equal to the clean
  run;
- the same, then two machines' worth of nodes joining ``--join-after`` steps later;
- the reference for the kill: every pipeline but the first leaving with a notice, so that the same
  pipelines train from the same step on, without a kill or a failover from replicas;
- one pipeline damaged: a node of the last pipeline SIGKILLed at step ``--at`` (its pipeline is dropped, its
  survivors stand by and are admitted again), and the same node leaving with a notice at step ``--at - 1``
  instead (the same layout from the same step, no step redone): the two must be bit-equal where the
  survivors are admitted again at the same step in both.

Each run prints its exit status, the largest difference of the final weights and of the AdamW state
from the clean run's, its ratio to the floor (the larger of the two floors), and whether every step
trained on the clean run's samples. A fault beyond the floor is a bug until shown otherwise; the kill
and its notice reference must be bit-equal (the failover adds nothing but the regrouping).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

import torch

from lightning_bamboo.testing import chaos
from lightning_bamboo.testing.job_output import run_demo as run_demo_process

REPO = Path(__file__).resolve().parents[1]

PERTURB_ENV = "BAMBOO_DEMO_PERTURB"  # read by lightning_bamboo/demo/worker.py


def run_demo(out: Path, nodes: int, stages: int, steps: int, preempt: str = "", join: str = "",
             perturb: bool = False, timeout: float = 1200.0) -> dict:
    """One demo run in ``out``: its report, exit status, final weights, AdamW state and samples by step."""
    out.mkdir(parents=True)
    demo_args = ["--nodes", str(nodes), "--stages", str(stages), "--steps", str(steps), "--optimizer", "adamw",
                 "--quiet", "--workdir", str(out / "work"), "--report", str(out / "report.json"),
                 "--save-weights", str(out / "weights.pt"), "--preempt", preempt]
    demo_args += ["--join", join] if join else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(PERTURB_ENV, None)
    if perturb:
        env[PERTURB_ENV] = "ulp"
    status = run_demo_process(demo_args, out / "demo.log", timeout, env=env, cwd=REPO)
    code: int | str = f"stopped after {timeout:g} s" if status is None else status
    report = report_of(out)
    result = {"exit_code": code, "steps_completed": report.get("steps_completed", 0),
              "failovers": [(f["step"], f.get("old_pipelines"), f.get("pipelines")) for f in report.get("failovers", [])]}
    if code == 0 and (out / "weights.pt").exists():
        result["weights"] = torch.load(out / "weights.pt", weights_only=True)
        result["optimizer"] = chaos.optimizer_states(chaos.final_checkpoint(out / "work"))
        result["samples"] = chaos.samples_by_step(out / "work")
    return result


def capacity(report: dict) -> list[str]:
    """When the run's layout changed, in seconds after its first failover: how long the job trained below its
    capacity (from the demo's report: step times, failovers and reconfigurations)."""
    at = {int(step): float(t) for step, t in report.get("step_times", [])}
    failovers = report.get("failovers", [])
    if not failovers:
        return []
    start = at.get(int(failovers[0]["step"]), 0.0)
    lines = [f"step {f['step']} (+{at.get(int(f['step']), start) - start:.1f} s): failover, lost {f['lost']}, "
             f"{f['pipelines']} pipeline(s) of {len(f['order']) // max(1, f['pipelines'])}, released {f.get('released', [])}"
             for f in failovers]
    lines += [f"step {c['step']} (+{at.get(int(c['step']), start) - start:.1f} s): {c['reason']}: {c['order']}"
              for c in report.get("reconfigurations", [])]
    return [*lines, f"events: {report.get('events', [])}"]


EVENT = re.compile(r"step (\d+): (\S+) (preempted|joined)")  # the demo's report: a kill or a join


def capacity_series(report: dict, nodes: int) -> dict[int, tuple[float, int, int]]:
    """Step -> ``(seconds since the first failover, nodes training, nodes alive)`` for every step of a demo's
    ``report``: a node trains from the step its layout includes it; it is alive from the start or its join until its
    kill; a released survivor, or a joiner not admitted yet, is alive and idle."""
    at = {int(step): float(t) for step, t in report.get("step_times", [])}
    changes = sorted([(int(f["step"]), 0, len(f["order"])) for f in report.get("failovers", [])]
                     + [(int(c["step"]), 1, len(c["order"])) for c in report.get("reconfigurations", [])])
    alive_changes = [(int(m[1]), -1 if m[3] == "preempted" else 1)
                     for m in map(EVENT.match, report.get("events", [])) if m]
    failovers = report.get("failovers", [])
    start = at.get(int(failovers[0]["step"]), 0.0) if failovers else 0.0
    return {step: (at[step] - start, next((n for s, _, n in reversed(changes) if s <= step), nodes),
                   nodes + sum(d for s, d in alive_changes if s <= step)) for step in sorted(at)}


def idle_spells(report: dict, nodes: int) -> str:
    """For each kill or join of a demo's ``report``: the seconds from it until every live node trains again, or how
    many stay idle to the run's end (a layout of whole pipelines of the preferred depth cannot take them)."""
    series = capacity_series(report, nodes)
    last = series[max(series)] if series else (0.0, 0, 0)
    lines = []
    for match in map(EVENT.match, report.get("events", [])):
        if not match or int(match[1]) not in series:
            continue
        step = int(match[1])
        when = series[step][0]
        whole = next((series[s] for s in series if s >= step and series[s][1] >= series[s][2]), None)
        what = f"{match[2]} {match[3]} at step {step}"
        lines.append(f"{what}: every live node trains {whole[0] - when:.1f} s later" if whole is not None else
                     f"{what}: {last[2] - last[1]} of {last[2]} live nodes idle to the end ({last[0] - when:.1f} s)")
    return "\n  ".join(lines) or "no event"


def report_of(out: Path) -> dict:
    """The demo's report of the run kept in ``out`` (empty when it wrote none)."""
    return json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}


def plot_capacity(root: Path, nodes: int, path: Path) -> None:
    """The fraction of live nodes training against time, for the runs ``kill`` and ``kill_join`` kept in ``root``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, label in (("kill", "a node of every pipeline killed"), ("kill_join", "killed, then two nodes join")):
        series = capacity_series(report_of(root / name), nodes).values()
        ax.step([t for t, _, _ in series], [training / alive for _, training, alive in series], where="post",
                label=label)
    ax.set_xlabel("seconds since the kill")
    ax.set_ylabel("live nodes training")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right")
    ax.set_title(f"demo, {nodes} nodes as 2 pipelines of 3 stages (benchmarks/noise_floor.py)")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def difference(run: dict, clean: dict) -> tuple[float, float]:
    if "weights" not in run:
        return float("inf"), float("inf")
    return chaos.max_difference(run["weights"], clean["weights"]), chaos.max_difference(run["optimizer"], clean["optimizer"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--at", type=int, default=20, help="the step at which a node of every pipeline is killed")
    p.add_argument("--join-after", type=int, default=10, help="steps after the kill at which two nodes join")
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--keep", default=None, help="keep every run's files in this directory")
    p.add_argument("--plot", default=None, metavar="PNG", help="with --capacity-of: plot the fraction of live nodes "
                   "training against time")
    p.add_argument("--capacity-of", default=None, help="only print the capacity timelines of the runs kept in this "
                   "directory by an earlier --keep")
    args = p.parse_args()
    if args.capacity_of:
        for name in ("kill", "kill_join"):
            report = report_of(Path(args.capacity_of) / name)
            print(f"{name}:\n  " + "\n  ".join(capacity(report)))
            print(f"  {idle_spells(report, args.nodes)}")
        if args.plot:
            plot_capacity(Path(args.capacity_of), args.nodes, Path(args.plot))
        return 0
    if args.nodes % args.stages or args.nodes // args.stages < 2:
        raise SystemExit(f"--nodes {args.nodes} must be a multiple of --stages {args.stages}, with 2 or more pipelines")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bamboo-floor-"))
    root.mkdir(parents=True, exist_ok=True)
    pipelines, s = args.nodes // args.stages, args.stages
    # node i starts on stage i // pipelines of pipeline i % pipelines (the demo's layout, column by column):
    # pipeline q loses stage (1 + q) % stages (the first pipeline's failover is kept); for the reference every
    # pipeline but the first leaves. Then the second stage of every pipeline (they all fail over alike)
    victims = ",".join(f"node{((1 + q) % s) * pipelines + q}@{args.at}" for q in range(pipelines))
    alike = ",".join(f"node{min(1, s - 1) * pipelines + q}@{args.at}" for q in range(pipelines))
    leavers = ",".join(f"node{n}@{args.at - 1}:3" for n in range(args.nodes) if n % pipelines)
    joiners = ",".join(f"spare{i}@{args.at + args.join_after}" for i in range(1, 3))
    damaged = f"node{min(1, s - 1) * pipelines + pipelines - 1}"  # the second stage of the last pipeline
    print(f"demo GPT, AdamW, {args.nodes} nodes, {pipelines} pipelines of {s} stages, {args.steps} steps; "
          f"faults at step {args.at}", flush=True)
    common = {"stages": s, "steps": args.steps}
    clean = run_demo(root / "clean", args.nodes, **common)
    if clean["exit_code"] != 0:
        raise SystemExit(f"the clean run failed: exit {clean['exit_code']}; see {root / 'clean' / 'demo.log'}")
    runs = {
        "floor: one weight one ulp up at step 0": run_demo(root / "ulp", args.nodes, perturb=True, **common),
        "floor: one pipeline from step 0": run_demo(root / "one", s, **common),
        f"kill: a node of every pipeline at step {args.at} ({victims})": run_demo(root / "kill", args.nodes, preempt=victims, **common),
        f"kill, then {joiners} join": run_demo(root / "kill_join", args.nodes, preempt=victims, join=joiners, **common),
        f"kill: the same stage of every pipeline at step {args.at} ({alike})":
            run_demo(root / "kill_alike", args.nodes, preempt=alike, **common),
        f"reference: all pipelines but the first leave with a notice at step {args.at - 1} ({leavers})":
            run_demo(root / "leave", args.nodes, preempt=leavers, **common),
        f"one pipeline damaged: {damaged}@{args.at} killed": run_demo(root / "kill_one", args.nodes,
                                                                        preempt=f"{damaged}@{args.at}", **common),
        f"one pipeline damaged: {damaged} leaves with a notice at step {args.at - 1}":
            run_demo(root / "leave_one", args.nodes, preempt=f"{damaged}@{args.at - 1}:3", **common),
    }
    floors = [difference(r, clean)[0] for name, r in runs.items() if name.startswith("floor")]
    floor = max(floors)
    rows, ok = [], True
    for name, r in runs.items():
        weights, optimizer = difference(r, clean)
        samples = chaos.sample_problems(clean["samples"], r["samples"], args.steps) if "samples" in r else ["no samples"]
        rows.append({"run": name, "exit_code": r["exit_code"], "steps_completed": r["steps_completed"],
                     "failovers": r["failovers"], "weights_difference": weights, "optimizer_difference": optimizer,
                     "over_floor": weights / floor if floor else float("inf"), "sample_problems": len(samples)})
        judged = name.startswith(("kill", "reference", "one pipeline damaged"))
        ok &= r["exit_code"] == 0 and r["steps_completed"] == args.steps and not samples
        ok &= not judged or weights <= floor
    kill, reference = runs[next(n for n in runs if n.startswith("kill: a node"))], runs[next(n for n in runs if n.startswith("reference"))]
    # every pipeline lost the same stage: they all fail over alike, the pipelines never change, nothing regroups
    kill_alike = difference(runs[next(n for n in runs if n.startswith("kill: the same stage"))], clean)
    ok &= kill_alike == (0.0, 0.0)
    kill_vs_reference = (chaos.max_difference(kill["weights"], reference["weights"])
                         if "weights" in kill and "weights" in reference else float("inf"))
    # the kill's released nodes come back as a second pipeline at the step that sees them (timing decides which),
    # while the reference keeps one pipeline: the two agree within the floor, bit-equal only while their pipelines do
    ok &= kill_vs_reference <= floor
    # one damaged pipeline: the kill redoes its step in the layout the notice makes at the same boundary, and the
    # released survivors come back at the step that sees them (timing decides which; said below)
    one_kill, one_notice = (runs[next(n for n in runs if n.startswith("one pipeline damaged") and k in n)]
                            for k in ("killed", "notice"))
    one_vs_notice = (chaos.max_difference(one_kill["weights"], one_notice["weights"])
                     if "weights" in one_kill and "weights" in one_notice else float("inf"))
    admitted = [[c["step"] for c in report_of(root / name).get("reconfigurations", [])]
                for name in ("kill_one", "leave_one")]
    ok &= one_vs_notice == 0.0 if admitted[0] == admitted[1] else one_vs_notice <= floor
    for row in rows:
        print(json.dumps({"noise_floor_run": row}), flush=True)
    print(f"\n{'run':<78} {'exit':>4} {'steps':>5} {'w diff':>9} {'opt diff':>9} {'/ floor':>8} {'samples':>7}")
    for row in rows:
        print(f"{row['run'][:78]:<78} {row['exit_code']!s:>4} {row['steps_completed']:>5} {row['weights_difference']:>9.3g} "
              f"{row['optimizer_difference']:>9.3g} {row['over_floor']:>8.3f} {row['sample_problems']:>7}")
    for name in ("kill", "kill_join", "kill_alike"):
        report = report_of(root / name)
        print(f"capacity, {name}:\n  " + "\n  ".join(capacity(report)))
        print(f"  {idle_spells(report, args.nodes)}")
    print(f"\nnoise floor after {args.steps} steps (the larger of the two floor runs): {floor:.3g}")
    print(f"the kill against its notice reference (one pipeline from the same step; the kill's released nodes train "
          f"a second one from the step they are admitted at): max difference {kill_vs_reference:.3g}")
    print(f"the same stage of every pipeline killed against the clean run (every pipeline fails over alike): weights "
          f"{kill_alike[0]:.3g}, optimizer {kill_alike[1]:.3g}")
    print(f"one pipeline damaged, the kill against the same node's notice a step earlier (survivors admitted again at "
          f"steps {admitted[0]} and {admitted[1]}): max difference {one_vs_notice:.3g}")
    print("every fault within the floor, every step on the clean run's samples, every run exit 0, the kill within "
          "the floor of its reference, the same stage of every pipeline killed bit-equal to the clean run, the damaged pipeline's kill bit-equal to its notice where the survivors came back "
          f"at the same step (else within the floor): {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
