"""Memory a user can plan for: every node's predicted and measured peak, through a kill (issue 64).

A GPT of GPT-2's shape (the embedding tied to the head, ``gpt_layer_specs(tie_embeddings=True)``: small is 12 x 768,
medium 24 x 1024, vocabulary 50257) trains in 4 stages cut by parameters under the Bamboo launcher, micro-batch 1,
4 micro-batches, torch's default AdamW; ``--kill-at K``: node2 is SIGKILLed at the start of step K and the job fails
over, then goes on to ``--steps``. For every configuration (shape x redundancy x activation checkpointing) and every
node this prints:

- predicted: ``planner.memory`` before any job runs, from the layers' sizes measured here (one forward of one layer of
  each kind, ``planner.profile.memory_of_layers``), for the node's stage in the layout it starts in and in the one the
  failover leaves (the larger is its peak), by owner;
- measured: the worker's peak RSS (``VmHWM``) before the kill and over the run, and what its communication processes
  add (their anonymous memory, a page counted once between the zygote and its child: ``Pss_Anon``);
- the ratio of measured to predicted peak, and what the model leaves unexplained (measured - predicted, in % of the
  measured peak). Target: within 10% on every node, the unexplained part under 5%.

Then, at GPT-2 small with sequence 128, what ``lazy`` adds per process over ``off``: what its replica costs (the
model's replica owner: weights, AdamW's moments, its update's temporaries) and what the rest costs.

    python benchmarks/memory.py [--shapes small-32,small-128,medium-128] [--modes off,lazy,eager] [--checkpointing 0,1]
                                [--kill-at 4] [--steps 10] [--skip small-32:eager,...] [--tree DIR] [--reports DIR]

``--tree DIR``: measure the ``lightning_bamboo`` of another source tree (``git archive COMMIT | tar -x -C DIR``: the
code before a cut), predicted by this one's model.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys
import tempfile
from pathlib import Path

GiB = 2**30
SHAPES = {"small": (12, 768, 12), "medium": (24, 1024, 16)}  # layers, width, heads
VOCAB, STAGES, MICRO_BATCHES, VICTIM = 50257, 4, 4, "node2"
TARGET, UNEXPLAINED = 0.10, 0.05
HEADROOM = GiB  # beside the job's nodes: the launcher, etcd, this script


def _descendants(pid: int) -> list[int]:
    """Every process ``pid`` started, and theirs (the communication processes: the zygote and its child)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def _anonymous(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def proc_status(field: str, pid: int | str = "self") -> int:
    """A ``/proc/PID/status`` field in bytes (0: the process is gone), read here rather than with the runtime's
    helper so that ``--tree`` can measure a tree from before it existed."""
    with contextlib.suppress(OSError):
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields.get(field, "0 kB").split()[0]) * 1024
    return 0


