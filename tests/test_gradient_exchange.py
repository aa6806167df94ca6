"""The gradient exchange: its chunks (sender and receiver derive them from the same layers) and a real
exchange between two processes, over the process group and through shared memory."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from lightning_bamboo.engine import shared_buffer
from lightning_bamboo.engine.exchange import (
    CHUNK_NUMEL,
    GradientExchange,
    HolderEnd,
    OwnerEnd,
    chunk_plan,
    flat_grads,
)
from lightning_bamboo.engine.replica import Replica, StageContainer, free
from lightning_bamboo.errors import BambooError
from lightning_bamboo.membership.address import free_port
from tests.helpers import process_context


@pytest.mark.parametrize("numels", [[5], [3, 4, 5, 6, 7, 8], [100, 1, 1, 1, 100], [1] * 40, [9, 9, 9, 9]])
@pytest.mark.parametrize("chunk_numel", [1, 10, 25, 1000])
def test_chunks_cover_every_parameter_once_in_order(numels, chunk_numel):
    chunks = chunk_plan(numels, chunk_numel)
    # consecutive, whole parameters, every element once
    assert chunks[0][0] == 0 and chunks[0][2] == 0
    assert chunks[-1][1] == len(numels) and chunks[-1][3] == sum(numels)
    for (_, end, _, stop), (first, _, start, _) in zip(chunks, chunks[1:], strict=False):
        assert (first, start) == (end, stop)
    for first, end, start, stop in chunks:
        assert first < end and stop - start == sum(numels[first:end])
    # every chunk but the last reaches the size, and none holds more parameters than it needs to
    assert all(stop - start >= chunk_numel for _, _, start, stop in chunks[:-1])
    assert all(sum(numels[first : end - 1]) < chunk_numel for first, end, _, _ in chunks)


def test_a_stage_of_the_benchmark_model_travels_in_several_chunks():
    # a GPT block of width 192: attention in, attention out, MLP in, MLP out (with biases) and two norms
    block = [192 * 576, 576, 192 * 192, 192, 192 * 768, 768, 768 * 192, 192, 192, 192, 192, 192]
    chunks = chunk_plan(block * 3)
    # several chunks, but not a message per parameter
    assert 1 < len(chunks) < len(block) * 3 and all(stop - start >= CHUNK_NUMEL for _, _, start, stop in chunks[:-1])


def test_replica_gradients_go_gpu_to_gpu_where_the_transport_connects_gpus():
    """Where both ends are GPUs and the transport is NCCL the holder receives on the replica's GPU and offers no
    shared host buffer (no detour through host memory); a replica kept in host memory on a GPU machine receives into
    pinned memory; everything else into host memory, with the shared buffer offered as before."""
    from lightning_bamboo.engine.exchange import offers_shared_memory, receive_placement

    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert receive_placement(gpu, hosted=False, direct=True) == (gpu, False)
    assert receive_placement(gpu, hosted=True, direct=True) == (cpu, True)  # hosted: pinned, for async copies
    assert receive_placement(gpu, hosted=False, direct=False) == (cpu, False)  # gloo carries host memory
    assert receive_placement(cpu, hosted=False, direct=False) == (cpu, False)
    assert not offers_shared_memory(direct=True, replica_on_gpu=True)
    assert offers_shared_memory(direct=True, replica_on_gpu=False) and offers_shared_memory(False, True)
    stage = _Stage()
    _gradients(stage, 1)
    host, mask = flat_grads(stage)
    kept, same_mask = flat_grads(stage, on_device=True)  # CPU gradients: the same either way
    assert torch.equal(host, kept) and torch.equal(mask, same_mask) and kept.device == cpu


def test_no_parameters_no_chunks():
    assert chunk_plan([]) == []


# ---------------------------------------------------------------------------------------------------------------
# Two real processes on gloo: stage 0's owner ships, its replica holder receives.

class _Stage(torch.nn.Module):
    """Three parameters of 300,000 elements and a small one: four chunks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Parameter(torch.randn(300_000)) for _ in range(3))
        self.d = torch.nn.Parameter(torch.randn(1000))


def _gradients(stage: _Stage, step: int, before_last: Callable[[], None] = lambda: None) -> None:
    """Two backwards: the first reaches a and b, the second a and d; c never gets a gradient. ``before_last`` runs
    between them (where an engine's step waits before its last backward)."""
    for param in stage.parameters():
        param.grad = None
    (stage.a * stage.b).sum().mul(step + 1).backward()
    before_last()
    ((stage.a ** 2).sum() + stage.d.sum() * step).backward()


STEPS = 5


