"""``engine.heap``: freed tensors give their memory back to the system, measured in processes of their own."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

# Tensors filled, then freed: the RSS they leave behind, in MiB. "large": three of 8 MiB, after a 24 MiB one was freed
# (glibc then serves everything below 24 MiB from its heap). "small": 384 of 64 KiB, below one that stays (the heap's
# top cannot shrink). With "kept" the process first calls ``keep_heap_small`` and, after freeing, ``give_back`` with the
# floor given (bytes; "default": the module's). It prints the RSS left in MiB, the heap's free bytes in MiB before the
# call and whether it gave back.
_PROBE = """
import sys, torch
from lightning_bamboo.engine import heap
case, kept, floor, count = sys.argv[1], sys.argv[2] == "kept", sys.argv[3], int(sys.argv[4])
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
if kept:
    assert heap.keep_heap_small()
torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
before = rss()
if case == "large":
    tensors = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]
else:
    tensors = [torch.empty(64 << 10, dtype=torch.uint8).fill_(1) for _ in range(count)]
    pin = torch.empty(64 << 10, dtype=torch.uint8).fill_(1)
del tensors
free = heap.free_bytes()
gave = kept and (heap.give_back() if floor == "default" else heap.give_back(int(floor)))
print((rss() - before) >> 20, (free or 0) >> 20, int(gave))
"""


def _run_probe(case: str, kept: bool, floor: str = "0", count: int = 384) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, case, "kept" if kept else "default", floor, str(count)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    left, free, gave = map(int, out.stdout.split())
    return left, free, gave


def _left_behind(case: str, kept: bool) -> int:
    return _run_probe(case, kept)[0]


def test_freed_tensors_leave_no_heap_behind():
    """With glibc's defaults the 8 MiB tensors come from its heap once a larger one was freed, and their 24 MiB stay
    in the RSS, as do the small ones' under a tensor still in use. Kept small and given back, neither stays."""
    default = {case: _left_behind(case, kept=False) for case in ("large", "small")}
    kept = {case: _left_behind(case, kept=True) for case in ("large", "small")}
    assert min(default.values()) >= 20 and max(kept.values()) <= 2, (default, kept)


def test_a_heap_with_less_free_than_the_floor_is_left_as_it_is():
    """The default floor (64 MiB) leaves 24 MiB of freed small tensors in the heap (a trim would cost more than they
    are worth), and gives back 96 MiB of them; the heap's free bytes are counted, the freed chunks under the pin too."""
    left, free, gave = _run_probe("small", kept=True, floor="default", count=384)
    assert (gave, left >= 20, 24 <= free < 64) == (0, True, True), (left, free, gave)
    left, free, gave = _run_probe("small", kept=True, floor="default", count=1536)
    assert (gave, left <= 2, free >= 96) == (1, True, True), (left, free, gave)
