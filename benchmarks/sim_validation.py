"""Validate the simulator against real `lightning-bamboo demo` runs of one compressed p3 trace slice.

A slice of lightning_bamboo/data/aws-p3-trace.csv (default: hours 1.5-2.5, 30 trace seconds per demo second) is replayed twice by
the demo (6 nodes in one pipeline, the trace's other nodes join as standby), with replicas and with
``--no-redundancy``, and twice by the simulator's demo model (lightning_bamboo.sim.demo.replay_demo)
with the demo-scale parameters that benchmarks/sim_calibrate.py measured. Prints predicted vs
measured samples/s (the demo runs a fixed number of steps, so its speed is what is predicted) and
recoveries, with the relative errors; the target is <= 15%.

The simulator sees exactly the events the demo sees (lightning_bamboo.demo.events.events_from_trace
on the same slice and time scale). Run on the machine that was calibrated.

    python benchmarks/sim_validation.py [--start-hours 1.5] [--hours 1] [--time-scale 30] [--steps 800] [--predict-only]

``--cluster`` validates the cluster simulator instead (lightning_bamboo.sim.simulate.run_policy, the
policies of ``lightning-bamboo simulate``): the demo runs 2 pipelines of 3 stages (``--stages 3``) on
the slice, with replicas and without, and the simulator replays the same events with that run's
measured inputs: the run's own 2 x 3 step time (the median over windows of `--checkpoint-every` steps
before its first preemption, so each holds a save; redundancy included: separate clean runs drift by up to a third on this machine from one to the
next), the step time of a clean 1 x 3 run of the same mode (on 2 shared cores one pipeline of 3
processes is faster than two, where the 1F1B formula for nodes with their own accelerators says
slower), the run's own mean recovery time (failover or restart), and the demo-scale join and reconfiguration
times of benchmarks/sim_calibrate.py (a released survivor's standby restart is a join). The layout
decisions, rollbacks and pauses are the simulator's. The run without replicas is replayed with the ``elastic``
policy (a restart from the last checkpoint to take in a join, as the demo does), its rows named ``checkpoint``.
Target: samples/s within 15% for both policies.

    python benchmarks/sim_validation.py --cluster [--repeats 2] [--steps 600] [--clean-steps 200]

``--cluster --mtbf 5m,10m`` checks the ETTR of ``lightning-bamboo simulate --sweep mtbf=...`` the same way:
instead of the p3 slice, a synthetic trace per value (the simulator's ``--generate`` model, 6 nodes whose
cluster loses one every MTBF on average, replacements after ``--replacement-delay`` trace seconds),
compressed by ``--time-scale``. One more demo run per repeat is the reference: the same 6 nodes, no
preemption, no replicas and no checkpoints, whose samples/s stands for on-demand's. It prints each
policy's ETTR measured (its samples/s over the reference's) and predicted (the simulator's over the
same reference); the target is within 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from lightning_bamboo.demo.events import events_from_trace
from lightning_bamboo.sim.demo import DemoPrediction, load_demo_params, replay_demo
from lightning_bamboo.sim.report import compare_with_demo, relative_error
from lightning_bamboo.sim.trace import bundled_trace, read_trace, slice_trace, write_trace
from lightning_bamboo.testing.job_output import run_demo as run_demo_process

ROOT = Path(__file__).resolve().parents[1]
NODES = [f"node{i}" for i in range(6)]
MODES = {"bamboo": (), "no_redundancy": ("--no-redundancy",)}


def run_demo(trace_csv: Path, args: argparse.Namespace, extra: tuple[str, ...], out: Path) -> dict:
    report = out / "report.json"
    cmd = [
        "--nodes",
        str(len(NODES)),
        "--steps",
        str(args.steps),
        "--trace",
        str(trace_csv),
        "--time-scale",
        str(args.time_scale),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--quiet",
        "--report",
        str(report),
        # the simulator's demo model starts each joined node's interpreter when it joins (no warm pool)
        "--warm-pool",
        "0",
        *extra,
    ]
    code = run_demo_process(cmd, None, 1200, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    if not report.exists():
        raise RuntimeError(f"the demo wrote no report (exit {code}); run by hand: lightning-bamboo demo {' '.join(cmd)}")
    return json.loads(report.read_text())


def predict(trace_csv: Path, args: argparse.Namespace, redundancy: bool) -> DemoPrediction:
    events = events_from_trace(read_trace(trace_csv), NODES, args.time_scale)
    return replay_demo(
        events,
        NODES,
        load_demo_params(),
        args.steps,
        redundancy=redundancy,
        checkpoint_every=args.checkpoint_every,
    )


def rows(name: str, measured: dict, predicted: DemoPrediction) -> list[str]:
    check = compare_with_demo(measured, predicted)
    m_rec, p_rec = measured["recoveries"], predicted.recoveries
    m_wall = measured["steps_completed"] * 8 / measured["samples_per_second"]
    out = [
        f"| {name} | samples/s | {measured['samples_per_second']:.2f} | {predicted.samples_per_second:.2f} | "
        f"{check.rate_error:.1%} |",
        f"| {name} | wall s (first step -> end) | {m_wall:.1f} | {predicted.seconds:.1f} | "
        f"{relative_error(predicted.seconds, m_wall):.1%} |",
        f"| {name} | steps completed | {measured['steps_completed']} | {predicted.steps_completed} | {check.steps_error:.1%} |",
        f"| {name} | recoveries redundant/checkpoint/restart | {m_rec['redundant']}/{m_rec['checkpoint']}/{m_rec['restart']} | "
        f"{p_rec['redundant']}/{p_rec['checkpoint']}/{p_rec['restart']} | {check.recoveries_error:.1%} (total) |",
        f"| {name} | preemptions of running nodes | {measured['preemptions']} | {predicted.preemptions} | "
        f"{relative_error(predicted.preemptions, measured['preemptions']):.1%} |",
        f"| {name} | recomputed steps | {measured['recomputed_steps']} | {predicted.recomputed_steps} | "
        f"{relative_error(predicted.recomputed_steps, measured['recomputed_steps']):.1%} |",
    ]
    return out


CLUSTER_NODES = [f"node{i}" for i in range(6)]
#: the demo's --no-redundancy restarts everyone from the last checkpoint to take in a join, as torchrun does (``elastic``;
#: the simulator's ``checkpoint`` saves before it grows)
CLUSTER_MODES = {"bamboo": ("bamboo", ()), "checkpoint": ("elastic", ("--no-redundancy",))}


def run_cluster_demo(
    trace_csv: Path | None, steps: int, extra: tuple[str, ...], out: Path, args: argparse.Namespace, nodes: int = 6
) -> dict:
    """One demo run of ``nodes`` nodes as pipelines of 3 stages (``trace_csv`` None: no preemption)."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.json"
    source = ["--trace", str(trace_csv), "--time-scale", str(args.time_scale)] if trace_csv else ["--preempt", ""]
    cmd = [
        "--nodes", str(nodes), "--stages", "3",
        "--steps", str(steps), "--checkpoint-every", str(args.checkpoint_every), "--quiet",
        "--report", str(report), "--warm-pool", "0", *source, *extra,  # the simulator models no warm pool
    ]
    code = run_demo_process(cmd, None, 1200, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    if not report.exists():
        raise RuntimeError(f"the demo wrote no report (exit {code}); run by hand: lightning-bamboo demo {' '.join(cmd)}")
    return json.loads(report.read_text())


def cluster_trace(trace_csv: Path, time_scale: float, ready: float):
    """The demo's view of the slice as a simulator trace, shifted so that its first step is at ``ready``: its six
    nodes, and a joining node started only while fewer than six nodes plus one spare run (``STANDBY_PROCESSES``)."""
    from lightning_bamboo.demo.shape import STANDBY_PROCESSES
    from lightning_bamboo.sim.demo import run_trace

    events = events_from_trace(read_trace(trace_csv), CLUSTER_NODES, time_scale)
    return run_trace(events, CLUSTER_NODES, len(CLUSTER_NODES) + STANDBY_PROCESSES, ready, f"{trace_csv.name} (demo view)")


def own_step_seconds(report: dict, window: int) -> float:
    """Seconds per step of a demo run before its first preemption (all of it without one), from its report: the
    median over every ``window`` consecutive steps (a window holds one checkpoint save), so that a transient
    (a standby process starting) does not set it."""
    times = report["step_times"]
    until = report["preemption_steps"][0] if report["preemption_steps"] else times[-1][0]
    seen: dict[int, float] = {}
    previous = 0
    for step, t in times:  # steps finished since the last poll were all seen at this poll
        for s in range(previous + 1, step + 1):
            seen[s] = t
        previous = step
    first = min(seen)
    spans = [(seen[s + window] - seen[s]) / window for s in range(first, until - window + 1) if s + window in seen]
    if len(spans) < 5:
        raise RuntimeError(f"the demo run finished too few steps before its first preemption (step {until})")
    return statistics.median(spans)


def predict_cluster(trace_csv: Path, policy: str, single: dict, measured: dict, args: argparse.Namespace) -> dict:
    """Replay the demo's events with the cluster simulator and this run's measured inputs (``measured``'s own
    2 x 3 step time; ``single``: a clean pipeline of 3, which on 2 shared cores is faster, not slower)."""
    from lightning_bamboo.sim.params import SimParams
    from lightning_bamboo.sim.simulate import run_policy

    demo = load_demo_params()
    step = own_step_seconds(measured, args.checkpoint_every)
    recoveries = measured.get("recovery_seconds") or [0.0]
    recovery = sum(recoveries) / len(recoveries)
    ready = demo.join_seconds
    params = SimParams(
        stages=3, min_stages=2, layers=8, micro_batch_size=2, global_micro_batches=4, step_seconds=step,
        step_pipelines=2, single_pipeline_step_seconds=own_step_seconds(single, args.checkpoint_every), redundancy_overhead=0.0, failover_seconds=recovery, restart_seconds=recovery,
        reconfigure_seconds=demo.reconfigure_seconds, checkpoint_save_seconds=0.0,
        checkpoint_interval_seconds=args.checkpoint_every * step,
        bamboo_checkpoint_interval_seconds=args.checkpoint_every * step, node_ready_seconds=ready,
        rejoin_seconds=ready,  # a released survivor restarts as a standby process: a join's start-up
    )
    trace = cluster_trace(trace_csv, args.time_scale, ready)
    target = (measured["steps_completed"] - 1) * 8
    end = ready + 50 * target * step / 8  # the demo's global batch is 8 samples
    result, _ = run_policy(policy, trace, params.replace(hours=end / 3600), end)
    done = None
    points = list(result.timeline)
    for i, a in enumerate(points):
        if a.samples >= target:
            done = a.seconds
            break
        stop = points[i + 1].seconds if i + 1 < len(points) else end
        if a.rate > 0 and a.samples + a.rate * (stop - a.seconds) >= target - 1e-9:
            done = a.seconds + (target - a.samples) / a.rate
            break
    if done is None:
        raise RuntimeError(f"the simulated {policy} run does not reach {target} samples in {end:.0f} s")
    # recoveries and preemptions as far as the simulated run goes (the demo's counts end with its run)
    result, _ = run_policy(policy, trace, params.replace(hours=done / 3600), done)
    return {
        "samples_per_second": target / (done - ready), "wall": done - ready, "step_seconds": step,
        "single_step_seconds": params.single_pipeline_step_seconds,
        "recovery_seconds": recovery, "recoveries": dict(result.recoveries), "preemptions": result.preemptions,
    }


def validate_cluster(args: argparse.Namespace) -> None:
    if args.mtbf:
        from lightning_bamboo.sim.sweep import mtbf_trace, parse_duration

        pieces = [(f"mtbf {text}", mtbf_trace(parse_duration(text), len(CLUSTER_NODES), args.hours,
                                              args.replacement_delay, args.seed)) for text in args.mtbf.split(",")]
    else:
        start = args.start_hours * 3600
        pieces = [("p3", slice_trace(read_trace(bundled_trace("p3")), start, start + args.hours * 3600))]
    for label, piece in pieces:
        print(
            f"cluster simulator vs demo, 2 pipelines x 3 stages; {label}: {piece.source}, {len(piece.nodes)} nodes, "
            f"{piece.removals} removals; 1 demo s = {args.time_scale:g} trace s; {args.steps} steps of 8 samples, "
            f"checkpoint every {args.checkpoint_every}; clean runs of {args.clean_steps} steps"
        )
    print("\n| trace | repeat | policy | step s (2 x 3 own, 1 x 3 clean) | recovery s (mean) | measured samples/s | "
          "predicted samples/s | error | ETTR measured / predicted | recoveries measured / predicted | "
          "preemptions measured / predicted |\n|---|---|---|---:|---:|---:|---:|---:|---|---|---|")
    worst: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, (label, piece) in enumerate(pieces):
            csv = Path(tmp) / f"trace{index}.csv"
            write_trace(piece, csv)
            validate_piece(label, csv, Path(tmp) / f"runs{index}", args, worst)
    ok = all(e <= 0.15 for e in worst.values())
    print("\nlargest error per policy: " + ", ".join(f"{k} {v:.1%}" for k, v in worst.items()))
    what = "samples/s and ETTR" if args.mtbf else "samples/s"
    print(f"{what} within 15% for both policies in every repeat: {'yes' if ok else 'NO'}")


def validate_piece(label: str, csv: Path, tmp: Path, args: argparse.Namespace, worst: dict[str, float]) -> None:
    """The repeats of both policies on one trace; a row each."""
    for repeat in range(1, args.repeats + 1):
        reference = None
        if args.mtbf:  # on-demand's stand-in: the same nodes, nothing lost, nothing saved, no replicas
            clean = run_cluster_demo(None, args.clean_steps, ("--no-redundancy", "--checkpoint-every", "1000000"),
                                     tmp / f"reference{repeat}", args)
            reference = clean["samples_per_second"]
        for name, (policy, extra) in CLUSTER_MODES.items():
            base = tmp / f"{name}{repeat}"
            single = run_cluster_demo(None, args.clean_steps, extra, base / "single", args, nodes=3)
            measured = run_cluster_demo(csv, args.steps, extra, base / "trace", args)
            predicted = predict_cluster(csv, policy, single, measured, args)
            error = relative_error(predicted["samples_per_second"], measured["samples_per_second"])
            worst[name] = max(worst.get(name, 0.0), error)
            m_rec, p_rec = measured["recoveries"], predicted["recoveries"]
            ettr = (f"{measured['samples_per_second'] / reference:.3f} / {predicted['samples_per_second'] / reference:.3f}"
                    if reference else "n/a")
            print(
                f"| {label} | {repeat} | {name} | {predicted['step_seconds']:.3f}, {predicted['single_step_seconds']:.3f} | "
                f"{predicted['recovery_seconds']:.2f} | "
                f"{measured['samples_per_second']:.2f} | {predicted['samples_per_second']:.2f} | {error:.1%} | {ettr} | "
                f"{m_rec['redundant']}/{m_rec['checkpoint']}/{m_rec['restart']} / "
                f"{p_rec['redundant']}/{p_rec['checkpoint']}/{p_rec['restart']} | "
                f"{measured['preemptions']} / {predicted['preemptions']} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", action="store_true", help="validate the cluster simulator (see above)")
    parser.add_argument("--repeats", type=int, default=2, help="--cluster: validations in a row")
    parser.add_argument("--clean-steps", type=int, default=200, help="--cluster: steps of each clean run")
    parser.add_argument("--start-hours", type=float, default=1.5, help="slice start in the p3 trace (hours)")
    parser.add_argument("--hours", type=float, default=1.0, help="slice length (trace hours)")
    parser.add_argument("--time-scale", type=float, default=30.0, help="trace seconds per demo second")
    parser.add_argument(
        "--steps", type=int, default=800, help="demo steps (a multiple of --checkpoint-every)"
    )
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--mtbf", default="", help="--cluster: synthetic traces at these mean times between failures "
                        "of the whole cluster, in trace time (e.g. 5m,10m), instead of the p3 slice; prints ETTR")
    parser.add_argument("--replacement-delay", type=float, default=60.0,
                        help="--mtbf: mean trace seconds until a preempted node's replacement is added")
    parser.add_argument("--seed", type=int, default=0, help="--mtbf: the synthetic traces' seed")
    parser.add_argument("--predict-only", action="store_true", help="print the predictions, run no demo")
    parser.add_argument("--save", default=None, help="write measured and predicted results to this JSON")
    args = parser.parse_args()
    if args.cluster:
        validate_cluster(args)
        return
    start = args.start_hours * 3600
    piece = slice_trace(read_trace(bundled_trace("p3")), start, start + args.hours * 3600)
    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "slice.csv"
        write_trace(piece, csv)
        print(
            f"slice: {piece.source}, {len(piece.nodes)} nodes, {piece.removals} removals; 1 demo s = "
            f"{args.time_scale:g} trace s; {args.steps} steps of 8 samples, checkpoint every {args.checkpoint_every}"
        )
        results = {}
        for name, extra in MODES.items():
            predicted = predict(csv, args, redundancy=not extra)
            print(
                f"{name}: predicted {predicted.samples_per_second:.2f} samples/s, {predicted.seconds:.1f} s, "
                f"recoveries {predicted.recoveries}; "
                + "; ".join(f"{t:.1f}s {w}" for t, w in predicted.timeline)
            )
            measured = None if args.predict_only else run_demo(csv, args, extra, Path(tmp))
            results[name] = (measured, predicted)
    if args.predict_only:
        return
    print("\n| run | quantity | measured (demo) | predicted (simulator) | error |\n|---|---|---:|---:|---:|")
    for name, (measured, predicted) in results.items():
        print("\n".join(rows(name, measured, predicted)))
    ok = all(compare_with_demo(m, p).rate_error <= 0.15 for m, p in results.values())
    print(f"\nsamples/s within 15% for both runs: {'yes' if ok else 'NO'}")
    if args.save:
        Path(args.save).write_text(
            json.dumps(
                {k: {"measured": m, "predicted": {**vars(p)}} for k, (m, p) in results.items()},
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
