"""Where a replica lives on a GPU (its memory, or pinned host memory, by a budget), and that a replica in host
memory stays the exact copy of its stage. The choice is pure and runs anywhere; the copies need a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bamboo.engine.exchange import flat_grads
from lightning_bamboo.engine.replica import Replica, StageContainer
from lightning_bamboo.engine.replica_location import ACTIVATION_RESERVE, replica_bytes, replica_device
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.runtime.config import BambooConfig

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU, HOST = torch.device("cuda", 0), torch.device("cpu")
GiB = 2**30


def test_a_replica_goes_to_the_gpu_when_it_fits_its_budget_else_to_host_memory():
    params = 2**28  # 4 GiB with its gradients and AdamW's two moments
    assert replica_bytes(params) == 4 * GiB
    # default budget: what is free, less a quarter of the GPU kept for activations
    assert replica_device(GPU, params, memory=(30 * GiB, 80 * GiB)) == GPU  # 30 - 20 = 10 GiB allowed
    assert replica_device(GPU, params, memory=(23 * GiB, 80 * GiB)) == HOST  # 23 - 20 = 3 GiB allowed
    # an explicit budget, never more than what is free
    assert replica_device(GPU, params, budget=4 * GiB, memory=(30 * GiB, 80 * GiB)) == GPU
    assert replica_device(GPU, params, budget=4 * GiB - 1, memory=(30 * GiB, 80 * GiB)) == HOST
    assert replica_device(GPU, params, budget=64 * GiB, memory=(3 * GiB, 80 * GiB)) == HOST
    # forced either way; on CPU everything is host memory
    assert replica_device(GPU, params, "device", memory=(0, 80 * GiB)) == GPU
    assert replica_device(GPU, 1, "host", memory=(80 * GiB, 80 * GiB)) == HOST
    assert replica_device(HOST, params, "device") == HOST and replica_device(HOST, params) == HOST
    assert 0 < ACTIVATION_RESERVE < 1


@pytest.mark.parametrize("options, rule", [
    ({"replica_placement": "gpu"}, "replica_placement must be one of"),
    ({"replica_memory_budget": -1}, "replica_memory_budget must be a number of bytes"),
    ({"replica_memory_budget": 1.5}, "replica_memory_budget must be a number of bytes"),
    ({"replica_placement": "host", "replica_memory_budget": GiB}, "applies to replica_placement='auto'"),
])
def test_placement_options_are_checked_when_the_strategy_is_made(options, rule):
    with pytest.raises(BambooConfigError, match=rule):
        BambooConfig(**options)


def _replica(device: torch.device, hosted: bool = False) -> Replica:
    torch.manual_seed(0)
    container = StageContainer({4: nn.Linear(8, 8), 5: nn.Linear(8, 3)})
    container = container.to("cpu" if hosted else device)
    if hosted:
        for tensor in [*container.parameters(), *container.buffers()]:
            tensor.data = tensor.data.pin_memory()
    return Replica(5, container, torch.optim.AdamW(container.parameters(), lr=1e-2), device=device)


def test_on_cpu_a_replica_is_never_hosted_and_its_forwards_run_on_its_own_layers():
    replica = _replica(HOST)
    assert not replica.hosted and replica.compute_module() is replica.module
    assert replica.forward_layers is replica.module


@CUDA
def test_a_replica_in_host_memory_updates_and_forwards_bit_for_bit_as_one_on_the_gpu():
    on_gpu, hosted = _replica(GPU), _replica(GPU, hosted=True)
    assert hosted.hosted and not on_gpu.hosted
    assert all(p.is_pinned() for p in hosted.module.parameters())
    for step in range(3):
        x = torch.randn(4, 8, device=GPU, generator=None)
        assert torch.equal(on_gpu.compute_module()(x), hosted.compute_module()(x)), step
        grads = [torch.randn_like(p) for p in on_gpu.module.parameters()]
        for replica in (on_gpu, hosted):
            for p, g in zip(replica.module.parameters(), grads, strict=True):
                p.grad = g.to(p.device)
            replica.step(None)
        for a, b in zip(on_gpu.module.parameters(), hosted.module.parameters(), strict=True):
            assert b.device.type == "cpu" and torch.equal(a.cpu(), b), step
        for a, b in zip(on_gpu.optimizer.state.values(), hosted.optimizer.state.values(), strict=True):
            assert torch.equal(a["exp_avg"].cpu(), b["exp_avg"]) and torch.equal(a["exp_avg_sq"].cpu(), b["exp_avg_sq"])
    # its forwards ran on a copy on the GPU, refreshed after each update
    assert hosted.forward_layers is not hosted.module and next(hosted.forward_layers.parameters()).is_cuda


@CUDA
def test_gradients_on_the_gpu_are_gathered_into_pinned_host_memory_unchanged():
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to(GPU)
    module(torch.randn(3, 8, device=GPU)).sum().backward()
    module[1].bias.grad = None  # a parameter without a gradient travels as zeros, flagged in the mask
    flat, mask = flat_grads(module)
    expected = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).cpu()
                          for p in module.parameters()])
    assert flat.is_pinned() and torch.equal(flat, expected) and mask.tolist() == [1, 1, 1, 0]
    again, _ = flat_grads(module, out=flat)
    assert again is flat and torch.equal(again, expected)  # the same pinned buffer, reused


class _OutOfMemoryAdamW(torch.optim.AdamW):
    """An AdamW whose step meets what a GPU short of memory raises (this machine has no GPU to run out of)."""

    def step(self, closure=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                     "79.10 GiB of which 1.06 GiB is free.")


def test_a_replica_update_that_runs_out_of_gpu_memory_ends_with_what_did_not_fit_and_the_fixes():
    from lightning_bamboo.errors import OutOfDeviceMemory

    layers = StageContainer({4: nn.Linear(3, 3), 5: nn.Linear(3, 3)})
    replica = Replica(2, layers, _OutOfMemoryAdamW(layers.parameters()))
    for p in layers.parameters():
        p.grad = torch.ones_like(p)
    replica.step(None, defer=True)
    with pytest.raises(OutOfDeviceMemory) as raised:
        replica.settle()
    message = str(raised.value)
    assert message.startswith("the update of the replica of stage 2 (layers 4-5) did not fit in the memory of cpu")
    assert 'replica_placement="host"' in message and "a deeper pipeline" in message
    assert "Tried to allocate 2.00 GiB" in message  # torch's own first line, kept
    assert isinstance(raised.value, MemoryError) and isinstance(raised.value.__cause__, torch.OutOfMemoryError)


@CUDA
def test_a_real_cuda_out_of_memory_names_the_gpus_memory():
    from lightning_bamboo.engine.replica_location import must_fit
    from lightning_bamboo.errors import OutOfDeviceMemory

    device = torch.device("cuda", 0)
    with pytest.raises(OutOfDeviceMemory, match=r"the test's tensor did not fit in the memory of cuda:0 \(.* GiB free "
                                                 r"of .*\)\. Fix: replica_placement=\"host\""):
        with must_fit("the test's tensor", device):
            torch.empty(1 << 50, dtype=torch.uint8, device=device)  # a PiB
    torch.ones(1, device=device)  # the GPU serves the next allocation


@CUDA
def test_gradients_on_the_gpu_gathered_for_a_gpu_to_gpu_transport_stay_on_the_gpu_unchanged():
    layer = nn.Linear(64, 32).cuda()
    layer(torch.randn(8, 64, device="cuda")).sum().backward()
    on_device, mask = flat_grads(layer, on_device=True)
    pinned, same = flat_grads(layer)
    assert on_device.is_cuda and not pinned.is_cuda and torch.equal(mask, same)
    assert torch.equal(on_device.cpu(), pinned)
    again, _ = flat_grads(layer, out=on_device, on_device=True)  # the buffer reused
    assert again.data_ptr() == on_device.data_ptr() and torch.equal(again.cpu(), pinned)


def test_after_its_first_step_a_replica_stays_or_moves_by_what_the_steps_peak_left_of_the_gpu():
    from lightning_bamboo.engine.replica_location import STEP_MARGIN, replica_stays_on_gpu

    params, total = 2**28, 80 * GiB  # a replica of 4 GiB (weights 1 GiB of it, on the GPU already when hosted)
    margin = int(total * STEP_MARGIN)
    # on the GPU: stays while the step's peak left the margin free
    assert replica_stays_on_gpu(True, params, free=10 * GiB, total=total, reserved=60 * GiB, peak=60 * GiB)
    assert not replica_stays_on_gpu(True, params, free=margin - 1, total=total, reserved=70 * GiB, peak=70 * GiB)
    # memory the allocator reserved and the peak did not use counts as left
    assert replica_stays_on_gpu(True, params, free=0, total=total, reserved=78 * GiB, peak=78 * GiB - margin)
    # in host memory: moves when 3 GiB more (its gradients and moments) still leave the margin
    assert replica_stays_on_gpu(False, params, free=3 * GiB + margin, total=total, reserved=40 * GiB, peak=40 * GiB)
    assert not replica_stays_on_gpu(False, params, free=3 * GiB + margin - 1, total=total, reserved=40 * GiB,
                                    peak=40 * GiB)


def test_on_cpu_a_replica_has_no_other_place():
    replica = _replica(HOST)
    before = [p.data_ptr() for p in replica.module.parameters()]
    replica.place(on_gpu=False)
    replica.place(on_gpu=True)
    assert not replica.hosted and [p.data_ptr() for p in replica.module.parameters()] == before


@CUDA
def test_a_replica_moved_between_the_gpu_and_host_memory_updates_bit_for_bit_as_one_that_stayed():
    stayed, moved = _replica(GPU), _replica(GPU, hosted=True)
    for step in range(4):
        grads = [torch.randn_like(p) for p in stayed.module.parameters()]
        for replica in (stayed, moved):
            for p, g in zip(replica.module.parameters(), grads, strict=True):
                p.grad = g.to(p.device)
            replica.step(None, defer=True)
        moved.place(on_gpu=step % 2 == 0)  # due update applied where it was, then the move
        assert moved.hosted == (step % 2 == 1)
        assert all(p.is_cuda != moved.hosted for p in moved.module.parameters())
        stayed.settle()
        for a, b in zip(stayed.module.parameters(), moved.module.parameters(), strict=True):
            assert torch.equal(a.cpu(), b.cpu()), step
        for a, b in zip(stayed.optimizer.state.values(), moved.optimizer.state.values(), strict=True):
            assert torch.equal(a["exp_avg_sq"].cpu(), b["exp_avg_sq"].cpu()), step
    x = torch.randn(4, 8, device=GPU)
    assert torch.equal(stayed.compute_module()(x), moved.compute_module()(x))