def worker(args: argparse.Namespace) -> None:
    import lightning_bamboo
    import lightning_bamboo.runtime  # noqa: F401  (torch and the runtime: what "before" has counted from the first)

    before = proc_status("VmRSS")  # imports done, nothing built
    import lightning.pytorch as pl
    import torch

    from lightning_bamboo.models.gpt import GPTConfig, gpt_layer_specs, gpt_loss

    layers, width, heads = SHAPES[args.shape]
    cfg = GPTConfig(vocab_size=VOCAB, block_size=args.block, n_layer=layers, n_head=heads, n_embd=width)
    node = os.environ.get("BAMBOO_NODE", "rank0")
    report: dict = {"node": node, "before": before, "steps": []}

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4 * MICRO_BATCHES * args.steps

        def __getitem__(self, i: int):
            row = torch.randint(0, VOCAB, (args.block + 1,), generator=torch.Generator().manual_seed(i))
            return row[:-1], row[1:]

    class GPT(pl.LightningModule):
        def configure_pipeline(self):
            return gpt_layer_specs(cfg, tie_embeddings=True)

        def pipeline_loss(self, outputs, targets):
            return gpt_loss(outputs, targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Tokens(), batch_size=MICRO_BATCHES)

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, *rest) -> None:
            runner = trainer.strategy.runner
            engine = trainer.strategy.engine
            comm = [pid for pid in _descendants(os.getpid())]
            report["steps"].append({
                "step": trainer.global_step, "peak": proc_status("VmHWM"), "rss": proc_status("VmRSS"),
                "failovers": len(runner.failovers), "layers": [engine.layer_range.start, engine.layer_range.stop],
                "replica": [engine.replica.layers.start, engine.replica.layers.stop] if engine.replica else None,
                "forwards": engine.redundant_forwards_run,
                "communication": sum(_anonymous(pid) for pid in comm),
                "communication_rss": sum(proc_status("VmRSS", pid) for pid in comm)})
            Path("/proc/self/clear_refs").write_text("5")  # the next step's peak is its own (VmHWM from now on)

    strategy = lightning_bamboo.BambooStrategy(stages=STAGES, redundancy=args.mode, partition="parameters",
                                               micro_batch_size=1, seed=0, activation_checkpointing=args.checkpointing)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", STAGES)),
                         max_steps=args.steps, callbacks=[Watch()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(GPT())
    Path(args.out, f"{node}.json").write_text(json.dumps(report))


@functools.cache
def layer_memory(shape: str, block: int) -> tuple:
    """The model's layers as ``planner.memory`` sees them, measured on one layer of each kind (every block is alike)."""
    import torch

    from lightning_bamboo.models.gpt import Block, Embedding, FinalNorm, GPTConfig, tied_logits
    from lightning_bamboo.planner.profile import memory_of_layers

    layers, width, heads = SHAPES[shape]
    cfg = GPTConfig(vocab_size=VOCAB, block_size=block, n_layer=1, n_head=heads, n_embd=width)
    embedding = Embedding(cfg, init_std=0.02)
    kinds = memory_of_layers([embedding, Block(cfg), FinalNorm(cfg), functools.partial(tied_logits, embedding)],
                             torch.zeros(1, block, dtype=torch.long), ties={"embed": (0, 3)})
    return (kinds[0], *[kinds[1]] * layers, kinds[2], kinds[3])


def parts_of(shape: str, block: int) -> tuple[int, ...]:
    """The layout the strategy cuts (``partition="parameters"``, DeepSpeed's balanced split)."""
    from lightning_bamboo.engine.partition import compute_parts

    layers = layer_memory(shape, block)
    return tuple(compute_parts("parameters", STAGES, [layer.params for layer in layers], ["layer"] * len(layers)))


def predict(shape: str, block: int, mode: str, every: int, parts: tuple[int, ...], stage: int):
    from lightning_bamboo.planner.memory import node_memory
    from lightning_bamboo.schedule import build_schedule

    stages = len(parts) - 1
    forwards = None
    if mode == "eager" and stages > 1:  # the schedule's redundant forwards with the model's costs (F = 1, B = 2)
        forwards = len(build_schedule(stages, MICRO_BATCHES, "eager").redundant_forwards(stage))
    return node_memory(layer_memory(shape, block), parts, stage, MICRO_BATCHES, redundancy=mode,
                       checkpoint_every=every, eager_forwards=forwards)


def with_failover(memory, shape: str, block: int, mode: str, before: tuple[int, ...], stage: int,
                  after: tuple[int, ...], new_stage: int):
    """``memory`` with the failover's phase: the node still holds its old stage and replica while the ring sends it
    the layers its new replica lacks and it sends its predecessor those it lacks (one layer per message)."""
    import dataclasses

    from lightning_bamboo.planner.memory import moving_memory

    def stage_layers(parts: tuple[int, ...], k: int) -> set[int]:
        return set(range(parts[k], parts[k + 1]))

    old_p, new_p = len(before) - 1, len(after) - 1
    held = stage_layers(before, stage) | stage_layers(before, (stage + 1) % old_p)
    receives = stage_layers(after, (new_stage + 1) % new_p) - held
    predecessor = after[(new_stage - 1) % new_p]  # the first layer of its new predecessor's stage
    old_of = next(k for k in range(old_p) if before[k] <= predecessor < before[k + 1])
    sends = stage_layers(after, new_stage) - (stage_layers(before, old_of) | stage_layers(before, (old_of + 1) % old_p))
    phase = moving_memory(layer_memory(shape, block), before, stage, sorted(receives | sends), redundancy=mode)
    return dataclasses.replace(memory, phases=(*memory.phases, phase))


def with_previous_stage(memory, shape: str, block: int, before: tuple[int, ...], stage: int):
    """``memory`` through a restart (``off`` after a fatal loss): the previous stage's weights and optimizer state stay
    referenced by the framework's objects of the fit before (its optimizer, the module's stage) until the first step
    after the restart has run, beside the new stage."""
    import dataclasses

    from lightning_bamboo.planner.memory import Item, Phase

    layers = layer_memory(shape, block)
    previous = Item("stage", "the stage before the restart, through its first step",
                    12 * sum(layers[i].params for i in range(before[stage], before[stage + 1])))
    return dataclasses.replace(memory, phases=tuple(Phase(p.name, (*p.items, previous)) for p in memory.phases))


def machine_need(shape: str, block: int, mode: str, every: int) -> int:
    """What the job's nodes need of the machine together as they start, by the model: every stage's predicted peak,
    its worker's and its communication process's, less the replica's gradient halves, which are its owner's own
    halves mapped once more (shared memory on one host, counted in both RSS, held once)."""
    parts = parts_of(shape, block)
    memories = [predict(shape, block, mode, every, parts, k) for k in range(STAGES)]
    shared = sum(item.bytes for m in memories for item in m.peak.items
                 if item.what == "replica's gradients' shared halves")
    return sum(m.peak_bytes + m.communication_bytes for m in memories) - shared


def job_name(shape: str, block: int, mode: str, every: int) -> str:
    """A configuration's name, and its folder under ``--reports``."""
    return f"{shape}-{block}-{mode}-{every}"


def run(args: argparse.Namespace, shape: str, block: int, mode: str, every: int) -> list[dict]:
    from common import run_under_launcher, self_command

    name = job_name(shape, block, mode, every)
    if args.reports is not None and Path(args.reports, name, "output.txt").exists():  # measured before: predict again
        out_dir = Path(args.reports, name)
        output = (out_dir / "output.txt").read_text()
        reports = [json.loads(p.read_text()) for p in sorted(out_dir.glob("node*.json"))]
    else:
        with tempfile.TemporaryDirectory() as out:
            worker_cmd = self_command(__file__, "worker", "--out", out, "--shape", shape, "--block", block, "--mode",
                                      mode, "--checkpointing", every, "--steps", args.steps)
            proc = run_under_launcher(STAGES, worker_cmd, [f"{VICTIM}@{args.kill_at}"] if args.kill_at else [],
                                      tree=args.tree, env={"BAMBOO_LOG_LEVEL": "INFO"})
            output = proc.stdout
            reports = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
            if args.reports is not None:
                kept = Path(args.reports, name)
                kept.mkdir(parents=True, exist_ok=True)
                (kept / "output.txt").write_text(output)
                for report in reports:
                    (kept / f"{report['node']}.json").write_text(json.dumps(report))
    codes = [line for line in output.splitlines() if "exit codes" in line]
    told = [line.strip() for line in output.splitlines() if "memory after" in line]
    if not reports or len(reports) < STAGES - (1 if args.kill_at else 0):
        print(f"  the job failed: {codes[-1] if codes else ''}\n{output[-3000:]}")
        return []
    parts = parts_of(shape, block)
    started_as = sorted(r["steps"][0]["layers"][0] for r in reports)
    if args.kill_at and [b for i, b in enumerate(parts[:-1]) if i != int(VICTIM[4:])] != started_as:
        print(f"  (the job started in another layout than {list(parts)}: {started_as})")
    # the layout the failure left: a lazy or eager failover's, or (off) a restart's; as the survivors ran it
    ended_as = sorted(r["steps"][-1]["layers"][0] for r in reports)
    after = (*ended_as, parts[-1])
    rows = []
    for r in reports:
        k = int(r["node"][4:])
        steps = r["steps"]
        started = [s for s in steps if not s["failovers"]]
        before = max((s["peak"] for s in started), default=0)
        measured = max(s["peak"] for s in steps)
        first = predict(shape, block, mode, every, parts, k)
        pre = {"layout": parts, "stage": k, "memory": first}
        post = None
        if args.kill_at and any(s["failovers"] for s in steps):
            stage = ended_as.index(steps[-1]["layers"][0])
            memory = predict(shape, block, mode, every, after, stage)
            if mode != "off":  # the failover's layers in transit: those its new replica lacks, those it sends
                memory = with_failover(memory, shape, block, mode, parts, k, after, stage)
            else:  # a restart: its previous stage is held through the first step after it (see docs/memory.md)
                memory = with_previous_stage(memory, shape, block, parts, k)
            post = {"layout": after, "stage": stage, "memory": memory}
        worst = max([pre] + ([post] if post else []), key=lambda x: x["memory"].peak_bytes)
        rows.append({"node": r["node"], "steps": steps, "before": r["before"], "measured_before": before,
                     "measured": measured, "communication": max(s["communication"] for s in steps),
                     "pre": pre, "post": post, "worst": worst, "told": [t for t in told if r["node"] + ":" in t]})
    print(codes[-1] if codes else "(no exit codes)")
    return rows


def _span(r: list | None) -> str:
    return f"{r[0]}-{r[1] - 1}" if r else "-"


def show(rows: list[dict], label: str) -> list[float]:
    from lightning_bamboo.planner.memory import OWNERS

    errors = []
    print(f"{'node':<6}{'layers':>10}{'replica':>10}{'predicted':>11}{'measured':>10}{'ratio':>7}{'unexpl.':>9}"
          f"{'comm p/m':>12}  predicted peak by owner (GiB), at its phase")
    for row in rows:
        first, last = row["steps"][0], row["steps"][-1]
        worst = row["worst"]["memory"]
        predicted, measured = worst.peak_bytes, row["measured"]
        ratio = measured / predicted
        unexplained = (measured - predicted) / measured
        errors.append(ratio)
        layers = _span(first["layers"]) + ("->" + _span(last["layers"]) if last["layers"] != first["layers"] else "")
        replica = _span(first["replica"]) + ("->" + _span(last["replica"]) if last["replica"] != first["replica"] else "")
        owners = ", ".join(f"{o} {v / GiB:.2f}" for o, v in worst.peak.by_owner().items() if v and o in OWNERS)
        where = "after the failover" if row["post"] is not None and row["worst"] is row["post"] else "as started"
        print(f"{row['node']:<6}{layers:>10}{replica:>10}{predicted / GiB:>10.2f} {measured / GiB:>9.2f} {ratio:>6.2f}"
              f"{100 * unexplained:>8.1f}%{worst.communication_bytes / GiB:>6.2f}/{row['communication'] / GiB:.2f}"
              f"  {owners}; {worst.peak.name}, {where}")
        print(f"{'':<6}  each step's peak: " + " ".join(
            f"{'F' if s['failovers'] else ''}{s['peak'] / GiB:.2f}" for s in row["steps"]))
        if row["post"] is not None:
            pre = row["pre"]["memory"].peak_bytes
            print(f"{'':<6}{'':>20}  before the kill: predicted {pre / GiB:.2f}, measured "
                  f"{row['measured_before'] / GiB:.2f} ({row['measured_before'] / pre:.2f}); baseline measured "
                  f"{row['before'] / GiB:.2f}")
        for line in row["told"]:
            print(f"{'':<6}  logged: {line[line.index('memory after'):][:240]}")
    return errors


def main() -> int:
    from common import add_worker_flag

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_worker_flag(parser)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="small", help=argparse.SUPPRESS)
    parser.add_argument("--block", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="lazy", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="small-32,small-128,medium-128", help="SHAPE-SEQUENCE, comma-separated")
    parser.add_argument("--modes", default="off,lazy,eager")
    parser.add_argument("--checkpointing", default="0,1", help="activation checkpointing's layers per segment (0: off)")
    parser.add_argument("--kill-at", type=int, default=4, help="node2 is SIGKILLed at the start of this step (0: none)")
    # a node's peak settles in its third step in a stage (AdamW's moments come with the first update, the exchange's
    # halves and the replica's with the first steps they serve): 6 steps after the kill measure the failover's peak
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tree", default=None, help="the source tree whose lightning_bamboo the job runs")
    parser.add_argument("--skip", default="", metavar="SHAPE-SEQUENCE:MODE,...",
                        help="configurations not to run (e.g. medium-128:lazy: a machine without the memory for them)")
    parser.add_argument("--reports", default=None, metavar="DIR",
                        help="keep each job's reports and output in DIR; a configuration found there is not run again, "
                             "only predicted again")
    args = parser.parse_args()
    if args.role == "worker":
        args.checkpointing = int(args.checkpointing)
        worker(args)
        return 0
    import psutil

    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this tree's model
    every_of = [int(e) for e in args.checkpointing.split(",")]
    print(f"GPT-2 shapes, vocabulary {VOCAB}, embedding tied to the head; {STAGES} stages by parameters under the "
          f"launcher, micro-batch 1 x {MICRO_BATCHES}, AdamW; {VICTIM} SIGKILLed at step {args.kill_at}, "
          f"{args.steps} steps" + (f"; code of {args.tree}" if args.tree else ""))
    ratios: list[float] = []
    peaks: dict[tuple, dict[str, dict]] = {}
    for spec in args.shapes.split(","):
        shape, block = re.fullmatch(r"(\w+)-(\d+)", spec).groups()  # type: ignore[union-attr]
        for every in every_of:
            for mode in args.modes.split(","):
                if f"{spec}:{mode}" in args.skip.split(","):
                    if every == every_of[0]:
                        print(f"\nnot run: GPT-2 {shape}, sequence {block}, {mode} (--skip)")
                    continue
                label = (f"GPT-2 {shape} ({SHAPES[shape][0]} x {SHAPES[shape][1]}), sequence {block}, {mode}, "
                         f"activation checkpointing {'every ' + str(every) + ' layer(s)' if every else 'off'}")
                print(f"\n{label}")
                needed, available = machine_need(shape, int(block), mode, every), psutil.virtual_memory().available
                measured = args.reports is not None and Path(args.reports, job_name(shape, int(block), mode, every)).exists()
                if needed * (1 + TARGET) + HEADROOM > available and not measured:
                    print(f"not run: its {STAGES} nodes need {needed / GiB:.1f} GiB as they start (the model's "
                          f"peaks of the workers and their communication processes); with the model's 10% and "
                          f"{HEADROOM / GiB:.0f} GiB for the launcher, etcd and this script, more than the "
                          f"{available / GiB:.1f} GiB this machine has available")
                    continue
                rows = run(args, shape, int(block), mode, every)
                ratios += show(rows, label)
                peaks[(shape, int(block), every)] = {**peaks.get((shape, int(block), every), {}),
                                                      mode: {r["node"]: r for r in rows}}
    lazy_over_off(peaks)
    if not ratios:
        return 1
    worst = max(abs(r - 1) for r in ratios)
    unexplained = max(1 - 1 / r for r in ratios)
    print(f"\nmeasured / predicted peak over every node: {min(ratios):.3f} to {max(ratios):.3f}, worst |1 - ratio| "
          f"{worst:.3f} (target <= {TARGET}); unexplained (measured above predicted) at most {100 * unexplained:.1f}% "
          f"of a peak (target < {100 * UNEXPLAINED:.0f}%)")
    return 0 if worst <= TARGET and unexplained < UNEXPLAINED else 1


def lazy_over_off(peaks: dict[tuple, dict[str, dict]]) -> None:
    """What ``lazy`` adds per process over ``off``, before the kill: measured, and the model's replica and rest."""
    for (shape, block, every), by_mode in sorted(peaks.items()):
        if "off" not in by_mode or "lazy" not in by_mode:
            continue
        print(f"\nlazy over off per process, GPT-2 {shape}, sequence {block}, checkpointing {every or 'off'}, before "
              "the kill (GiB): measured (predicted) = the replica + the rest")
        for node, lazy in sorted(by_mode["lazy"].items()):
            off = by_mode["off"].get(node)
            if off is None:
                continue
            measured = lazy["measured_before"] - off["measured_before"]
            lazy_m, off_m = lazy["pre"]["memory"], off["pre"]["memory"]
            predicted = lazy_m.peak_bytes - off_m.peak_bytes
            replica = lazy_m.peak.by_owner()["replica"]
            print(f"  {node}: {measured / GiB:.2f} ({predicted / GiB:.2f}) = replica {replica / GiB:.2f} + rest "
                  f"{(measured - replica) / GiB:.2f} measured ({(predicted - replica) / GiB:.2f} predicted)")


if __name__ == "__main__":
    sys.exit(main())
