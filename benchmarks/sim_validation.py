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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lightning_bamboo.demo.events import events_from_trace
from lightning_bamboo.sim.demo import DemoPrediction, load_demo_params, replay_demo
from lightning_bamboo.sim.report import compare_with_demo, relative_error
from lightning_bamboo.sim.trace import bundled_trace, read_trace, slice_trace, write_trace

ROOT = Path(__file__).resolve().parents[1]
NODES = [f"node{i}" for i in range(6)]
MODES = {"bamboo": (), "no_redundancy": ("--no-redundancy",)}


def run_demo(trace_csv: Path, args: argparse.Namespace, extra: tuple[str, ...], out: Path) -> dict:
    report = out / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "lightning_bamboo.cli",
        "demo",
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
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        cmd,
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=1200,
        env=env,
        cwd=ROOT,
    )
    if not report.exists():
        raise RuntimeError(f"the demo wrote no report; run by hand: {' '.join(cmd)}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-hours", type=float, default=1.5, help="slice start in the p3 trace (hours)")
    parser.add_argument("--hours", type=float, default=1.0, help="slice length (trace hours)")
    parser.add_argument("--time-scale", type=float, default=30.0, help="trace seconds per demo second")
    parser.add_argument(
        "--steps", type=int, default=800, help="demo steps (a multiple of --checkpoint-every)"
    )
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--predict-only", action="store_true", help="print the predictions, run no demo")
    parser.add_argument("--save", default=None, help="write measured and predicted results to this JSON")
    args = parser.parse_args()
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