def _exchange_worker(rank: int, same_host: bool, mode: str, results) -> None:
    stage = _Stage()
    if rank == 0:
        if not same_host:  # the owner believes it runs elsewhere: it must decline the holder's shared buffer
            shared_buffer.host_identity = lambda: "another-host/0"
        exchange = GradientExchange(None, send_to=1, recv_from=None)
        mapped, in_shared = [], []
        for step in range(STEPS):
            _gradients(stage, step, (lambda: exchange.write_ahead(stage)) if mode != "shipped" else (lambda: None))
            shared = exchange.owner.next_half
            exchange.ship(stage)
            mapped.append(exchange.through_shared_memory)
            # written ahead, the last backward accumulated a's gradient straight into the half shipped
            in_shared.append(shared is not None and stage.a.grad.data_ptr() == shared.data_ptr())
            for param in stage.parameters():  # the optimizer's step, then its zero_grad
                if mode == "optimizer-writes-grads" and param.grad is not None:
                    param.grad.add_(1.0)  # (as SGD(nesterov=True)'s foreach step does)
                param.grad = None
            exchange.owner_stepped()
            dist.barrier()  # what the loss broadcast does in a pipeline
        exchange.finish_send()
        results.put(("owner", mapped))
        results.put(("owner's gradients in shared memory", in_shared))
        results.put(("gradients left alone", exchange.grads_left_alone))
    else:
        replica = Replica(0, StageContainer({0: _Stage()}), torch.optim.SGD(_Stage().parameters(), lr=0.1))
        exchange = GradientExchange(replica, send_to=None, recv_from=0)
        got, shared = replica.module.get_submodule("0"), []
        for step in range(STEPS):
            shared.append(exchange.holder.owner_writes_shared)
            exchange.post_receive()
            _gradients(stage, step)  # what the owner computed, bit for bit
            exchange.receive()
            dist.barrier()  # the owner's optimizer has stepped: what the replica reads must be unchanged
            for name in "abcd":
                want, have = getattr(stage, name).grad, getattr(got, name).grad
                assert (want is None) == (have is None), (step, name)
                assert want is None or torch.equal(want, have), (step, name)
            replica.pending = False
            free([replica.module])  # the update was applied: the receive buffer is free again
            exchange.acknowledge()  # and the shared one: the owner's next ship into it waits for this
        exchange.finish_send()  # its "read"s are gone
        results.put(("holder", shared))


@pytest.mark.parametrize("mode", ["shipped", "written-ahead", "optimizer-writes-grads"])
@pytest.mark.parametrize("same_host", [True, False], ids=["shared-memory", "another-host"])
def test_gradients_arrive_exactly_through_shared_memory_or_over_the_group(same_host, mode):
    """Four chunks and a parameter without a gradient: the holder gets the owner's gradients bit for bit
    (and None where the owner has none), step after step. On one host every step goes through shared memory, the
    first too (the owner takes the holder's offer at its first ship; the holder learns it from the first header); an
    owner on another host declines the offer and every step goes over the process group.

    Written ahead (``GradientExchange.write_ahead`` before the last backward), the owner's gradients are views
    of the half shipped, and the last backward accumulates into it; d, whose first gradient comes in that
    backward, is copied at the ship. That starts only once the owner's optimizer was seen to leave its
    gradients alone (the first step through shared memory): one that adds to them in place keeps the copy,
    and the holder still reads what the owner shipped, after the owner's step."""
    assert len(chunk_plan(p.numel() for p in _Stage().parameters())) == 4
    results = _run_pair(_exchange_worker, same_host, mode)
    seen = dict(results.get(timeout=5) for _ in range(4))
    if same_host:
        assert seen == {"owner": [True] * STEPS, "holder": [False] + [True] * 4,
                        "owner's gradients in shared memory": [False] + [mode == "written-ahead"] * 4,
                        "gradients left alone": mode != "optimizer-writes-grads"}
    else:
        assert seen == {"owner": [False] * STEPS, "holder": [False] * STEPS,
                        "owner's gradients in shared memory": [False] * STEPS, "gradients left alone": None}


def test_the_exchanges_messages_pair_alike_by_tag_and_by_place_in_their_nccl_lane(tmp_path):
    """Over the abortable backend, its sends and receives traced (``$BAMBOO_COMM_TRACE``), an owner on another host
    ships five steps of four chunks. Gloo paired each message with its receive by tag; NCCL pairs them by place in a
    lane (``comm_cuda.lane_of``: the four chunks' tags share one): the trace shows the same pairs, on a bounded
    number of lanes."""
    from lightning_bamboo.engine.comm_cuda import CHUNK_TAGS, LANES, lane_mismatches, lane_of, tag_lane
    from lightning_bamboo.engine.comm_process import TRACE_ENV

    results = _run_pair(_exchange_worker, False, "shipped", backend="bamboo", env={TRACE_ENV: str(tmp_path)})
    seen = dict(results.get(timeout=5) for _ in range(4))
    assert seen["owner"] == seen["holder"] == [False] * STEPS  # every step over the group
    records = [json.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_text().splitlines()]
    sent = [r for r in records if r["op"] == "send"]
    assert {r["rank"] for r in sent} == {0, 1} and lane_mismatches(records) == []
    chunks = [r["tag"] for r in sent if r["rank"] == 0 and lane_of(r["tag"], 0, 1) == (CHUNK_TAGS, 0)]
    assert chunks == [CHUNK_TAGS + i for _ in range(STEPS) for i in range(4)]  # 4 tags, 1 lane, in chunk order
    assert {tag_lane(r["tag"]) for r in records} <= set(LANES)
    # the same messages with a chunk's receive posted out of its order would pair wrongly under NCCL
    holder = [i for i, r in enumerate(records) if r["op"] == "recv" and r["tag"] >= CHUNK_TAGS]
    first, second = records[holder[0]], records[holder[1]]
    records[holder[0]], records[holder[1]] = second, first
    assert lane_mismatches(records)


