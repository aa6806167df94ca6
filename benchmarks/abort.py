"""Which process group can abort a receive blocked on a peer that froze: candidates for issue-style choice.

Two processes join a process group; rank 1 then stops answering (it sleeps: a frozen machine) and
rank 0 posts a receive from it in a thread. After 1 s rank 0 aborts the group the candidate's way
and measures how long the waiting thread takes to come back (or gives up after ``--limit`` s), and
how many threads are left alive. Then it sends 4 MiB back and forth between the two ranks of a
fresh group of the same kind and reports the time per round trip (the cost of the candidate's
path for every message of a step).

Candidates:

* ``gloo-abort``: torch's gloo group, ``ProcessGroup.abort()``;
* ``gloo-shutdown``: the same, ``ProcessGroup.shutdown()``;
* ``baby-gloo``: torchft's ``ProcessGroupBabyGloo`` (the backend runs in a child process that
  ``shutdown()`` kills; tensors travel through shared memory). Needs ``pip install torchft``.
* ``own-child``: ours on the same idea (``lightning_bamboo.engine.comm_process.CommProcess``): the
  caller's waits end when the pipe to its communication process ends; tensors go through
  shared-memory buffers lent from a pool (each shared with the child once);
* ``bamboo-backend``: the same through ``torch.distributed``'s process-group interface
  (``AbortableGroup``, what ``init_process_group("bamboo")`` gives the runtime, DeepSpeed and
  Lightning).

    python benchmarks/abort.py [--limit 10] [--rounds 50]
    PYTHONPATH=DIR python benchmarks/abort.py   # DIR: where `pip install --target DIR torchft` put it
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import subprocess
import threading
import time

from common import add_worker_flag, self_command

CANDIDATES = ("gloo-abort", "gloo-shutdown", "baby-gloo", "own-child", "bamboo-backend")
MIB4 = 1 << 20  # float32 elements in 4 MiB


def _plain_group(store_port: int, rank: int, prefix: str):
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=datetime.timedelta(seconds=30))
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, 2, datetime.timedelta(seconds=300))


def _baby_group(store_port: int, rank: int, prefix: str):
    from torchft.process_group import ProcessGroupBabyGloo

    pg = ProcessGroupBabyGloo(timeout=datetime.timedelta(seconds=300))
    pg.configure(f"127.0.0.1:{store_port}/{prefix}", "bench", rank, 2)
    return pg


class _OwnChild:
    """``own-child``: :class:`lightning_bamboo.engine.comm_process.CommProcess` with the candidates' interface."""

    def __init__(self, store_port: int, rank: int, prefix: str) -> None:
        from lightning_bamboo.engine.comm_process import CommProcess

        self.comm = CommProcess("127.0.0.1", store_port, prefix, rank, 2)

    def send(self, tensors, peer: int, tag: int):
        return self.comm.send(tensors[0], peer, tag)

    def recv(self, tensors, peer: int, tag: int):
        return self.comm.recv(tensors[0], peer, tag)

    def abort(self) -> None:
        self.comm.abort()

    shutdown = abort


class _Backend:
    """``bamboo-backend``: the ``torch.distributed`` process group of the ``"bamboo"`` backend."""

    def __init__(self, store_port: int, rank: int, prefix: str) -> None:
        from lightning_bamboo.engine.comm_process import AbortableGroup, CommProcess

        self.comm = CommProcess("127.0.0.1", store_port, prefix)
        self.pg = AbortableGroup(self.comm, self.comm.group("0", rank, 2), rank, 2)

    def send(self, tensors, peer: int, tag: int):
        return self.pg.send(tensors, peer, tag)

    def recv(self, tensors, peer: int, tag: int):
        return self.pg.recv(tensors, peer, tag)

    def abort(self) -> None:
        self.comm.abort()

    shutdown = abort


def _group(candidate: str, store_port: int, rank: int, prefix: str):
    if candidate == "own-child":
        return _OwnChild(store_port, rank, prefix)
    if candidate == "bamboo-backend":
        return _Backend(store_port, rank, prefix)
    return _baby_group(store_port, rank, prefix) if candidate == "baby-gloo" else _plain_group(store_port, rank, prefix)


