"""One way for a node to leave the job, whichever door drives it.

Whatever says so (a SIGTERM from the launcher or a scheduler, a cloud's spot notice polled on a thread, a
``PreemptionCallback``'s signal or poller) sets or shows one request, and the node leaves after the step in flight
commits: it announces that it leaves, its stage is served from its replica by the others, and its process exits 0.
The Lightning door, the DeepSpeed door and the demo's worker all read :data:`LEAVE`; nothing else keeps such a flag.

Everything a signal handler touches here is one attribute write (an ``Event.set``), no lock, no I/O, no collective:
a handler that waited for a lock the interrupted code holds would deadlock.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from lightning_bamboo.runtime.notices import Notice, NoticePoller, NoticeWatcher

__all__ = ["LEAVE", "Leave", "request_leave"]


class HoldsNotice(Protocol):
    """A source that keeps the notice it received (``callbacks.preemption.SignalFlag``); None until one came."""

    notice: Notice | None


class Leave:
    """This process's request to leave the job: set once, read at every step boundary and inside a step."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        #: the notice holders attached (a ``PreemptionCallback``'s flag while it is installed); a tuple replaced
        #: whole, never mutated, so a reader on any thread sees a consistent value without a lock
        self._holders: tuple[HoldsNotice, ...] = ()

    def request(self) -> None:
        """Leave after the step in flight commits (safe in a signal handler: one ``Event.set``)."""
        self._requested.set()

    def requested(self) -> bool:
        """True once anything asked this node to leave: :meth:`request`, or a notice an attached holder keeps."""
        return self._requested.is_set() or self.notice_pending()

    def notice_pending(self) -> bool:
        """A notice held by an attached source (a few attribute reads: cheap between micro-batches)."""
        return any(holder.notice is not None for holder in self._holders)

    def attach(self, holder: HoldsNotice) -> None:
        """Count ``holder``'s notice as a request to leave until :meth:`detach`."""
        if holder not in self._holders:
            self._holders = (*self._holders, holder)

    def detach(self, holder: HoldsNotice) -> None:
        self._holders = tuple(h for h in self._holders if h is not holder)

    @property
    def attached(self) -> tuple[HoldsNotice, ...]:
        return self._holders

    def on_sigterm(self) -> bool:
        """SIGTERM is a notice from here on: a flag-only handler calls :meth:`request`. Python installs handlers
        only on the main thread: elsewhere nothing changes and False is returned (pollers still work)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(signal.SIGTERM, self._on_signal)
        return True

    def _on_signal(self, _signum: int, _frame: Any) -> None:
        self.request()

    def watch(self, pollers: Sequence[NoticePoller], interval: float,
              on_notice: Callable[[Notice], None] | None = None) -> NoticeWatcher | None:
        """Poll ``pollers`` every ``interval`` seconds on a daemon thread; the first notice goes to ``on_notice``
        (default: :meth:`request`). Returns the started watcher (``stop()`` it at the end), None without pollers."""
        if not pollers:
            return None
        watcher = NoticeWatcher(pollers, on_notice if on_notice is not None else (lambda _notice: self.request()),
                                interval=interval)
        watcher.start()
        return watcher


#: the process's one request to leave (a worker is one node of one job)
LEAVE = Leave()


def request_leave() -> None:
    """Flag-only (safe in a signal handler): this node leaves after the step in flight commits."""
    LEAVE.request()
