"""What lightning_bamboo prints: its own events with timestamps, DeepSpeed's construction chatter hidden.

- Our failover, reconfiguration and checkpoint events are ``logging`` records of the
  ``lightning_bamboo`` logger. When the application configured no logging (the root logger has no
  handler), they are written to stderr with a timestamp, the node and the level, instead of
  Python's bare last-resort output; an application that configures logging gets them through its
  own handlers, once. ``BAMBOO_LOG_LEVEL=INFO`` shows the failover's phases too.
- DeepSpeed prints its process topology and layer seeds on rank 0 every time a pipeline is built
  (at start and after every failover or reconfiguration). ``deepspeed_prints_hidden`` drops those
  lines; ``BAMBOO_DEEPSPEED_LOGS=1`` keeps them.
- DeepSpeed warns in every process that it fell back to the CPU when it finds no GPU, which a CPU job
  cannot act on: ``choose_deepspeed_accelerator`` names the CPU for it (``DS_ACCELERATOR=cpu``) where
  torch sees no GPU and the user chose nothing. Lightning's and torch's own warnings that our code sets
  off and a user cannot act on are filtered by ``filter_unactionable_warnings``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from lightning_bamboo.errors import BambooConfigError

LOGGER = "lightning_bamboo"
FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"

#: lines DeepSpeed prints with ``print`` (not ``logging``) while it builds a pipeline module
DEEPSPEED_CHATTER = re.compile(r"^(Using topology: \{|SEED_LAYERS=|stage=\d+ layers=\d+$|\s+\d+: \S+$|\s+loss: \S+$)")


class _WhenUnconfigured(logging.StreamHandler):
    """Writes a record only when the root logger has no handler (no logging set up by the application).

    Being attached, it also keeps Python's last-resort handler (no timestamp) from writing our records.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        super().emit(record)


def install() -> None:
    """Attach the timestamped handler to the ``lightning_bamboo`` logger (once; called on import)."""
    logger = logging.getLogger(LOGGER)
    if any(isinstance(h, _WhenUnconfigured) for h in logger.handlers):
        return
    handler = _WhenUnconfigured(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    read_level()


def read_level() -> None:
    """The ``lightning_bamboo`` logger's level from ``BAMBOO_LOG_LEVEL`` (unset: inherited). Read at import, and again
    by a worker forked from an interpreter that imported in another environment (``launcher.forks``)."""
    level = os.environ.get("BAMBOO_LOG_LEVEL", "").upper()
    if level and not isinstance(logging.getLevelName(level), int):
        raise BambooConfigError(
            f"BAMBOO_LOG_LEVEL={level!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR, or unset it"
        )
    logging.getLogger(LOGGER).setLevel(level or logging.NOTSET)


class _DropLines:
    """A text stream that passes lines on to ``target`` except those matching ``pattern``."""

    def __init__(self, target: TextIO, pattern: re.Pattern[str]) -> None:
        self.target, self.pattern = target, pattern
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            kept = [line + "\n" for line in lines if not self.pattern.match(line)]
        if kept:
            self.target.write("".join(kept))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            rest, self._partial = self._partial, ""
        if rest and not self.pattern.match(rest):
            self.target.write(rest)
        self.target.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding...: the target's
        return getattr(self.target, name)


@contextmanager
def deepspeed_prints_hidden() -> Iterator[None]:
    """Drop DeepSpeed's topology and layer-seed lines printed inside the block (other lines pass)."""
    if os.environ.get("BAMBOO_DEEPSPEED_LOGS", "") not in ("", "0"):
        yield
        return
    previous = sys.stdout
    sys.stdout = _DropLines(previous, DEEPSPEED_CHATTER)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = previous


def choose_deepspeed_accelerator() -> None:
    """``DS_ACCELERATOR=cpu`` where torch sees no GPU and nobody set it (DeepSpeed then picks the CPU silently)."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


#: warnings our code sets off in Lightning or torch that name nothing a user can change
UNACTIONABLE_WARNINGS = (
    # Lightning 2.6's pytree helper on torch >= 2.10, once per rank at the first batch
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


def filter_unactionable_warnings() -> None:
    import warnings

    for message in UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
