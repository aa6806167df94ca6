"""The C allocator, told to give memory back: a node's RSS then follows what its tensors hold, step after step.

glibc serves allocations below its mmap threshold from its heap and keeps their memory when they are freed, and the
threshold rises to the size of the largest block freed so far (up to 32 MiB): after the first large tensor is freed,
every activation, logit and optimizer temporary below that size comes from the heap. RSS counts the heap's free
memory too. Measured on GPT-2 small's shape in 4 stages (``benchmarks/memory.py``), it grew by up to 0.5 GiB a node
over six steps, and an optimizer step's temporaries came on top of what the step's activations had left.

``keep_heap_small`` fixes the threshold (``MMAP_THRESHOLD``: a tensor of that size or more is mapped on its own and
unmapped when freed); ``give_back`` returns the heap's free pages (``malloc_trim``) where a step has freed its
activations and an update is about to allocate its temporaries, when there are at least ``GIVE_BACK_AT`` bytes of them.
Elsewhere than on glibc both do nothing.

Why a floor: a trim walks every arena (about a millisecond), and the next step's allocations fault the pages it returned
back in. On ``benchmarks/rc_overhead.py``'s 2.8M-parameter model the heap held 3-34 MiB free at each update, and
trimming it every step made the step about 3% slower, twice for a node updating a replica too; on GPT-2 small's stages
(``benchmarks/memory.py``) it held 20-750 MiB, where the trim is what keeps the RSS at what the tensors hold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

#: allocations of this many bytes or more are mapped on their own and given back when freed (``keep_heap_small``)
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
#: ``give_back`` trims only a heap holding at least this many free bytes (see the module's docstring)
GIVE_BACK_AT = 64 << 20


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): the heap's counters, every arena summed."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - both are glibc's: elsewhere nothing is done
        if hasattr(libc, "mallinfo2"):
            libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None


def keep_heap_small() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` for this process (setting it also stops glibc from raising
    it as large blocks are freed); False where the allocator is not glibc. Call it before the stage is built."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def free_bytes() -> int | None:
    """The bytes the heap holds free, every arena and the free chunks between used ones counted (``mallinfo2``); None
    where the allocator cannot say."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


def give_back(at_least: int = GIVE_BACK_AT) -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``: every arena, the free chunks between
    used ones too) when it holds ``at_least`` bytes free, or when it cannot say how many; False where nothing was given
    back or the allocator has no such call."""
    libc = _libc()
    if libc is None:
        return False
    free = free_bytes()
    if free is not None and free < at_least:
        return False
    return bool(libc.malloc_trim(0))
