"""Errors that state the rule that was broken, the values that broke it and the fix."""

from __future__ import annotations


class BambooError(Exception):
    """Base class of every error raised by lightning_bamboo."""


class BambooConfigError(BambooError, ValueError):
    """A configuration or an input breaks a rule; raised before any process can hang on it."""
