"""Errors that state the rule that was broken, the values that broke it and the fix."""

from __future__ import annotations

from collections.abc import Iterable


class BambooError(Exception):
    """Base class of every error raised by lightning_bamboo."""


class BambooConfigError(BambooError, ValueError):
    """A configuration or an input breaks a rule; raised before any process can hang on it."""


class OutOfDeviceMemory(BambooError, MemoryError):
    """Something this project places on a GPU (a replica, its update, the layers a failover takes over) did not fit;
    the message names what, the device's memory at the time and the fixes."""


class FatalLoss(BambooError):
    """A lost stage has no live replica (a node and its replica holder were lost together).

    ``standing``: nodes of the layout the loss broke that stand by instead of restarting (the joiners of a
    reconfiguration it interrupted: every survivor names the same ones), left out of the restart."""

    def __init__(self, message: str = "", standing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.standing = tuple(standing)


class JobRestarted(FatalLoss):
    """After a fatal loss the job restarted from its last checkpoint in the running processes, and a data iterator
    the caller owns must be rewound: the engine is at step ``step`` and the job's data at micro-batch
    ``data_position`` (raised by ``ResilientPipelineEngine.train_batch(data_iter=...)``)."""

    def __init__(self, message: str, step: int, data_position: int) -> None:
        super().__init__(message)
        self.step, self.data_position = step, data_position


class Released(BambooError):
    """This node left the job's layout and waits as a standby node in its own process: its pipeline was dropped
    after a loss (several pipelines), or a loss interrupted its admission. The front door puts its training away
    and takes it up again from the running nodes when a reconfiguration admits it (``PipelineRunner.wait_admission``),
    or ends it when the job finishes first."""


class PeerLost(BambooError):
    """A peer of this pipeline is gone; the step in flight did not commit here. ``lost``: the peers known lost."""

    def __init__(self, message: str, lost: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.lost = tuple(lost)


#: exit status of a process that stops on a FatalLoss: "start the job again from its last checkpoint
#: with the nodes that are up" (EX_TEMPFAIL; the demo's driver does that on seeing it)
FATAL_EXIT_CODE = 75

#: exit status of a worker that refused the job's configuration (a ``BambooConfigError`` before or at its
#: first step): nothing trained, nothing to restart; the launcher stops the other workers and exits with it
CONFIG_EXIT_CODE = 2


def batch_form_error(batch: object) -> BambooConfigError:
    """The error for a batch that is not ``(inputs, targets)`` (raised at a step, or before any from the first sample)."""
    kind = f"a {type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    return BambooConfigError(
        f"strategy='bamboo' needs batches of the form (inputs, targets), got {kind}; make the "
        f"Dataset return (inputs, targets) pairs or add a collate_fn that does"
    )
