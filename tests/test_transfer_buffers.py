"""What the communication layer keeps after a step of one pipeline: no buffer of the stage's gradients or weights.

DeepSpeed all-reduces the gradients over a pipeline's data-parallel group and broadcasts the weights over it when the
engine is built. In a group of one process both send nothing, yet each copied what it sent into a transfer buffer of
the communication process (``engine.comm_process``), which stayed for the rest of the generation: 4 bytes per
parameter of the stage in the worker and in its communication process. One process, the abortable backend, a real
engine and step; the weights must equal a plain torch step's.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_bamboo.engine import comm_process
from lightning_bamboo.membership.address import free_port

WIDTH = 512  # a 512 x 512 layer: 1 MiB of weights, each parameter above the transfer buffers' smallest size


class _Unused(nn.Module):
    """A layer whose parameter gets no gradient: DeepSpeed's reduction gives it zeros, so AdamW steps it anyway."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH), nn.Tanh(), _Unused(), nn.Linear(WIDTH, WIDTH)]


@pytest.fixture
def one_process(monkeypatch):
    import deepspeed.comm.comm as ds_comm

    from lightning_bamboo.engine.construct import ensure_deepspeed_comm

    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's PipelineModule reads it
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60))
    comm_process.open_generation("127.0.0.1", port, "transfer-buffers", 60.0)
    dist.init_process_group(comm_process.BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    ensure_deepspeed_comm(comm_process.BACKEND)
    try:
        yield
    finally:
        ds_comm.cdb = None
        dist.destroy_process_group()
        comm_process.abort_generation()
        del server


def test_a_step_of_one_pipeline_leaves_no_transfer_buffer_of_its_gradients(one_process):
    from lightning_bamboo.engine.construct import build_engine, build_pipeline_module, deepspeed_config
    from lightning_bamboo.topology.layout import Layout

    layers = _layers()
    reference = nn.Sequential(*_layers())
    module = build_pipeline_module(layers, Layout(1, 1, (0, 4)), nn.functional.mse_loss, datetime.timedelta(seconds=60))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    engine = build_engine(module, optimizer, deepspeed_config(2, 2, 1), datetime.timedelta(seconds=60))
    generator = torch.Generator().manual_seed(1)
    batch = [(torch.randn(2, WIDTH, generator=generator), torch.randn(2, WIDTH, generator=generator)) for _ in range(2)]
    engine.train_batch(data_iter=iter(batch))

    gradient_bytes = 4 * sum(p.numel() for p in module.parameters())
    assert comm_process.buffer_bytes() < WIDTH * WIDTH * 4, (
        f"{comm_process.buffer_bytes()} bytes of transfer buffers kept after one step of one pipeline "
        f"(the stage's gradients: {gradient_bytes} bytes)")
    # the same step in plain torch: DeepSpeed's mean over the micro-batches, and zeros for the unused parameter
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in batch:
        (nn.functional.mse_loss(reference(x), y) / len(batch)).backward()
    reference[2].unused.grad = torch.zeros(WIDTH)
    reference_optimizer.step()
    for mine, theirs in zip(module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert not torch.equal(layers[2].unused, torch.ones(WIDTH))  # stepped: AdamW's weight decay moved it


def test_a_one_off_transfer_gives_its_buffer_back_at_once(one_process):
    """A message of 64 MiB or more (a layer's weights and optimizer state in a failover) comes once: its transfer
    buffer, mapped by the worker and its communication process, goes when the operation is done; a smaller one stays
    for the next message of its size."""
    large = torch.ones(comm_process.ONE_OFF_BYTES // 4)
    dist.all_reduce(large)
    assert comm_process.buffer_bytes() == 0 and torch.equal(large, torch.ones_like(large))
    small = torch.ones(1 << 20)
    dist.all_reduce(small)
    assert comm_process.buffer_bytes() == 4 << 20