def test_an_optimizer_that_writes_gradients_after_they_were_written_ahead_stops_training():
    """Seen to leave them alone before, an optimizer that then changes gradients the holder reads afterwards is an
    error that names the rule, not a replica that drifts."""
    owner = OwnerEnd(1, group=None)
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)
    owner._shipped_grads = (True, [(param, param.grad, param.grad._version)])  # as a written-ahead ship leaves it
    param.grad.mul_(0.5)
    param.grad = None
    with pytest.raises(BambooError, match=r"Rule: step\(\) must leave p\.grad unchanged and zero_grad\(\) must set it to None"):
        owner.stepped()


def _pair_main(target, rank: int, port: int, args, errors, results, backend: str = "gloo",
               env: dict | None = None) -> None:
    try:
        os.environ.update(env or {})  # (a process of the suite's fork server has that server's environment)
        if backend == "gloo":
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        else:  # the abortable backend, formed as under Lightning: torch's env:// rendezvous
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group(backend, rank=rank, world_size=2)
        target(rank, *args, results)
    except BaseException as err:
        errors.put(f"rank {rank}: {err!r}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_pair(target, *args, backend: str = "gloo", env: dict | None = None):
    """Run ``target(rank, *args, results)`` in two spawned processes on one group of ``backend`` with ``env`` added
    to their environment, to their end (60 s at most, killed after); the results queue."""
    ctx = process_context()
    errors, results = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_pair_main, args=(target, rank, port, args, errors, results, backend, env))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=60)
        assert all(proc.exitcode == 0 for proc in procs), [errors.get(timeout=1) for _ in range(errors.qsize())]
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


HOLD_STEPS = 5


class _WatchedOwner(OwnerEnd):
    """Notes an owner's wait for a "read" (into ``events``) and whether the holder had sent it when the wait ended.

    Causes, not clocks: ``read_sent`` is set by the holder just before it sends a "read" (timestamps of two
    processes were once seen out of order here)."""

    def __init__(self, events, read_sent, *args) -> None:
        super().__init__(*args)
        self.events, self.read_sent = events, read_sent

    def _wait_read(self, half: int) -> None:
        if self._reads[half] is None:
            return super()._wait_read(half)
        self.events.put(("waits for read", half))
        super()._wait_read(half)
        self.events.put(("read came", half, self.read_sent.is_set()))


class _WatchedHolder(HolderEnd):
    """Notes a holder's "read"s sent (into ``sent``: the half, and whether it had seen the owner wait by then,
    ``saw_wait``, set once it took the owner's "waits for read" from the queue)."""

    def __init__(self, events, read_sent, *args) -> None:
        super().__init__(*args)
        self.read_sent, self.sent, self.saw_wait = read_sent, [], False

    def acknowledge(self) -> None:
        unread = self.shared_half
        if unread is not None and not (self.replica.pending or self.replica.due):
            self.read_sent.set()  # (what acknowledge sends now)
        super().acknowledge()
        if unread is not None and self.shared_half is None:
            self.sent.append((unread[0], self.saw_wait))


