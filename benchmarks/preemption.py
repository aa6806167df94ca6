"""Bamboo vs checkpoint-restart on a compressed slice of the AWS p3 spot trace, in one run.

Both runs are `lightning-bamboo demo` on the same slice: the first 6 nodes of
lightning_bamboo/data/aws-p3-trace.csv train one 6-stage pipeline, the trace's removals kill
them (SIGKILL) and its later nodes join. "bamboo" keeps replicas, fails over, evens out the layers
and admits joining nodes into the running pipeline (RebalanceCallback);
"checkpoint-restart" (--no-redundancy) restarts every worker from the last checkpoint at every
membership change, as torchelastic and Varuna do. Prints useful samples/s of both, the ratio
and the recovery-time distribution. Targets (issue 4): ratio >= 2x, median recovery <= 5 s.

    python benchmarks/preemption.py [--steps 600] [--time-scale 100] [--stages 6]

``--stages 3`` trains the same 6 nodes as 2 data-parallel pipelines of 3 stages: Bamboo drops a
pipeline that lost a node and adds one back from standby nodes; checkpoint-restart restarts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from lightning_bamboo.testing.job_output import run_demo

TRACE = Path(__file__).resolve().parents[1] / "lightning_bamboo" / "data" / "aws-p3-trace.csv"


def demo(label: str, out: Path, args: argparse.Namespace, *extra: str) -> dict:
    report = out / f"{label}.json"
    demo_args = ["--nodes", "6", "--stages", str(args.stages), "--steps", str(args.steps), "--trace", str(TRACE),
                 "--time-scale", str(args.time_scale), "--checkpoint-every", str(args.checkpoint_every), "--quiet",
                 "--report", str(report), *extra]
    code = run_demo(demo_args, None, 1800)
    if not report.exists():
        raise RuntimeError(f"the demo ({label}) wrote no report (exit {code}); run it by hand: lightning-bamboo demo "
                           + " ".join(demo_args))
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--time-scale", type=float, default=100.0, help="trace seconds per real second")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--stages", type=int, default=6, help="pipeline depth: 6 (one pipeline) or 3 (two) or 2 (three)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bamboo = demo("bamboo", Path(tmp), args)
        restart = demo("restart", Path(tmp), args, "--no-redundancy")
    print(f"p3 trace, first 6 nodes in {6 // args.stages} pipeline(s) of {args.stages} stages, 1 trace second = "
          f"{1 / args.time_scale:.4f} s, {args.steps} steps of 8 samples; 2-core CPU, gloo")
    print(f"{'policy':<20}{'steps':>7}{'samples/s':>11}{'preempt':>9}{'failover':>9}{'ckpt':>6}{'restart':>8}"
          f"{'reconf':>7}{'recomputed':>11}{'median recov s':>15}")
    for name, r in (("bamboo", bamboo), ("checkpoint-restart", restart)):
        rec = r["recoveries"]
        median = statistics.median(r["recovery_seconds"]) if r["recovery_seconds"] else float("nan")
        print(f"{name:<20}{r['steps_completed']:>7}{r['samples_per_second']:>11.2f}{r['preemptions']:>9}"
              f"{rec['redundant']:>9}{rec['checkpoint']:>6}{rec['restart']:>8}{len(r['reconfigurations']):>7}"
              f"{r['recomputed_steps']:>11}{median:>15.2f}")
    print(f"useful throughput, bamboo / checkpoint-restart: {bamboo['samples_per_second'] / restart['samples_per_second']:.2f}x "
          f"(target >= 2x)")
    print("recovery seconds, bamboo: " + ", ".join(f"{s:.2f}" for s in bamboo["recovery_seconds"]))
    print("recovery seconds, checkpoint-restart: " + ", ".join(f"{s:.2f}" for s in restart["recovery_seconds"]))
    print("bamboo's live reconfigurations: " + (", ".join(
        f"step {c['step']} {str(c['reason']).split(':')[0]} ({len(c['order'])} nodes) {c['seconds']:.2f} s"
        for c in bamboo["reconfigurations"]) or "none"))


if __name__ == "__main__":
    main()
