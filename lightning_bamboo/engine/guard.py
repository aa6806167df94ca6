"""``StepGuard``: a training step on a worker thread, ended at once when a peer is lost."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lightning_bamboo.engine.comm_process import abort_generation
from lightning_bamboo.errors import BambooError, FatalLoss, PeerLost

__all__ = ["STEP_FINISH_SECONDS", "PeerLost", "StepGuard", "is_comm_error"]

#: the most seconds a step may take to end after its generation's communication was aborted
STEP_FINISH_SECONDS = 60.0
#: a step running this many times its recent median (and at least ``STALL_MIN_SECONDS``) has its peers probed
STALL_TIMES = 2.0
STALL_MIN_SECONDS = 0.3
#: seconds between two probe rounds while a step stays stalled
STALL_PROBE_EVERY = 1.0
#: the most seconds a step's end waits for the probe round it started (its store calls are bounded by their own)
PROBER_JOIN_SECONDS = 5.0


class StepGuard:
    """Runs a step on a worker thread so that a lost peer can never block the caller.

    A send or receive with a frozen or vanished peer would block until the process-group timeout.
    So the step runs on a worker thread while the caller waits for it *or* for ``lost`` (set by the
    membership watcher). On a loss the guard aborts the generation's communication
    (``comm_process.abort_generation``): every wait of the old process group ends at once, the step
    thread raises out of it and ends, and only then does the failover go on. No thread of the old
    generation is left behind; one still computing after ``finish_within`` seconds is a fatal error.

    ``check_fenced`` raises (``membership.fence.Fenced``) once this node itself may have been declared lost: the
    guard then ends the step the same way and raises that, whether the step was blocked (a partition: its peers
    unreachable) or failed (its peers moved on and hung up).
    """

    def __init__(self, lost: threading.Event, describe: Callable[[], tuple[str, ...]], detection_timeout: float,
                 finish_within: float = STEP_FINISH_SECONDS, check_fenced: Callable[[], None] = lambda: None,
                 probe: Callable[..., object] = lambda **_: None) -> None:
        self.lost, self.describe, self.detection_timeout = lost, describe, detection_timeout
        self.finish_within = finish_within
        #: ``probe(unreachable=...)`` finds the peers whose process is gone (and, with ``unreachable``, whose machine
        #: answers nothing) and declares them lost (``Session.probe_peers``): called on a communication error, before
        #: waiting for the store, and on another thread while a step stalls (``stalled``)
        self.probe = probe
        self._took: deque[float] = deque(maxlen=8)  # seconds the last steps took
        self._prober: threading.Thread | None = None  # the probe round a stalled step started
        #: raises (``membership.fence.Fenced``) when this node may have been declared lost itself
        self.check_fenced = check_fenced

    def stalled(self) -> float:
        """Seconds after which a running step counts as stalled: ``STALL_TIMES`` its median of the last steps, at
        least ``STALL_MIN_SECONDS``; before any step finished, half the detection timeout."""
        if not self._took:
            return self.detection_timeout / 2
        return max(STALL_MIN_SECONDS, STALL_TIMES * statistics.median(self._took))

    def run(self, fn: Callable[[], Any], busy: Callable[[], bool] = lambda: False) -> Any:
        """``fn()`` on the step thread; its value, or what ended it (``PeerLost`` at a loss, ``Fenced``...). A probe
        round it started is over when it returns (bounded by ``PROBER_JOIN_SECONDS``: a store that does not answer)."""
        try:
            return self._run(fn, busy)
        finally:
            if self._prober is not None:
                self._prober.join(PROBER_JOIN_SECONDS)
                self._prober = None

    def _run(self, fn: Callable[[], Any], busy: Callable[[], bool]) -> Any:
        result: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                result["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                result["error"] = err
            finally:
                done.set()

        thread = threading.Thread(target=work, name="bamboo-step", daemon=True)
        started = time.monotonic()
        thread.start()
        next_probe = started + self.stalled()
        while not done.wait(0.02):
            if time.monotonic() >= next_probe and not self.lost.is_set() and (
                    self._prober is None or not self._prober.is_alive()):
                # A step this much slower than the last ones waits on something: a peer whose machine went silent
                # blocks it without an error. Ask the peers' machines (a probe round: well under a second), again
                # every ``STALL_PROBE_EVERY`` while it stays stalled.
                self._prober = threading.Thread(target=lambda: self.probe(unreachable=True), name="bamboo-probe",
                                                daemon=True)
                self._prober.start()
                next_probe = time.monotonic() + STALL_PROBE_EVERY
            if self.lost.is_set() and not busy():
                lost = PeerLost(f"lost {', '.join(self.describe()) or 'a peer'} during the step", self.describe())
                abort_generation()
                if not done.wait(self.finish_within):
                    raise FatalLoss(f"{lost}; the step did not end within {self.finish_within:g} s of aborting its "
                                    "communication, so it cannot be failed over: start again from the checkpoint")
                thread.join()
                raise lost
            if not busy():
                try:
                    self.check_fenced()
                except BambooError:
                    # This node's lease may have ended (frozen, starved or cut off): its peers may be failing over
                    # without it, and its step may wait for ever on a peer that moved on (a partition, NCCL). It
                    # stops; the fence says why.
                    abort_generation()
                    done.wait(self.finish_within)
                    raise
        thread.join()
        if "error" not in result:
            self._took.append(time.monotonic() - started)
        if "error" in result:
            err = result["error"]
            if isinstance(err, PeerLost):
                raise err
            if isinstance(err, RuntimeError):
                # A receive from a dead peer fails fast, with messages that vary by transport and
                # timing; wait (bounded) for the store to say whether someone died. A peer whose process is gone
                # is said so at once (its liveness port refuses); one gone silent, when its lease ends.
                if is_comm_error(err) and not self.lost.is_set():
                    self.probe(unreachable=False)
                if self.lost.wait(self.detection_timeout if is_comm_error(err) else min(2.0, self.detection_timeout)):
                    raise PeerLost(f"lost {', '.join(self.describe())}: {err}", self.describe()) from err
                # No peer was lost: this node may have been, frozen or starved past its lease while the others
                # failed over and closed the old group (its failed message says only that a peer hung up).
                try:
                    self.check_fenced()
                except BambooError as fenced:
                    raise fenced from err
            raise err
        return result["value"]


def is_comm_error(err: BaseException) -> bool:
    text = str(err).lower()
    return any(
        k in text
        for k in ("aborted", "communication process", "connection", "gloo", "closed", "closure", "reset", "peer", "timed out", "timeout", "broken pipe", "nccl")
    )
