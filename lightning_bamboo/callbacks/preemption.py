"""PreemptionCallback: flag-only signal handlers and cloud notices, agreed on by all ranks at a step boundary."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.runtime.leave import LEAVE
from lightning_bamboo.runtime.notices import (
    SOURCES,
    Notice,
    NoticePoller,
    NoticeWatcher,
)

log = logging.getLogger(__name__)

__all__ = ["PreemptionCallback", "SignalFlag", "preemption_pending"]

OnNotice = Literal["auto", "checkpoint", "stop", "log"]
_ACTIONS = ("auto", "checkpoint", "stop", "log")
_SHORTHANDS: dict[str, Callable[..., NoticePoller]] = SOURCES


def preemption_pending() -> bool:
    """True when any installed :class:`PreemptionCallback` holds a notice this process has not yet acted on.

    Local and lock-free (a few attribute reads): cheap enough to call between micro-batches inside a step.
    It says "this rank was warned", not that the ranks agreed; agreement happens at the step boundary.
    An installed callback's flag is attached to the process's one request to leave (``runtime.leave.LEAVE``).
    """
    return LEAVE.notice_pending()


def _is_lightning_sigterm_notifier(handler: object) -> bool:
    # Lightning's own SIGTERM handler broadcasts from inside the handler (a collective that deadlocks when
    # a non-zero rank is signalled) and kills the launcher's children; it is the one thing never chained.
    return getattr(handler, "__name__", "") == "_sigterm_notifier_fn" and hasattr(handler, "__self__")


class SignalFlag:
    """The state a signal handler may touch: one attribute assignment, nothing else.

    ``notice`` is written by signal handlers (on the main thread, between bytecodes) and by the notice
    thread; the first notice wins. No lock is taken (a handler that waits for a lock the interrupted code
    holds would deadlock), no I/O, no collective.
    """

    def __init__(self, grace_period: float) -> None:
        self.grace_period = grace_period
        self.notice: Notice | None = None
        self.event = threading.Event()  # set by the notice thread and by `notify()`, never by a handler

    def record(self, notice: Notice) -> None:
        """Keep ``notice`` unless one is already held; a notice without a deadline gets now + grace period."""
        if self.notice is None:
            if notice.deadline is None:
                notice = dataclasses.replace(notice, deadline=time.time() + self.grace_period)
            self.notice = notice

    def clear(self) -> None:
        self.notice = None
        self.event.clear()

    def __getstate__(self) -> dict[str, Any]:  # picklable for spawn launchers: a new process, no notice
        return {"grace_period": self.grace_period}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["grace_period"])  # type: ignore[misc]


class _FlagHandler:
    """A flag-only handler for one signal that then calls the handler it displaced."""

    def __init__(self, flag: SignalFlag, previous: Any, bypass_lightning_sigterm: bool = True) -> None:
        self.flag = flag
        self.previous = previous
        self.bypass_lightning_sigterm = bypass_lightning_sigterm

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.flag.notice is None:
            now = time.time()
            self.flag.notice = Notice(
                source=f"signal:{signal.Signals(signum).name}",
                deadline=now + self.flag.grace_period,
                detail=f"received at {now:.3f}",
            )
        self._chain(self.previous, signum, frame)

    def _chain(self, previous: Any, signum: int, frame: FrameType | None) -> None:
        # SIG_DFL / SIG_IGN / None are dispositions, not functions: taking over the signal is the point
        # (SIG_DFL would terminate the process before the step boundary), so they are not invoked.
        if not callable(previous):
            return
        if not self.bypass_lightning_sigterm:
            previous(signum, frame)
            return
        if _is_lightning_sigterm_notifier(previous):
            return
        inner = getattr(previous, "signal_handlers", None)  # Lightning's composite of handlers
        if isinstance(inner, list) and type(previous).__name__ == "_HandlersCompose":
            for handler in inner:
                self._chain(handler, signum, frame)
            return
        previous(signum, frame)


class PreemptionCallback(Callback):
    """Turns preemption notices into a clean handover or a last checkpoint, at a step boundary, on all ranks.

    Notices come from signals (flag-only handlers, chained with the handlers they displace) and from cloud
    metadata pollers on a daemon thread. Nothing happens inside a signal handler except recording the
    notice; the engine may poll :func:`preemption_pending` inside a step. At the end of every
    ``check_every_n_steps``-th training batch all ranks exchange ``(has notice, seconds left, checkpoint
    estimate)`` with one ``strategy.all_gather`` and take the same decision:

    * ``on_notice="auto"``: if the strategy has ``handle_preemption_notice(notice, leaving_ranks=...)``
      and every rank's call returns True, the strategy owns the rest (Bamboo's proactive handover);
      otherwise as ``"checkpoint"``.
    * ``"checkpoint"``: if the earliest deadline leaves more than the checkpoint estimate, write
      ``<dirpath>/preempted-step=N.ckpt`` with ``trainer.save_checkpoint``; then stop.
    * ``"stop"``: set ``trainer.should_stop`` without a checkpoint. ``"log"``: only log.

    Args:
        signals: signal names or numbers whose arrival is a notice (default SIGTERM and SIGUSR1).
        pollers: notice sources: ``"aws"``, ``"gcp"``, ``"azure"`` (default endpoints) or poller objects
            (e.g. ``AwsSpotPoller(endpoint=...)``). Empty: signals only.
        poll_interval: seconds between polls of the sources (Bamboo polls AWS every 3 s).
        grace_period: seconds assumed between a notice that carries no deadline (a signal, GCP's
            ``preempted``) and the kill. 30 s is GCP's notice and Kubernetes' default termination grace.
        checkpoint_seconds: initial estimate of one ``save_checkpoint``; replaced by measured durations.
        on_notice: ``"auto"``, ``"checkpoint"``, ``"stop"`` or ``"log"`` (see above).
        dirpath: where the last checkpoint goes (default ``<default_root_dir>/checkpoints``).
        check_every_n_steps: agree every N training batches (each check is one small all_gather).
        bypass_lightning_sigterm: leave Lightning's own SIGTERM handler out of the chain (it runs a
            collective inside the handler and deadlocks when a non-zero rank is signalled).

    Pollers start at ``setup("fit")``. Signal handlers are installed at ``on_train_start``, on top of the
    SIGTERM handler Lightning registers after ``on_fit_start``, and restored at ``on_train_end`` (or
    ``on_exception``/``teardown``), before Lightning restores its own; a handler someone else has replaced
    since is left alone. Python only lets the main thread install signal handlers: run from another
    thread, the callback logs a warning, leaves the signal dispositions untouched and relies on the pollers
    and :meth:`notify`.
    """

    def __init__(
        self,
        signals: Sequence[str | int] = ("SIGTERM", "SIGUSR1"),
        pollers: Sequence[str | NoticePoller] = (),
        poll_interval: float = 3.0,
        grace_period: float = 30.0,
        checkpoint_seconds: float = 10.0,
        on_notice: OnNotice = "auto",
        dirpath: str | None = None,
        check_every_n_steps: int = 1,
        bypass_lightning_sigterm: bool = True,
    ) -> None:
        super().__init__()
        self.signals = tuple(self._parse_signal(s) for s in signals)
        self.pollers = [self._parse_poller(p) for p in pollers]
        for name, value in (("poll_interval", poll_interval), ("grace_period", grace_period)):
            if not (value > 0 and math.isfinite(value)):
                raise BambooConfigError(
                    f"PreemptionCallback({name}={value}): must be a finite number of seconds > 0"
                )
        if not (checkpoint_seconds >= 0 and math.isfinite(checkpoint_seconds)):
            raise BambooConfigError(
                f"PreemptionCallback(checkpoint_seconds={checkpoint_seconds}): must be a finite number of seconds >= 0"
            )
        if on_notice not in _ACTIONS:
            raise BambooConfigError(
                f"PreemptionCallback(on_notice={on_notice!r}): must be one of {', '.join(map(repr, _ACTIONS))}"
            )
        if check_every_n_steps < 1:
            raise BambooConfigError(
                f"PreemptionCallback(check_every_n_steps={check_every_n_steps}): must be >= 1 (1 = every step)"
            )
        self.poll_interval = poll_interval
        self.grace_period = grace_period
        self.checkpoint_seconds = checkpoint_seconds
        self.on_notice = on_notice
        self.dirpath = dirpath
        self.check_every_n_steps = check_every_n_steps
        self.bypass_lightning_sigterm = bypass_lightning_sigterm

        self.flag = SignalFlag(grace_period)
        self.notices_seen = 0  # notices acted on, over resumes (state_dict)
        self.last_notice: Notice | None = None
        self.last_checkpoint_path: str | None = None
        self.stopped_at_step: int | None = None
        self._installed: dict[int, tuple[Any, _FlagHandler]] = {}
        self._watcher: NoticeWatcher | None = None
        self._batches = 0

    # ----------------------------------------------------------------- configuration helpers
    @staticmethod
    def _parse_signal(value: str | int) -> int:
        try:
            signum = signal.Signals[value.upper()] if isinstance(value, str) else signal.Signals(value)
        except (KeyError, ValueError):
            raise BambooConfigError(
                f"PreemptionCallback(signals=[..., {value!r}, ...]): not a signal of this platform; "
                "use names like 'SIGTERM', 'SIGUSR1' or their numbers"
            ) from None
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            raise BambooConfigError(
                f"PreemptionCallback(signals=[..., {signum.name}, ...]): SIGKILL and SIGSTOP cannot be caught; "
                "a notice needs a catchable signal such as SIGTERM"
            )
        return int(signum)

    @staticmethod
    def _parse_poller(value: str | NoticePoller) -> NoticePoller:
        if isinstance(value, str):
            if value not in _SHORTHANDS:
                raise BambooConfigError(
                    f"PreemptionCallback(pollers=[..., {value!r}, ...]): known sources are "
                    f"{', '.join(map(repr, _SHORTHANDS))}, or pass a poller object with its own endpoint"
                )
            return _SHORTHANDS[value]()
        if not isinstance(value, NoticePoller):
            raise BambooConfigError(
                f"PreemptionCallback(pollers=[..., {value!r}, ...]): a poller needs a `name` and a `poll()` "
                "returning Notice | None"
            )
        return value

    # ----------------------------------------------------------------- public state
    @property
    def notice(self) -> Notice | None:
        """This rank's pending notice (not yet acted on), or None."""
        return self.flag.notice

    def preemption_pending(self) -> bool:
        """Cheap local check, as :func:`preemption_pending` but for this callback only."""
        return self.flag.notice is not None

    def notify(self, notice: Notice) -> None:
        """Record a notice from any thread (a supervisor, a test, a custom source). Never blocks."""
        self.flag.record(notice)
        self.flag.event.set()

    def wait_for_notice(self, timeout: float) -> Notice | None:
        """Block until a notice from a poller or :meth:`notify` arrives, or ``timeout`` passes."""
        self.flag.event.wait(timeout)
        return self.flag.notice

    # ----------------------------------------------------------------- signal handlers
    def install_signal_handlers(self) -> bool:
        """Put a flag-only handler on each configured signal, chaining the current ones. Returns False (and
        changes nothing) when called off the main thread, where Python refuses ``signal.signal``."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "PreemptionCallback: set up on thread %r, but Python only lets the main thread install signal "
                "handlers; %s keep their current handlers. Cloud pollers and PreemptionCallback.notify() still "
                "work; for signals, run the Trainer on the main thread.",
                threading.current_thread().name,
                ", ".join(signal.Signals(s).name for s in self.signals),
            )
            return False
        for signum in self.signals:
            previous = signal.getsignal(signum)
            handler = _FlagHandler(self.flag, previous, self.bypass_lightning_sigterm)
            signal.signal(signum, handler)
            self._installed[signum] = (previous, handler)
        return True

    def restore_signal_handlers(self) -> None:
        """Put back the handlers :meth:`install_signal_handlers` displaced. A signal whose handler is no
        longer ours (someone installed another on top, or restored already) is left as it is."""
        if threading.current_thread() is not threading.main_thread():
            return
        installed, self._installed = self._installed, {}
        for signum, (previous, ours) in installed.items():
            if signal.getsignal(signum) is ours:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    # ----------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        LEAVE.attach(self.flag)
        if self._watcher is None:
            self._watcher = LEAVE.watch(self.pollers, self.poll_interval, self.notify)

    def _stop(self) -> None:
        self.restore_signal_handlers()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        LEAVE.detach(self.flag)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.flag.clear()
        self._batches = 0
        self._start()  # pollers run from here on; a notice during setup is acted on at the first step

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning registers its own SIGTERM handler after on_fit_start and restores what it displaced in
        # its teardown. Installing here nests ours inside that pair: ours is outermost while training, and
        # nothing of ours is left behind whichever order the restores run in.
        self._start()
        self.install_signal_handlers()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.restore_signal_handlers()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    # ----------------------------------------------------------------- the step boundary
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if self._batches % self.check_every_n_steps or getattr(trainer.strategy, "resilience", None) is not None:
            # Under the Bamboo launcher the strategy serves notices (``preemption_pending``): the node announces
            # at its next commit that it leaves and exits once that step committed, and its neighbours take its
            # stage over with no step lost. An agreement here would clear the flag it reads, or stop every node.
            return
        notice = self.flag.notice
        leaving, seconds_left, ckpt_estimate = self._agree(trainer, notice)
        if not leaving:
            return
        self._act(trainer, pl_module, notice, leaving, seconds_left, ckpt_estimate)

    def _agree(self, trainer: Trainer, notice: Notice | None) -> tuple[tuple[int, ...], float, float]:
        """One all_gather of (has notice, seconds left, checkpoint estimate) per rank: every rank gets the
        same leaving ranks, earliest deadline and largest checkpoint estimate, so every rank decides alike."""
        left = notice.seconds_left() if notice is not None else None
        mine = torch.tensor(
            [1.0 if notice is not None else 0.0, math.inf if left is None else left, self.checkpoint_seconds],
            dtype=torch.float64,
            device=trainer.strategy.root_device,
        )
        rows = trainer.strategy.all_gather(mine).reshape(-1, 3).cpu()
        leaving = tuple(int(r) for r in torch.nonzero(rows[:, 0] > 0).flatten().tolist())
        return leaving, float(rows[:, 1].min()), float(rows[:, 2].max())

    def _act(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        notice: Notice | None,
        leaving: tuple[int, ...],
        seconds_left: float,
        ckpt_estimate: float,
    ) -> None:
        self.flag.clear()  # acted on (also on ranks without a notice: nothing to clear there)
        self.notices_seen += 1
        if notice is not None:
            self.last_notice = notice
        step = trainer.global_step
        log.warning(
            "rank %d: preemption notice agreed at step %d (leaving ranks %s, %.1f s left, this rank's notice: %s)",
            trainer.global_rank,
            step,
            list(leaving),
            seconds_left,
            notice,
        )
        pl_module.log(
            "preemption/notices", float(self.notices_seen), on_step=True, on_epoch=False, rank_zero_only=True
        )
        pl_module.log(
            "preemption/seconds_left",
            seconds_left if math.isfinite(seconds_left) else -1.0,
            on_step=True,
            on_epoch=False,
            rank_zero_only=True,
        )
        if self.on_notice == "log":
            return

        if self.on_notice == "auto":
            hook = getattr(trainer.strategy, "handle_preemption_notice", None)
            if callable(hook):
                handled = bool(hook(notice, leaving_ranks=leaving))
                # The fallback below is collective (save_checkpoint), so all ranks must agree on it too.
                if trainer.strategy.reduce_boolean_decision(handled, all=True):
                    return  # the strategy owns the rest; later notices (other ranks) are checked as usual
                log.warning(
                    "rank %d: strategy declined the handover; falling back to a checkpoint",
                    trainer.global_rank,
                )

        if self.on_notice in ("auto", "checkpoint"):
            if seconds_left > ckpt_estimate:
                self._save_last_checkpoint(trainer, step)
            else:
                log.warning(
                    "rank %d: no last checkpoint: %.1f s left before the kill, a checkpoint takes about %.1f s",
                    trainer.global_rank,
                    seconds_left,
                    ckpt_estimate,
                )
        trainer.should_stop = True
        self.stopped_at_step = step

    def _save_last_checkpoint(self, trainer: Trainer, step: int) -> None:
        dirpath = self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
        path = os.path.join(dirpath, f"preempted-step={step}.ckpt")
        start = time.monotonic()
        trainer.save_checkpoint(path)
        took = time.monotonic() - start
        self.checkpoint_seconds = max(took, 0.5 * self.checkpoint_seconds + 0.5 * took)
        self.last_checkpoint_path = path
        log.warning("rank %d: last checkpoint %s written in %.2f s", trainer.global_rank, path, took)

    def __getstate__(self) -> dict[str, Any]:
        # Handlers and the poll thread belong to this process; a spawned copy installs its own.
        state = self.__dict__.copy()
        state["_installed"], state["_watcher"] = {}, None
        return state

    # ----------------------------------------------------------------- checkpointed state
    @override
    def state_dict(self) -> dict[str, Any]:
        last = dataclasses.asdict(self.last_notice) if self.last_notice is not None else None
        return {
            "notices_seen": self.notices_seen,
            "last_notice": last,
            "checkpoint_seconds": self.checkpoint_seconds,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A pending notice is never restored: it was about the machine that wrote the checkpoint.
        self.notices_seen = int(state_dict.get("notices_seen", 0))
        last = state_dict.get("last_notice")
        self.last_notice = Notice(**last) if last else None
        self.checkpoint_seconds = float(state_dict.get("checkpoint_seconds", self.checkpoint_seconds))
