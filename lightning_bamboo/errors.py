"""Errors that state the rule that was broken, the values that broke it and the fix."""

from __future__ import annotations


class BambooError(Exception):
    """Base class of every error raised by lightning_bamboo."""


class BambooConfigError(BambooError, ValueError):
    """A configuration or an input breaks a rule; raised before any process can hang on it."""


class FatalLoss(BambooError):
    """A lost stage has no live replica (a node and its replica holder were lost together)."""


#: exit status of a process that stops on a FatalLoss: "start the job again from its last checkpoint
#: with the nodes that are up" (EX_TEMPFAIL; the demo's driver does that on seeing it)
FATAL_EXIT_CODE = 75
