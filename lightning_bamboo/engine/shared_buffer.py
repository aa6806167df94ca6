"""The replica holder's shared buffer for its owner's gradients: a memory file that the owner maps when both run
on one host (``engine.exchange``, rule 3 of its protocol)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import weakref
from pathlib import Path

import torch

from lightning_bamboo.engine.comm_child import map_memory, new_memory_file

log = logging.getLogger(__name__)


def host_identity() -> str:
    """This machine (host name and boot): two processes share memory only where these are equal."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def offer_shared_buffer(numel: int) -> tuple[torch.Tensor, int, bytes]:
    """A buffer of ``numel`` gradient elements in a memory file, its token, and the offer that names it.

    The peer on this host opens the file through ``/proc/<pid>/fd/<fd>`` (``map_offered_buffer``): no
    manager process is involved (torch's ``file_system`` sharing has one per process, and a peer that
    frees a buffer after that manager died with its process is aborted by the C++ runtime). The memory
    lives while either end maps it; the descriptor is closed when the buffer is freed.
    """
    token = secrets.randbits(62) + 1
    memory, fd = new_memory_file(f"bamboo-grads-{token}", _gradient_bytes(numel))
    buffer = memory.view(torch.get_default_dtype())
    weakref.finalize(buffer, os.close, fd)  # open for the peer while the buffer lives (its mapping needs none)
    return buffer, token, json.dumps([host_identity(), token, os.getpid(), fd, numel]).encode()


def _gradient_bytes(numel: int) -> int:
    return numel * torch.get_default_dtype().itemsize


def map_offered_buffer(payload: bytes, numel: int) -> tuple[torch.Tensor, int] | None:
    """The buffer a peer offered (``offer_shared_buffer``) and its token, mapped here; None if this
    process cannot map it (another machine, another size, no access to the peer's descriptors). The offer is JSON
    (it was a pickle: nothing a peer sends is unpickled here); one of another form is not taken."""
    try:
        host, token, pid, fd, offered = json.loads(payload)
    except (ValueError, TypeError):
        log.warning("the replica holder's offer of a shared buffer is not one: not taken")
        return None
    if not (isinstance(host, str) and all(isinstance(n, int) and n > 0 for n in (token, pid, offered))
            and isinstance(fd, int) and fd >= 0):
        log.warning("the replica holder's offer of a shared buffer is not one: not taken")
        return None
    if host != host_identity() or offered != numel:
        return None
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if os.readlink(path) != f"/memfd:bamboo-grads-{token} (deleted)":  # not the file offered (another pid space)
            return None
        return map_memory(os.open(path, os.O_RDWR), _gradient_bytes(numel)).view(torch.get_default_dtype()), token
    except (OSError, ValueError) as err:
        log.debug("could not map the replica holder's shared buffer %s: %s", path, err)
        return None

