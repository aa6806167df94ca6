"""What one GPU shows of the abortable communication layer and of the pipeline on it (issue 21).

    python benchmarks/gpu.py [--steps 10] [--kill-at 5] [--n-embd 2048] [--n-layer 20] [--budget-s 300]

Needs a CUDA GPU; everything runs on GPU 0. NCCL refuses two ranks on one GPU, so the NCCL
transport is measured with one rank per group, and two processes that share the GPU use the host
transport (gloo in the communication process, GPU tensors staged through shared host memory).

Part 1, the communication layer (``lightning_bamboo.engine.comm_process``):

- host transport: a 4 MiB GPU tensor's round trip to a second process and back (median ms);
- NCCL transport: a 64 MiB all-reduce through the layer against torch's own ``ProcessGroupNCCL``
  in this process (median ms; the layer adds two copies in GPU memory and a pipe message);
- abort: a receive blocked on a frozen (SIGSTOPped) peer over the host transport, and an NCCL
  all-reduce whose peer never comes: seconds from the abort to the wait raising; then the seconds
  until the next NCCL generation's first all-reduce is done.

Part 2, the pipeline (``PipelineRunner`` under the Bamboo launcher, no Lightning): a 2-stage GPT
(``--n-embd 2048 --n-layer 20``: about 0.52B parameters a stage, fp32, AdamW) whose two nodes share
the GPU; median step time and each process's peak GPU memory with redundancy ``off``, ``lazy`` and
``eager`` (the replica and the redundant forward on the GPU too); then ``lazy`` with node1
SIGKILLed, and with node1 frozen (SIGSTOP), at step ``--kill-at``: the step that absorbs the
failover, and the final weights and AdamW state against the clean ``lazy`` run, bit for bit (by a
digest of every tensor's bytes: a stage's states are GBs); and the asynchronous checkpoint's pause, a
snapshot of stage 0 to host memory. ``benchmarks/sim_gpu_inputs.py`` turns the record into the
simulator's inputs. No run of part 2 starts after
``--budget-s`` seconds; one not run reads nan and fails the check. On one shared GPU the pipeline
has no idle bubbles to hide the redundant forward in, so ``lazy`` costs there what it would not
with a GPU per stage: this part shows that it runs and stays exact, not its overhead.

Then ``lazy`` with the replica in pinned host memory (``replica_placement="host"``): its peak GPU memory against
``off``'s (issue 64: at most 1.05x).

Part 3, with ``--largest`` (issue 38; not part of ``make gpu-check``): the largest GPT of width
``--largest-width`` (4096) that trains 4 steps on the GPU in 2 stages sharing it, bf16 (autocast
over fp32 masters), ``lazy``, AdamW: first the most blocks that fit by ``LARGEST_BYTES_PER_PARAMETER``
(both processes: each holds every parameter once, stage and replica) with a fifth of the GPU kept
back, then 7/8 of the blocks after each try that did not end with exit 0 on both nodes; its
parameters, step time and each process's peak memory::

    python benchmarks/record.py gpu_largest --keep-failed -- python benchmarks/gpu.py --skip-pipeline --largest
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import WORKER_FLAG, self_command  # (benchmarks/: the script's folder)

from lightning_bamboo.testing.gpu_check import (
    BLOCK,
    MANY,
    MODES,
    SIZES_MIB,
    VOCAB,
    digests,
    gpt_parameters,
    largest_layers,
    passed,
    report,
    same_states,
)

REPO = Path(__file__).resolve().parents[1]
MICRO, MICRO_BATCHES = 4, 8
DEVICE = os.environ.get("BAMBOO_BENCH_DEVICE", "cuda:0")  # (cpu: to try the script where there is no GPU)

ECHO = """
import sys, time, torch
from lightning_bamboo.engine.comm_process import CommProcess
comm = CommProcess("127.0.0.1", int(sys.argv[1]), sys.argv[2], 1, 2)
message = torch.zeros(1 << 20, device="cuda")
for _ in range(int(sys.argv[3])):
    comm.recv(message, 0, tag=1).wait(60)
    comm.send(message, 0, tag=2).wait(60)
print("echoed", flush=True)
time.sleep(3600)
"""


def _median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _time_abort(comm, blocked, results: dict, key: str) -> None:
    """Abort ``comm`` and put the seconds until ``blocked``'s wait raised ``CommAborted`` in ``results[key]``."""
    from lightning_bamboo.engine.comm_process import CommAborted

    start = time.monotonic()
    comm.abort()
    try:
        blocked.wait(30)
    except CommAborted:
        results[key] = time.monotonic() - start


