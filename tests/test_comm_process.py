"""CommProcess: a gloo group in a process of its own, whose waits end at once when it is aborted.

Real processes: this test process is rank 0, a Python child is rank 1; each runs its group in a
communication process of its own. Frozen with SIGSTOP, rank 1 never answers, and rank 0's blocked
receive must end within a second of the abort, leaving no thread behind. Each test runs with host
tensors and, where torch sees a GPU, with GPU tensors (both processes on one GPU: staged through the
host, as NCCL refuses two ranks on one GPU); the NCCL transport's own tests are at the end.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_bamboo.engine.comm_process import (
    BACKEND,
    CommAborted,
    CommProcess,
    CommWork,
    abort_generation,
    open_generation,
    use_transport,
)
from lightning_bamboo.engine.guard import StepGuard
from lightning_bamboo.errors import PeerLost
from tests.helpers import REPO

pytestmark = [pytest.mark.timeout(180)]

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

# rank 1: sums a tensor with rank 0, receives one message into a parameter (DeepSpeed broadcasts weights into its
# parameters) and echoes it back doubled, then waits (to be frozen or killed)
PEER = """
import sys, time, torch
from lightning_bamboo.engine.comm_process import CommProcess
port, prefix, name, device = int(sys.argv[1]), sys.argv[2], sys.argv[4], sys.argv[5]
comm = CommProcess("127.0.0.1", port, prefix)
comm.world = comm.group(name, 1, 2)
total = torch.full((4,), 2.0, device=device)
comm.allreduce(total).wait(60)
message = torch.nn.Parameter(torch.zeros(1 << 18, device=device))  # received into a parameter, as weights are
comm.recv(message, 0, tag=7).wait(60)
comm.send(message.detach() * 2, 0, tag=8).wait(60)
print("peer done", float(total[0]), flush=True)
if sys.argv[3] == "close":
    comm.close()
    sys.exit(0)