def _hold_worker(rank: int, events, read_sent, results) -> None:
    """Five steps through one host (steps 0, 2 and 4 write the first half of the shared buffer, 1 and 3 the
    second): the holder keeps step 2's gradients unread while the owner ships steps 3 and 4."""
    stage = _Stage()
    if rank == 0:
        exchange = GradientExchange(None, send_to=1, recv_from=None)
        exchange.owner = _WatchedOwner(events, read_sent, 1, exchange.group)
        for step in range(HOLD_STEPS):
            exchange.post_receive()  # where the engine's step waits: the "read"s are received from here on
            _gradients(stage, step)
            exchange.ship(stage)
            events.put(("shipped", step))
            dist.barrier()
        exchange.finish_send()
    else:
        replica = Replica(0, StageContainer({0: _Stage()}), torch.optim.SGD(_Stage().parameters(), lr=0.1))
        exchange = GradientExchange(replica, send_to=None, recv_from=0)
        holder = exchange.holder = _WatchedHolder(events, read_sent, replica, 0, exchange.group)
        got, seen, kept = replica.module.get_submodule("0"), [], None
        for step in range(HOLD_STEPS):
            exchange.post_receive()
            if step == 3:
                dist.barrier()  # the owner goes on to ship 4 while step 2's gradients are still unread
                before = []  # until ship 4 waits
                while (event := events.get(timeout=30))[0] != "waits for read" or ("shipped", 3) not in before:
                    before.append(event)
                holder.saw_wait = True
                # ship 3 wrote the other half without waiting; ship 4 waits, before its copy, for the "read" of
                # the first half, sent only now
                intact = torch.equal(got.a.grad, kept)
                replica.due = False
                free([replica.module])  # step 2's update was applied: "read" lets ship 4 write the first half
                seen.append((before, event, intact))
                exchange.acknowledge()
            exchange.receive()
            replica.pending, replica.due = False, True  # committed, its update not applied yet
            if step == 2:
                assert holder.owner_writes_shared and holder.shared_half is not None and holder.shared_half[0] == 0
                # read where the owner wrote them: views of the first half of the shared buffer, no copy
                assert got.a.grad.data_ptr() == holder.shared_half[1].data_ptr()
                kept = got.a.grad.clone()
                exchange.acknowledge()  # not yet: the update is still due
            else:
                replica.due = False
                free([replica.module])  # the update was applied
                exchange.acknowledge()
            if step != 3:
                dist.barrier()
        exchange.finish_send()
        results.put((seen, holder.sent))


def test_the_owner_writes_a_half_of_the_shared_buffer_again_only_after_the_replica_used_it():
    """The replica's gradients are views of a half of the shared buffer until its update was applied (no copy
    at the receive); the owner writes the other half at its next ship without waiting, and this half at the
    ship after, once the holder's "read" came, which ``acknowledge`` sends only after the update (a "read"
    sent earlier would have arrived: the owner receives them from the start of each step on)."""
    ctx = process_context()
    events, read_sent = ctx.Queue(), ctx.Event()
    results = _run_pair(_hold_worker, events, read_sent)
    ([(before, waits, intact)], sent) = results.get(timeout=5)
    # ships 2 and 3 found the "read"s of steps 0 and 1 there; ship 4 waited for the first half's, with step 2's
    # gradients intact
    assert (before, waits, intact) == ([("shipped", 0), ("shipped", 1), ("waits for read", 0), ("read came", 0, True),
                                        ("shipped", 2), ("waits for read", 1), ("read came", 1, True), ("shipped", 3)],
                                       ("waits for read", 0), True)
    # the holder's "read" for step 2's half was sent only once ship 4 waited; the wait ended after it was sent
    came = next(event for event in iter(lambda: events.get(timeout=5), None) if event[:2] == ("read came", 0))
    assert (sent[:3], came) == ([(0, False), (1, False), (0, True)], ("read came", 0, True))


# ---------------------------------------------------------------------------------------------------------------
# The shared buffer outlives its holder: a node whose replica holder was killed with every process it started
# (as the launcher and a machine's loss do) frees its mapping later, in a garbage collection, and lives on.
# With torch's file_system sharing the holder's shared-memory manager died with it, and the free aborted the
# owner ("terminate called after throwing an instance of 'std::system_error': Broken pipe").

_HOLDER = """
import os, sys, time
from lightning_bamboo.engine.shared_buffer import offer_shared_buffer
buffer, token, payload = offer_shared_buffer(1000)
buffer.copy_(buffer.new_tensor(range(1000)))
sys.stdout.write(payload.hex() + "\\n"); sys.stdout.flush()
time.sleep(60)
"""

_OWNER = """
import contextlib, gc, os, signal, subprocess, sys
import torch
from lightning_bamboo.engine.shared_buffer import map_offered_buffer
from lightning_bamboo.membership.node import descendants
holder = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
payload = bytes.fromhex(holder.stdout.readline())
assert map_offered_buffer(payload, 999) is None  # another size: not mapped
buffer, token = map_offered_buffer(payload, 1000)
seen = buffer.clone()
family = descendants(holder.pid)
holder.kill()
for pid in family:
    with contextlib.suppress(ProcessLookupError):  # one that ended by itself after the listing
        os.kill(pid, signal.SIGKILL)
holder.wait()
buffer.add_(1)  # the memory is still there after its holder died
total = float(buffer.sum())
del buffer
gc.collect()
print("alive", float(seen.sum()), total, flush=True)
"""


def test_a_shared_gradient_buffer_is_freed_safely_after_its_holder_died():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OWNER, _HOLDER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["alive", str(float(sum(range(1000)))), str(float(sum(range(1000)) + 1000))]