def comm_part(results: dict) -> None:
    import torch.distributed as dist

    from lightning_bamboo.engine.comm_process import CommProcess

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    rounds = 21
    peer = subprocess.Popen([sys.executable, "-c", ECHO, str(store.port), "echo", str(rounds + 1)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
                            start_new_session=True)
    try:
        comm = CommProcess("127.0.0.1", store.port, "echo", 0, 2)
        message = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        back = torch.zeros_like(message)

        def round_trip() -> None:
            comm.send(message, 1, tag=1).wait(60)
            comm.recv(back, 1, tag=2).wait(60)

        results["host_round_trip_4mib_ms"] = _median_ms(round_trip, rounds - 1)
        assert torch.equal(back, message)
        os.killpg(peer.pid, signal.SIGSTOP)
        blocked = comm.recv(back, 1, tag=2)
        time.sleep(1.0)
        _time_abort(comm, blocked, results, "host_abort_s")
    finally:
        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait(30)

    one = CommProcess("127.0.0.1", store.port, "nccl-one", 0, 1, transport="nccl", device=0)
    native = dist.ProcessGroupNCCL(dist.PrefixStore("native", store), 0, 1)
    for mib in SIZES_MIB:
        tensor = torch.ones(mib << 18, device="cuda")  # float32
        results[f"nccl_layer_allreduce_{mib}mib_ms"] = _median_ms(lambda t=tensor: one.allreduce(t).wait(60))
        results[f"nccl_native_allreduce_{mib}mib_ms"] = _median_ms(lambda t=tensor: native.allreduce([t]).wait())
        del tensor
    results["nccl_layer_over_native"] = results["nccl_layer_allreduce_64mib_ms"] / results["nccl_native_allreduce_64mib_ms"]
    # many operations of as many sizes: the layer's buffers are lent again by size class, the GPU's reserved memory
    # stays bounded, and a trim gives the idle ones back
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for i in range(MANY):
        one.allreduce(torch.ones((1 << 18) + 997 * i, device="cuda")).wait(60)
    results["nccl_buffers_after_many_mib"] = one.buffer_bytes / 2**20
    results["nccl_reserved_growth_mib"] = (torch.cuda.memory_reserved() - reserved) / 2**20
    one.trim(0)
    results["nccl_buffers_after_trim_mib"] = one.buffer_bytes / 2**20
    one.close()
    big = torch.ones(16 << 20, device="cuda")  # 64 MiB

    lost = CommProcess("127.0.0.1", store.port, "nccl-lost", 0, 2, transport="nccl", device=0)
    blocked = lost.allreduce(big)
    time.sleep(2.0)
    results["nccl_blocked_before_abort"] = not blocked.done.is_set()
    _time_abort(lost, blocked, results, "nccl_abort_s")
    start = time.monotonic()
    after = CommProcess("127.0.0.1", store.port, "nccl-after", 0, 1, transport="nccl", device=0)
    after.allreduce(big).wait(60)
    results["nccl_next_generation_s"] = time.monotonic() - start
    after.close()


# ------------------------------------------------------------------ part 2: a node of the pipeline

def node(out: Path, steps: int, redundancy: str, n_embd: int, n_layer: int, precision: str = "32",
         measures: str = "digests", placement: str = "auto") -> None:
    """One node of a run; ``measures``: what it reports beside its step times and peak memory, of "digests" (its
    states, for the bit-for-bit comparisons) and "snapshot" (``snapshot_seconds``), comma-separated: each copies
    the whole stage to host memory, GBs on a GPU."""
    import torch.distributed as dist

    from lightning_bamboo.engine.comm_process import BACKEND
    from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss
    from lightning_bamboo.runtime import BambooConfig, PipelineRunner

    config = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=n_layer, n_head=max(1, n_embd // 128), n_embd=n_embd)

    class Model:
        def configure_pipeline(self):
            return gpt_layers(config)

        def pipeline_loss(self, outputs, targets):
            return gpt_loss(outputs, targets)

    class Host:
        step = 0

        def global_step(self):
            return self.step

        def adopt_stage(self, module):
            pass

        def optimizer_for(self, module):
            return torch.optim.AdamW(module.parameters(), lr=1e-4)

        def setup_optimizers(self, module):
            return self.optimizer_for(module)

        def rebind_optimizer(self, old, new):
            pass

        def enter_group(self, rank, world):
            pass

        def training_state(self):
            return {"step": self.step}

        def global_micro_batches(self):
            return None

    host = Host()
    runner = PipelineRunner(BambooConfig(redundancy=redundancy, micro_batch_size=MICRO, seed=0, timeout=60.0,
                                         precision=precision, replica_placement=placement,
                                         detection_timeout=3.0), host, device=DEVICE)
    session = runner.open_session()
    assert session is not None, "run under lightning_bamboo.launcher.launch"
    dist.init_process_group(BACKEND, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    runner.start(Model(), dist.get_world_size(), dist.get_rank(), fitting=True)
    times = []
    for step in range(steps):
        host.step = step
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, config.vocab_size, (MICRO * MICRO_BATCHES, config.block_size + 1), generator=generator)
        start = time.perf_counter()
        runner.train_step((tokens[:, :-1], tokens[:, 1:]))
        if DEVICE.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    assert runner.engine is not None
    peak = torch.cuda.max_memory_allocated(DEVICE) if DEVICE.startswith("cuda") else 0
    engine = runner.engine
    wanted = measures.split(",")
    (out / f"{session.node}.json").write_text(json.dumps({
        "times": times, "failovers": [f.as_dict() for f in runner.failovers], "peak_bytes": peak,
        "parameters": sum(p.numel() for p in engine.module.parameters()),
        "snapshot_s": snapshot_seconds(engine) if "snapshot" in wanted else None,
        # digests: a 0.5B stage's states are GBs to write and read
        "digests": digests(engine.own_states()) if "digests" in wanted else {}}))
    runner.finish(completed=True)
    runner.close()
    dist.destroy_process_group()


def snapshot_seconds(engine) -> list[float]:
    """Seconds of the training thread's pause for two snapshots of the stage (``AsyncCheckpoint``'s: weights and
    optimizer state copied to host memory, ``checkpoint.take_shard``): the first allocates the host buffers, the
    second reuses them, as every snapshot after a checkpoint's first does."""
    from lightning_bamboo import checkpoint as ckpt

    taken, seconds = None, []
    for _ in range(2):
        start = time.perf_counter()
        taken = ckpt.take_shard(0, engine.module, engine.optimizer, engine.layer_range, writes_layers=True,
                                reuse=taken)
        seconds.append(time.perf_counter() - start)
    return seconds


def pipeline_run(out: Path, steps: int, redundancy: str, size: tuple[int, int], kill: str | None = None,
                 precision: str = "32", measures: str = "digests", placement: str = "auto") -> dict:
    from lightning_bamboo.launcher import launch
    from lightning_bamboo.testing import faults

    out.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if kill:
        env.update(faults.environment([kill]))
    codes = launch(self_command(__file__, "node", out, steps, redundancy, *size, precision, measures, placement), 2,
                   env=env, timeout=600)
    reports = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    layers: dict = {}
    for name in sorted(reports):
        layers.update(reports[name]["digests"])
    return {"codes": codes, "reports": reports, "layers": layers}


def pipeline_part(results: dict, steps: int, kill_at: int, size: tuple[int, int], budget_s: float,
                  warmup: int = 2) -> None:
    """The runs of part 2, each only while the time since ``results["started"]`` is inside ``budget_s`` (a run not
    made reads nan, and fails the check where it is one of the two failovers)."""
    def in_budget(what: str) -> bool:
        if time.monotonic() - results["started"] < budget_s:
            return True
        results.setdefault("not_run", []).append(what)
        return False

    with tempfile.TemporaryDirectory() as tmp:
        runs = {mode: pipeline_run(Path(tmp) / mode, steps, mode, size, measures="snapshot" if mode == "off" else
                                   "digests" if mode == "lazy" else "") for mode in MODES if in_budget(mode)}
        for mode, run in runs.items():
            node0 = run["reports"].get("node0", {})
            if node0:
                results[f"step_{mode}_ms"] = statistics.median(node0["times"][warmup:]) * 1e3
                results[f"peak_{mode}_gib"] = max(r["peak_bytes"] for r in run["reports"].values()) / 2**30
                results["stage_parameters"] = node0["parameters"]
                results["model_parameters"] = sum(r["parameters"] for r in run["reports"].values())
            if node0.get("snapshot_s"):
                results["snapshot_first_s"], results["snapshot_s"] = node0["snapshot_s"]
        if "off" in runs and in_budget("lazy-host"):  # issue 64: the replica in pinned host memory, none on the GPU
            hosted = pipeline_run(Path(tmp) / "lazy-host", steps, "lazy", size, measures="", placement="host")
            if hosted["reports"] and "peak_off_gib" in results:
                results["peak_lazy_host_gib"] = max(r["peak_bytes"] for r in hosted["reports"].values()) / 2**30
                results["lazy_host_over_off_peak"] = results["peak_lazy_host_gib"] / results["peak_off_gib"]
        results["model_shape"], results["context"] = list(size), BLOCK  # (width, blocks), positions
        results["tokens_per_step"] = MICRO * MICRO_BATCHES * BLOCK
        for mode in MODES[1:]:
            if f"step_{mode}_ms" in results and "step_off_ms" in results:
                results[f"{mode}_over_off"] = results[f"step_{mode}_ms"] / results["step_off_ms"]
        for how, fault in (("kill", f"node1@{kill_at}"), ("freeze", f"node1@{kill_at}!stop")):
            if "lazy" not in runs or not in_budget(how):
                continue
            lost = pipeline_run(Path(tmp) / how, steps, "lazy", size, kill=fault)
            results[f"{how}_codes"] = lost["codes"]
            survivor = lost["reports"].get("node0", {})
            results[f"{how}_failovers"] = [(f["step"], f["lost"]) for f in survivor.get("failovers", [])]
            if survivor:
                results[f"{how}_step_s"] = survivor["times"][kill_at]
            results[f"exact_after_{how}"] = same_states(runs["lazy"]["layers"], lost["layers"])


def largest_part(results: dict, total_bytes: int, n_embd: int, steps: int, budget_s: float) -> None:
    """Issue 38's GPU item: the largest GPT that trains on one GPU in 2 stages sharing it, bf16 (autocast over fp32
    masters), ``lazy`` with AdamW: the estimate first, then 7/8 of the blocks after each run that did not end with
    every node's exit 0, while ``budget_s`` lasts; its parameters, step time and each process's peak memory."""
    started = time.monotonic()
    layers, tried = largest_layers(total_bytes, n_embd), []
    with tempfile.TemporaryDirectory() as tmp:
        while layers >= 2 and time.monotonic() - started < budget_s:
            run = pipeline_run(Path(tmp) / f"largest{layers}", steps, "lazy", (n_embd, layers), precision="bf16",
                               measures="")
            fitted = set(run["codes"].values()) == {0} and "node0" in run["reports"]
            tried.append((layers, fitted))
            if fitted:
                node0 = run["reports"]["node0"]
                results.update(largest_layers=layers, largest_width=n_embd,
                               largest_parameters=gpt_parameters(n_embd, layers),
                               largest_step_ms=statistics.median(node0["times"][1:] or node0["times"]) * 1e3,
                               largest_peak_gib=max(r["peak_bytes"] for r in run["reports"].values()) / 2**30)
                break
            layers = layers * 7 // 8
    results["largest_tried"] = tried


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps of every pipeline run (default %(default)s)")
    parser.add_argument("--kill-at", type=int, default=5,
                        help="the step at which node1 is killed, and frozen (default %(default)s)")
    parser.add_argument("--skip-pipeline", action="store_true", help="only the communication layer's part")
    parser.add_argument("--n-embd", type=int, default=2048, help="the GPT's width (default %(default)s)")
    parser.add_argument("--n-layer", type=int, default=20,
                        help="its blocks (default %(default)s: about 1.04B parameters, 0.52B a stage)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="seconds after which no further run of part 2 starts (default %(default)s: within the 8 "
                             "minutes of make gpu-check, its CUDA tests included)")
    parser.add_argument("--largest", action="store_true",
                        help="then the largest GPT that trains on the GPU in 2 stages sharing it, bf16 (issue 38)")
    parser.add_argument("--largest-width", type=int, default=4096, help="its width (default %(default)s)")
    parser.add_argument("--largest-budget-s", type=float, default=420.0,
                        help="seconds after which no further try starts (default %(default)s)")
    args = parser.parse_args(argv)
    if not 0 <= args.kill_at < args.steps:
        parser.error(f"--kill-at must be a step of the run: 0 <= kill-at < steps (kill-at: {args.kill_at}, "
                     f"steps: {args.steps}); e.g. --steps 10 --kill-at 5")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == [WORKER_FLAG, "node"]:  # a node of a pipeline run (``pipeline_run``)
        node(Path(argv[2]), int(argv[3]), argv[4], int(argv[5]), int(argv[6]), argv[7], argv[8], *argv[9:10])
        return
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); run it where one is")
    results: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())), "started": time.monotonic()}
    comm_part(results)
    print(json.dumps(results), flush=True)
    if not args.skip_pipeline:
        pipeline_part(results, args.steps, args.kill_at, (args.n_embd, args.n_layer), args.budget_s)
    if args.largest:
        largest_part(results, torch.cuda.get_device_properties(0).total_memory, args.largest_width, 4,
                     args.largest_budget_s)
    print(json.dumps(results), flush=True)
    print("\n".join(report(results, args.kill_at, args.skip_pipeline)))
    sys.exit(0 if passed(results, args.skip_pipeline) else 1)


if __name__ == "__main__":
    main()