time.sleep(3600)
"""


def _start_peer(port: int, prefix: str, then: str, group: str = "world", device: str = "cpu") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, str(port), prefix, then, group, device], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _exchange(comm: CommProcess, device: str = "cpu") -> None:
    total = torch.full((4,), 1.0, device=device)
    comm.allreduce(total).wait(60)
    assert torch.equal(total, torch.full((4,), 3.0, device=device))
    message = torch.arange(1 << 18, dtype=torch.float32, device=device)
    comm.send(message, 1, tag=7).wait(60)
    back = torch.zeros(1 << 18, device=device)
    comm.recv(back, 1, tag=8).wait(60)
    assert torch.equal(back, message * 2)


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait for ``condition`` (polled); fail with ``what`` if it does not hold within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.01)


def _frozen(pgid: int) -> bool:
    """Whether SIGSTOP took effect on every process of process group ``pgid`` (state T; Z: already gone)."""
    states = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            states.append(fields[0])
    return bool(states) and all(state in ("T", "Z") for state in states)


def _in_wait(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in a ``CommWork``'s wait now: inside ``CommWork.wait``, on the
    condition variable of its event."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_code is not threading.Condition.wait.__code__:
        return False
    while frame is not None:
        if frame.f_code is CommWork.wait.__code__:
            return True
        frame = frame.f_back
    return False


def _mapped_buffers(comm: CommProcess) -> set[str]:
    """The transfer buffers (memory files) that ``comm``'s communication process maps."""
    maps = Path(f"/proc/{comm.child_pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in maps if "bamboo-comm-" in line}


def _shared_memory() -> int:
    """This process's resident shared memory (``RssShmem``), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("RssShmem:"))
    return int(line.split()[1]) * 1024


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    yield server


@pytest.mark.parametrize("device", DEVICES)
def test_operations_reach_the_peer_and_a_closed_group_leaves_nothing_behind(store, device):
    before = set(threading.enumerate())
    peer = _start_peer(store.port, "gen1", "close", device=device)
    try:
        comm = CommProcess("127.0.0.1", store.port, "gen1", 0, 2)
        _exchange(comm, device)
        out, _ = peer.communicate(timeout=60)
        assert peer.returncode == 0, out
        assert "peer done 3.0" in out
        if device == "cpu":  # the 1 MiB message's transfer buffers, idle now, give their pages back
            shared, kept = _shared_memory(), comm.buffer_bytes
            assert _mapped_buffers(comm) and kept >= 1 << 20
            assert comm.trim(4096) >= 1 << 20
            assert _shared_memory() <= shared - (1 << 20) and comm.buffer_bytes <= kept - (1 << 20)
            # dropped in the communication process too: no mapping of them left there
            _until(lambda: not _mapped_buffers(comm), 10, "the communication process unmapped the dropped buffers")
        comm.close()
    finally:
        if peer.poll() is None:
            os.killpg(peer.pid, signal.SIGKILL)
    assert not comm.alive
    assert comm.trim(0) == 0  # the buffers went with the generation
    assert {t for t in threading.enumerate() if not t.name.endswith("(_serve)")} <= before
    with pytest.raises(CommAborted):
        comm.send(torch.zeros(1), 1)


@pytest.mark.parametrize("device", DEVICES)
def test_a_receive_blocked_on_a_frozen_peer_ends_within_a_second_of_the_abort(store, device):
    before = set(threading.enumerate())
    peer = _start_peer(store.port, "gen2", "wait", device=device)
    try:
        comm = CommProcess("127.0.0.1", store.port, "gen2", 0, 2)
        _exchange(comm, device)
        os.killpg(peer.pid, signal.SIGSTOP)  # the whole machine hangs: rank 1 and its communication process
        _until(lambda: _frozen(peer.pid), 30, "the peer did not stop")
        blocked = comm.recv(torch.zeros(16, device=device), 1, tag=9)
        outcome: dict[str, object] = {}

        def wait() -> None:
            try:
                blocked.wait(120)
                outcome["how"] = "returned"
            except CommAborted as err:
                outcome["how"] = str(err)
            outcome["at"] = time.monotonic()

        waiter = threading.Thread(target=wait)
        waiter.start()
        # really blocked on the frozen peer: the waiter sits in the receive's wait, and the receive is not done
        _until(lambda: _in_wait(waiter) or not waiter.is_alive(), 60, "the waiter did not block in the receive's wait")
        assert waiter.is_alive() and not outcome and not blocked.done.is_set()
        aborted = time.monotonic()
        comm.abort()
        waiter.join(10)
        assert not waiter.is_alive()
        assert "aborted" in str(outcome["how"])
        # ended by the abort (after it, with its message), not by the receive's own 120 s timeout; how fast is
        # measured by benchmarks/abort.py, not asserted here
        assert float(outcome["at"]) >= aborted  # type: ignore[arg-type]
        # killed: its pipe's end of file came at its exit, its exit status a moment later
        _until(lambda: not comm.alive, 10, "the communication process was not gone")
        assert {t for t in threading.enumerate() if not t.name.endswith("(_serve)")} <= before  # none left behind
        with pytest.raises(CommAborted):
            comm.recv(torch.zeros(16), 1)
    finally:
        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait(30)


BLOCKED = {  # operations that never complete with a frozen peer (a send: 4 MiB, more than any socket buffers)
    "recv": lambda: dist.recv(torch.zeros(16), 1, tag=9),
    "send": lambda: dist.send(torch.zeros(1 << 20), 1, tag=9),
    "all_reduce": lambda: dist.all_reduce(torch.zeros(16)),
}


@pytest.mark.parametrize("op", list(BLOCKED))
def test_a_step_blocked_on_a_frozen_peer_ends_at_the_loss_and_leaves_no_thread(store, op):
    """The failover's first act: ``StepGuard`` aborts the generation, and the step thread (blocked in
    ``torch.distributed`` through the abortable backend, in a receive, a send or a collective) ends
    instead of being left behind."""
    before = set(threading.enumerate())
    prefix = f"gen-{op}"
    peer = _start_peer(store.port, prefix, "wait", group="0")  # torch names the job's group "0"
    try:
        open_generation("127.0.0.1", store.port, prefix, 60)
        dist.init_process_group(BACKEND, store=dist.PrefixStore(f"{prefix}-torch", store), rank=0, world_size=2)
        total = torch.full((4,), 1.0)
        dist.all_reduce(total)  # the peer's first operation, through torch.distributed
        assert torch.equal(total, torch.full((4,), 3.0))
        message = torch.arange(1 << 18, dtype=torch.float32)
        dist.send(message, 1, tag=7)
        back = torch.zeros(1 << 18)
        dist.recv(back, 1, tag=8)
        assert torch.equal(back, message * 2)
        os.killpg(peer.pid, signal.SIGSTOP)
        _until(lambda: _frozen(peer.pid), 30, "the peer did not stop")
        lost = threading.Event()
        guard = StepGuard(lost, lambda: ("node1",), detection_timeout=1.0)
        blocked: list[bool] = []

        def lose_once_blocked() -> None:  # the loss comes while the step is blocked in the operation
            try:
                _until(lambda: any(_in_wait(t) for t in threading.enumerate() if t.name == "bamboo-step"), 60,
                       "the step did not block in the operation")
                blocked.append(True)
            finally:
                lost.set()

        loser = threading.Thread(target=lose_once_blocked, name="test-loss")
        loser.start()
        with pytest.raises(PeerLost, match="node1"):
            guard.run(BLOCKED[op])
        loser.join()
        assert blocked, "the step was not blocked in the operation when the loss came"
        assert not [t for t in threading.enumerate() if t.name == "bamboo-step"]
        dist.destroy_process_group()
        left = set(threading.enumerate()) - before
        assert not left, left
    finally:
        abort_generation()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait(30)


# --- the NCCL transport (one GPU: one rank per group; NCCL refuses two ranks on one GPU) ---

@CUDA
def test_the_nccl_transport_runs_collectives_on_gpu_and_host_tensors_through_torch_distributed(store):
    use_transport("nccl", 0)
    try:
        open_generation("127.0.0.1", store.port, "nccl-ops", 60)
        dist.init_process_group(BACKEND, store=dist.PrefixStore("nccl-ops-torch", store), rank=0, world_size=1)
        on_gpu = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        dist.all_reduce(on_gpu)
        assert torch.equal(on_gpu, torch.arange(1 << 20, dtype=torch.float32, device="cuda"))
        on_host = torch.arange(8, dtype=torch.int64)  # staged through GPU memory
        dist.broadcast(on_host, 0)
        assert torch.equal(on_host, torch.arange(8))
        gathered = [torch.zeros(4, device="cuda")]
        dist.all_gather(gathered, torch.full((4,), 7.0, device="cuda"))
        assert torch.equal(gathered[0], torch.full((4,), 7.0, device="cuda"))
        dist.barrier()
        comm = dist.distributed_c10d._get_default_group().comm  # type: ignore[attr-defined]
        assert comm.transport == "nccl"
    finally:
        abort_generation()
        if dist.is_initialized():
            dist.destroy_process_group()
        use_transport("gloo")


@CUDA
def test_an_nccl_collective_whose_peer_never_comes_ends_at_the_abort_and_the_gpu_serves_the_next_generation(store):
    """Rank 0 of 2 with no rank 1: its all-reduce blocks inside NCCL (the communicator waits for the
    peer). The abort ends it at once, the communication process is gone, and a new generation on the
    same GPU works."""
    comm = CommProcess("127.0.0.1", store.port, "nccl-lost", 0, 2, timeout=600, transport="nccl", device=0)
    keys = store.num_keys()
    blocked = comm.allreduce(torch.ones(1 << 20, device="cuda"))
    # really blocked: the all-reduce reached NCCL (rank 0 put its communicator's id in the store, for a
    # rank 1 that never comes, and waits for it) and is not done
    _until(lambda: store.num_keys() > keys, 60, "the all-reduce did not reach NCCL's communicator set-up")
    assert not blocked.done.is_set()
    comm.abort()
    with pytest.raises(CommAborted):
        blocked.wait(10)
    # a killed process with a CUDA context takes a moment to be gone
    _until(lambda: not comm.alive, 10, "the communication process was not gone")
    again = CommProcess("127.0.0.1", store.port, "nccl-after", 0, 1, transport="nccl", device=0)
    total = torch.full((4,), 3.0, device="cuda")
    again.allreduce(total).wait(60)
    assert torch.equal(total, torch.full((4,), 3.0, device="cuda"))
    again.close()


def test_nccl_lanes_are_few_one_directional_and_pair_every_message_as_gloo_did():
    """``comm_cuda.lane_of``: however many chunks a replica's gradients travel in, they share one lane, and each lane
    carries one direction; ``lane_mismatches`` finds where NCCL's pairing by place in a lane would differ from gloo's
    by tag."""
    from lightning_bamboo.engine.comm_cuda import CHUNK_TAGS, HEADER_TAG, LANES, lane_mismatches, lane_of

    assert {lane_of(CHUNK_TAGS + i, 0, 1) for i in range(1000)} == {(CHUNK_TAGS, 0)}
    assert lane_of(HEADER_TAG, 0, 1) != lane_of(HEADER_TAG, 1, 0) != lane_of(CHUNK_TAGS, 1, 0)
    assert len({lane_of(tag, src, dst) for tag in [*LANES, *range(CHUNK_TAGS, CHUNK_TAGS + 50)]
                for src, dst in ((0, 1), (1, 0))}) == 2 * len(LANES)

    def rec(rank: int, op: str, peer: int, tag: int, nbytes: int = 8) -> dict:
        return {"gen": "g", "group": "world", "rank": rank, "op": op, "peer": peer, "tag": tag, "bytes": nbytes}

    # a 2-stage ring: each rank owns a stage and holds the other's replica; both post the header's receive first
    ring = [rec(0, "recv", 1, HEADER_TAG), rec(0, "send", 1, HEADER_TAG), rec(1, "recv", 0, HEADER_TAG),
            rec(1, "send", 0, HEADER_TAG)]
    assert lane_mismatches(ring) == []  # one lane per direction: neither waits for the other
    chunks = [rec(0, "send", 1, CHUNK_TAGS + i, 4 + i) for i in range(3)] + [
        rec(1, "recv", 0, CHUNK_TAGS + i, 4 + i) for i in range(3)]
    assert lane_mismatches(chunks) == []
    assert lane_mismatches(chunks[:-1]) == []  # a failover cut the receives short: as far as both go
    swapped = chunks[:3] + [chunks[4], chunks[3], chunks[5]]  # gloo pairs these by tag; NCCL would not
    (found,) = lane_mismatches(swapped)
    assert "ranks 0 and 1" in found and f"{CHUNK_TAGS:#x}" in found and "message 0" in found
    assert lane_mismatches([rec(0, "send", 1, 0, 8), rec(1, "recv", 0, 0, 16)])  # sizes differ


def test_a_transfer_buffer_is_at_most_an_eighth_larger_than_its_message():
    from lightning_bamboo.engine.comm_cuda import size_class

    assert size_class(1) == size_class(4096) == 4096
    assert size_class(64 << 20) == 64 << 20 and size_class((64 << 20) + 1) == 72 << 20  # a power of two needed 128
    assert size_class(65 << 20) == 72 << 20
    for nbytes in [4097, 5000, 12_345, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 7, 99_999_999, 256 << 20]:
        size = size_class(nbytes)
        assert nbytes <= size <= nbytes * 9 // 8 + 1 and size % 512 == 0, nbytes
    sizes = [size_class(n) for n in range(4096, 1 << 16, 37)]
    assert sizes == sorted(sizes) and len(set(sizes)) <= 8 * 4 + 1  # few classes: a size is lent again
