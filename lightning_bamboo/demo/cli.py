"""``lightning-bamboo demo``: N local worker processes train a GPT while nodes are preempted and replaced."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_bamboo.demo.controller import drive
from lightning_bamboo.demo.events import (
    events_from_trace,
    parse_freeze,
    parse_join,
    parse_preempt,
)
from lightning_bamboo.demo.shape import DEMO_LAYERS, GLOBAL_BATCH, default_preempt, layout_for
from lightning_bamboo.errors import BambooConfigError

#: the command that makes a plan for the demo's model (the fix shown when a --plan does not fit it)
PLAN_HINT = "lightning-bamboo plan --example gpt --n-layer 6 --n-embd 48 --n-head 2 --block-size 16 --world-size N --json"


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
    parser.add_argument("--redundancy", choices=("off", "lazy", "eager", "auto"), default="lazy",
                        help="lazy (default): replicas, failover from them; eager: also the successor's forward in the "
                        "pipeline bubbles; auto: replicas only of stages with no data-parallel copy on another machine "
                        "(with several pipelines a loss drops the damaged one); off: no replicas, every loss restarts "
                        "from a checkpoint")
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
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout probability of the demo model's layers (default 0); a layer draws the same "
                        "masks on whichever node runs it, so --verify still compares bit for bit")
    parser.add_argument("--audit", action="store_true", help="compare every replica with its stage, bit for bit, "
                        "after every step and membership change; a difference stops the run naming layer, step, node")
    parser.add_argument("--warm-pool", type=int, default=2,
                        help="worker processes started ahead of need, their imports done, for nodes that join and "
                             "restarts that find no process ready (default 2; 0: each starts its own interpreter; "
                             "with --redundancy off none: checkpoint-restart starts new processes)")
    parser.add_argument("--detection-timeout", type=float, default=5.0,
                        help="seconds within which a node that stopped answering (frozen) is declared lost "
                             "(default 5; a SIGKILLed one is found at once); shorter finds hangs sooner and "
                             "mistakes a slow node for a lost one more easily")


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


@contextlib.contextmanager
def exit_on_stop_signals() -> Iterator[None]:
    """SIGTERM or SIGHUP end the demo (or a benchmark that runs demos, ``benchmarks/peers.py``) as Ctrl-C does:
    through its ``finally`` blocks, which kill every worker and standby process it started and remove its
    temporary folder (the default action would leave them running)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run(args: argparse.Namespace) -> int:
    with exit_on_stop_signals():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    args.worker_extra = _apply_plan(args)
    stages = args.stages or args.nodes
    if args.nodes < 1 or args.steps < 1:
        raise BambooConfigError(f"--nodes and --steps must be at least 1 (nodes: {args.nodes}, steps: {args.steps})")
    if not args.detection_timeout > 0:
        raise BambooConfigError(f"--detection-timeout must be a positive number of seconds (got {args.detection_timeout})")
    if args.warm_pool < 0:
        raise BambooConfigError(f"--warm-pool is a number of processes, 0 or more (got {args.warm_pool}); 0 turns it off")
    if not 0.0 <= args.dropout < 1.0:
        raise BambooConfigError(f"--dropout is a probability from 0 up to but not including 1 (got {args.dropout})")
    if args.nodes < stages:
        raise BambooConfigError(
            f"fewer nodes than one pipeline needs (nodes: {args.nodes}, stages: {stages}); use --stages {args.nodes}"
        )
    if args.nodes % stages:
        raise BambooConfigError(
            f"--nodes must be a multiple of --stages: the nodes form data-parallel pipelines of --stages stages "
            f"(nodes: {args.nodes}, stages: {stages}); use --nodes {stages * max(1, args.nodes // stages)}"
        )
    if layout_for(args.nodes, stages, args.nodes, args.global_batch, args.micro_batch)[0] != args.nodes:
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
        report = drive(args, stages, nodes, events, workdir)
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
    clean = drive(args, stages, nodes, [], workdir / "verify", prefix="verify")
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


def _check_store_reachable(url: str) -> None:
    from lightning_bamboo.membership import connect
    from lightning_bamboo.membership.keys import job_prefix

    store = connect(url, timeout=3.0)
    try:
        store.get(job_prefix("demo0") + "ping", timeout=3.0)  # under the demo's jobs: an etcd role may fence them
    finally:
        store.close()


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
