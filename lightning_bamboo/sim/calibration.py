"""Turning a timed ``lightning-bamboo demo`` run into simulator parameters (pure: no processes).

The demo prints ``step N/K`` each time its progress grows (it polls every 50 ms). A benchmark
stamps each such line with the time it arrived; these functions turn the stamps into step
times per segment of the run, checkpoint-save pauses and recovery pauses.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence

from lightning_bamboo.errors import BambooConfigError

_PROGRESS = re.compile(r"^\s*step\s+(?P<step>\d+)/(?P<target>\d+)\b")


def parse_progress(lines: Iterable[tuple[float, str]]) -> list[tuple[float, int]]:
    """``(seconds, text)`` of the demo's stdout -> ``(seconds, step)`` for every progress line."""
    out = []
    for seconds, text in lines:
        match = _PROGRESS.match(text)
        if match:
            out.append((seconds, int(match["step"])))
    return out


def step_intervals(progress: Sequence[tuple[float, int]]) -> dict[int, float]:
    """``step -> seconds from the previous step's line``, only where the previous line is step - 1.

    After a restart the demo goes back to a checkpoint's step and prints those steps again; a later
    line of the same step replaces the earlier one (the run that counted is the last one).
    """
    out: dict[int, float] = {}
    for (t0, s0), (t1, s1) in zip(progress, progress[1:], strict=False):
        if s1 == s0 + 1:
            out[s1] = t1 - t0
    return out


def clean_steps(first: int, last: int, checkpoint_every: int) -> list[int]:
    """Steps in ``first..last`` whose interval holds no checkpoint save (a save follows step k % every == 0)."""
    if first > last:
        raise BambooConfigError(
            f"empty step segment {first}..{last}; the run needs more steps between events"
        )
    return [s for s in range(first, last + 1) if (s - 1) % checkpoint_every != 0]


def save_steps(first: int, last: int, checkpoint_every: int) -> list[int]:
    """Steps in ``first..last`` whose interval starts with a checkpoint save (after step k % every == 0)."""
    return [s for s in range(first, last + 1) if (s - 1) % checkpoint_every == 0 and s - 1 > 0]


def mean_of(intervals: dict[int, float], steps: Iterable[int], what: str) -> float:
    """Mean interval over ``steps`` (the demo sees steps through a 50 ms poll: a mean cancels that
    rounding, a median keeps it); an error naming ``what`` when none of them was observed."""
    values = [intervals[s] for s in steps if s in intervals]
    if not values:
        raise BambooConfigError(
            f"no step interval observed for {what} (steps {list(steps)}, seen {sorted(intervals)}); "
            "run the demo with more steps or without --quiet"
        )
    return statistics.fmean(values)
