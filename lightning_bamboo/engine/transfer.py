"""Moving whole objects between two ranks of the process group: a stage's states to a node that takes it over
(failover, a move, a joining node), the lineage of the ring exchange; and waiting for point-to-point requests.

A stage's states are most of a process's memory: ``exchange_objects`` serialises them once, sends that buffer as
it is, and reads them back from the received bytes without a second copy.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import IO, Any, cast

import torch
import torch.distributed as dist


def exchange_objects(payload: Any, send_to: int | None, recv_from: int | None) -> Any:
    """Send a picklable object to one rank and receive one from another at the same time.

    A stage's states are most of a process's memory: the sender serialises them once and sends that buffer as it
    is, and the receiver keeps one copy of the bytes while it reads them back (a serialised stage each side, no
    more)."""
    requests = []
    if send_to is not None:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)  # the buffer's own memory, not a copy
        size = torch.tensor([data.numel()], dtype=torch.int64)
        requests.append(dist.isend(size, send_to))
    received = None
    if recv_from is not None:
        incoming = torch.zeros(1, dtype=torch.int64)
        wait_all([dist.irecv(incoming, recv_from)])
    wait_all(requests)
    requests = []
    if send_to is not None:
        requests.append(dist.isend(data, send_to))
    if recv_from is not None:
        received = torch.empty(int(incoming.item()), dtype=torch.uint8)
        requests.append(dist.irecv(received, recv_from))
    wait_all(requests)
    if send_to is not None:
        del data, buffer  # freed before the received bytes are read back
    if received is None:
        return None
    # read back from the received bytes themselves (``torch.load`` reads each tensor into its storage), not a copy
    reader = cast(IO[bytes], _ReadOnly(memoryview(cast(Any, received.numpy()))))
    # trusted: sent by a rank of the job's own process group, whose network the job trusts as torch.distributed does
    # (its *_object collectives unpickle too); a joining node's training state holds what Lightning's checkpoints do
    return torch.load(reader, map_location="cpu", weights_only=False)  # trusted: a rank of the job's process group


class _ReadOnly(io.RawIOBase):
    """A seekable binary file over bytes in memory, read without copying them first (``io.BytesIO`` copies all of
    them): ``torch.load`` reads each tensor straight into its storage (``readinto``)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data, self._position = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._data) - self._position))
        memoryview(buffer).cast("B")[:n] = self._data[self._position:self._position + n]
        self._position += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._data)}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position


def wait_all(requests: Iterable[Any]) -> None:
    """Wait for each request of ``requests``; ``None`` stands for one this rank was not part of."""
    for request in requests:
        if request is not None:
            request.wait()
