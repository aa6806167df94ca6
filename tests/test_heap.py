"""``engine.heap``: freed tensors give their memory back to the system, measured in processes of their own."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

# Tensors filled, then freed: the RSS they leave behind, in MiB. "large": three of 8 MiB, after a 24 MiB one was freed
# (glibc then serves everything below 24 MiB from its heap). "small": 384 of 64 KiB, below one that stays (the heap's
# top cannot shrink). With "kept" the process first calls ``keep_heap_small`` and, after freeing, ``give_back``.
_PROBE = """
import sys, torch
from lightning_bamboo.engine import heap
case, kept = sys.argv[1], sys.argv[2] == "kept"
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
if kept:
    assert heap.keep_heap_small()
torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
before = rss()
if case == "large":
    tensors = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]
else:
    tensors = [torch.empty(64 << 10, dtype=torch.uint8).fill_(1) for _ in range(384)]
    pin = torch.empty(64 << 10, dtype=torch.uint8).fill_(1)
del tensors
if kept:
    heap.give_back()
print((rss() - before) >> 20)
"""


def _left_behind(case: str, kept: bool) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, case, "kept" if kept else "default"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_freed_tensors_leave_no_heap_behind():
    """With glibc's defaults the 8 MiB tensors come from its heap once a larger one was freed, and their 24 MiB stay
    in the RSS, as do the small ones' under a tensor still in use. Kept small and given back, neither stays."""
    default = {case: _left_behind(case, kept=False) for case in ("large", "small")}
    kept = {case: _left_behind(case, kept=True) for case in ("large", "small")}
    assert min(default.values()) >= 20 and max(kept.values()) <= 2, (default, kept)