def _peer(candidate: str, store_port: int, phase: str) -> None:
    """Rank 1: join, then either freeze (``phase == "freeze"``) or answer ``--rounds`` round trips."""
    import torch

    pg = _group(candidate, store_port, 1, phase)
    if phase == "freeze":
        time.sleep(3600)  # a frozen machine: it never sends
    buffer = torch.empty(MIB4)
    while True:
        pg.recv([buffer], 0, 0).wait()
        if buffer[0].item() < 0:
            return
        pg.send([buffer], 0, 1).wait()


def _abort(candidate: str, store_port: int, limit: float) -> tuple[str, float | None, int]:
    """Rank 0's side of the freeze: what the blocked wait did, its seconds after the abort, threads left."""
    import torch

    pg = _group(candidate, store_port, 0, "freeze")
    before = {t.ident for t in threading.enumerate()}
    outcome: dict[str, object] = {}

    def wait() -> None:
        try:
            pg.recv([torch.empty(16)], 1, 0).wait()
            outcome["how"] = "returned"
        except Exception as err:  # noqa: BLE001 - what it raises is what we report
            outcome["how"] = f"raised {type(err).__name__}"
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(1.0)
    aborted = time.monotonic()
    if candidate == "gloo-abort":
        pg.abort()
    else:
        pg.shutdown()
    thread.join(limit)
    seconds = float(outcome["at"]) - aborted if "at" in outcome else None  # type: ignore[arg-type]
    how = str(outcome.get("how", f"still blocked after {limit:g} s"))
    # multiprocessing's resource sharer (it serves the file descriptors of shared tensors) lives as long as the
    # process, whatever group is open: not a thread of the aborted group
    left = [t for t in threading.enumerate() if t.ident not in before and not t.name.endswith("(_serve)")]
    return how, seconds, len(left)


def _round_trips(candidate: str, store_port: int, rounds: int) -> float:
    import torch

    pg = _group(candidate, store_port, 0, "speed")
    buffer = torch.ones(MIB4)
    pg.send([buffer], 1, 0).wait()  # warm up
    pg.recv([buffer], 1, 1).wait()
    start = time.perf_counter()
    for _ in range(rounds):
        pg.send([buffer], 1, 0).wait()
        pg.recv([buffer], 1, 1).wait()
    seconds = (time.perf_counter() - start) / rounds
    buffer.fill_(-1)
    pg.send([buffer], 1, 0).wait()
    return seconds


def _run(candidate: str, limit: float, rounds: int) -> str:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    port = server.port
    peer = ctx.Process(target=_peer, args=(candidate, port, "freeze"), daemon=False)
    peer.start()
    try:
        how, seconds, threads = _abort(candidate, port, limit)
    finally:
        peer.kill()
        peer.join(10)
    # a fresh group of the same kind (the old one's blocked thread, if any, stays where it is)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    peer = ctx.Process(target=_peer, args=(candidate, server.port, "speed"), daemon=False)
    peer.start()
    try:
        trip = _round_trips(candidate, server.port, rounds)
    finally:
        peer.join(30)
        peer.kill()
    took = f"{seconds:.3f}" if seconds is not None else "-"
    speed = f"{trip * 1000:.2f}"
    return f"| {candidate} | {how} | {took} | {threads} | {speed} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=10.0, help="seconds to wait for the blocked receive")
    parser.add_argument("--rounds", type=int, default=50, help="4 MiB round trips timed per candidate")
    add_worker_flag(parser, choices=CANDIDATES)  # the candidate a child measures
    args = parser.parse_args()
    if args.role:  # one candidate per process: a blocked thread must not outlive into the next one
        print(_run(args.role, args.limit, args.rounds), flush=True)
        os._exit(0)  # a thread may still be blocked in the group: that is what is measured
    import torch

    print(f"torch {torch.__version__}; rank 1 freezes after joining, rank 0 aborts its blocked receive after 1 s")
    print("\n| candidate | the blocked receive | seconds after the abort | threads left | 4 MiB round trip ms |")
    print("|---|---|---:|---:|---:|")
    for candidate in CANDIDATES:
        if candidate == "baby-gloo":
            try:
                import torchft  # noqa: F401
            except ImportError:
                print(f"| {candidate} | not installed (pip install torchft) | - | - | - |")
                continue
        done = subprocess.run(self_command(__file__, candidate, "--limit", args.limit, "--rounds", args.rounds),
                              capture_output=True, text=True, timeout=args.limit + 300)
        rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
        print(rows[-1] if rows else f"| {candidate} | failed: {done.stderr.strip().splitlines()[-1:]} | - | - | - |",
              flush=True)


if __name__ == "__main__":
    main()
