"""Fault injection: the runtime SIGKILLs its own process at the points that ``BAMBOO_FAIL_AT`` names.

The spec is a comma-separated list of items; each kills the named node once it reaches the point
(with the suffix ``!stop``, e.g. ``node2@7:13!stop``, it freezes it instead: SIGSTOP to its child
processes and itself, never continued: a machine that hangs rather than vanishes; with ``!term`` it sends
its own process a SIGTERM: a preemption notice, handled by what the process installed for it; with ``!oom`` it
raises ``torch.OutOfMemoryError`` there, as a GPU short of memory would):

- ``NODE@STEP``: at the start of step STEP (the 0-based count of the engine's ``train_batch`` calls);
- ``NODE@STEP:INSTRUCTION``: after INSTRUCTION (1 or more) DeepSpeed schedule steps of step STEP, a kill
  in the middle of a step;
- ``NODE@start``: registered, before the job's first rendezvous;
- ``NODE@save<STEP>``: in the checkpoint save after step STEP, once its layers are written;
- ``NODE@asyncwrite<STEP>``: in ``AsyncCheckpoint``'s writer thread, once the first layer file of the
  checkpoint of step STEP is written (the training thread has moved on);
- ``NODE@apply<STEP>``: step STEP committed on every node, its update not applied yet;
- ``NODE@admit``: in a live reconfiguration that admits standby nodes, on the node that admits them, once their
  admission is published (they are entering the new layout's process group);
- ``NODE@reconfigure``: in a live reconfiguration, after the layers moved, before the new stage forms
  its process groups;
- ``NODE@failover``: in its first failover, once the new process group formed, before the stage is rebuilt.

Example: ``BAMBOO_FAIL_AT=node1@4,node2@reconfigure``. With ``BAMBOO_FAIL_ONCE_DIR`` set to an existing
directory, each item kills only once, whichever incarnation of the node reaches it first (a node
started again after it is spared): the item leaves a file there when it fires.

The runtime calls ``reached(node, point)`` at each point; a test or benchmark arms a child process
with ``environment(items)``. This module is the only place that reads these variables.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: the items to fire, e.g. ``node1@4,node2@4:3,node0@failover``
FAIL_AT_ENV = "BAMBOO_FAIL_AT"
#: a directory: with it, each item kills only once (a node started again after it is spared)
FAIL_ONCE_ENV = "BAMBOO_FAIL_ONCE_DIR"
#: every variable this module reads, for a caller that clears them from a child's environment
ENV_NAMES = (FAIL_AT_ENV, FAIL_ONCE_ENV)


#: what a fault does (see ``Fault.action``)
ACTIONS = ("kill", "stop", "term", "oom")


@dataclass(frozen=True)
class Fault:
    """One armed item: kill ``node`` at ``point`` (after ``instruction`` schedule steps, if given)."""

    node: str
    point: str
    instruction: int | None = None
    #: "kill" (SIGKILL), "stop" (SIGSTOP to the node's processes, never continued), "term" (SIGTERM to the node's
    #: process: a preemption notice, handled by whatever the process installed for it) or "oom" (raise
    #: ``torch.OutOfMemoryError`` there, as a GPU short of memory would)
    action: str = "kill"

    def __post_init__(self) -> None:
        if not self.node or not self.point or any(c in self.node + self.point for c in "@,: "):
            raise ValueError(f"a fault needs a node and a point without '@', ',', ':' or spaces "
                             f"(node: {self.node!r}, point: {self.point!r}); write it as NODE@POINT")
        if self.action not in ACTIONS:
            raise ValueError(f"a fault's action is kill (the default), stop (suffix !stop), term (suffix !term) or "
                             f"oom (suffix !oom), not {self.action!r}")
        if self.instruction is not None and self.instruction < 1:
            raise ValueError(f"a fault's instruction counts schedule steps from 1 (instruction: {self.instruction}); "
                             f"use NODE@STEP to kill at the start of the step")

    @classmethod
    def parse(cls, item: str) -> Fault:
        """``node@point`` or ``node@step:instruction``, either with ``!stop``; a ``ValueError`` that shows the
        item otherwise."""
        spec, bang, action = item.strip().partition("!")
        node, at, when = spec.partition("@")
        point, colon, instruction = when.partition(":")
        if not at or (colon and not instruction.isdigit()):
            raise ValueError(f"{FAIL_AT_ENV} item {item!r} is not NODE@POINT or NODE@STEP:INSTRUCTION, optionally "
                             f"followed by !stop (e.g. node1@4, node1@4:3, node1@failover, node1@4:3!stop)")
        return cls(node, point, int(instruction) if colon else None, action if bang else "kill")

    def __str__(self) -> str:
        return (f"{self.node}@{self.point}" + ("" if self.instruction is None else f":{self.instruction}")
                + ("" if self.action == "kill" else f"!{self.action}"))


def parse(spec: str) -> tuple[Fault, ...]:
    """The faults of a ``BAMBOO_FAIL_AT`` value (empty items are skipped)."""
    return tuple(Fault.parse(item) for item in spec.split(",") if item.strip())


def environment(items: Iterable[str | Fault], once_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The environment variables that arm ``items`` in a child process (each fires once with ``once_dir``).

    ``once_dir`` must exist when the child reaches a point. The items are checked here, so that a
    typo fails the test that wrote it, not a node in the middle of a run.
    """
    faults = [item if isinstance(item, Fault) else Fault.parse(item) for item in items]
    env = {FAIL_AT_ENV: ",".join(map(str, faults))}
    if once_dir is not None:
        env[FAIL_ONCE_ENV] = os.fspath(once_dir)
    return env


@dataclass(frozen=True)
class _Armed:
    faults: tuple[Fault, ...]
    once_dir: str | None


@functools.cache
def _armed() -> _Armed:
    return _read(os.environ)


def _read(env: Mapping[str, str]) -> _Armed:
    return _Armed(parse(env.get(FAIL_AT_ENV, "")), env.get(FAIL_ONCE_ENV) or None)


def armed(node: str) -> bool:
    """Whether any fault names ``node`` (the engine skips its per-instruction checks otherwise)."""
    return any(fault.node == node for fault in _armed().faults)


def reached(node: str, point: str | int, instruction: int | None = None) -> None:
    """SIGKILL (or freeze) this process if an armed fault names ``node`` at ``point`` (and ``instruction``);
    else return.

    The environment is read once, on the first call.
    """
    armed = _armed()
    for fault in armed.faults:
        if fault.node == node and fault.point == str(point) and fault.instruction == instruction:
            if armed.once_dir is not None and not _first_to_fire(armed.once_dir, fault):
                continue
            where = f"at step {point}" + ("" if instruction is None else f" instruction {instruction}")
            if fault.action == "oom":
                import torch

                log.warning("%s: injected out-of-memory error %s", node, where)
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {FAIL_AT_ENV}={fault} {where})")
            if fault.action == "term":
                log.warning("%s: injected SIGTERM %s", node, where)
                os.kill(os.getpid(), signal.SIGTERM)
            elif fault.action == "stop":
                from lightning_bamboo.membership.node import descendants

                log.warning("%s: injected SIGSTOP %s (pid %d, never continued)", node, where, os.getpid())
                for pid in descendants(os.getpid()):  # its communication processes hang with it
                    with contextlib.suppress(ProcessLookupError):  # one that ended after the listing
                        os.kill(pid, signal.SIGSTOP)
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                log.warning("%s: injected SIGKILL %s", node, where)
                os.kill(os.getpid(), signal.SIGKILL)


def _first_to_fire(once_dir: str, fault: Fault) -> bool:
    """Claim ``fault`` in ``once_dir``: true for the first process that reaches it."""
    try:
        os.close(os.open(os.path.join(once_dir, str(fault).replace("/", "_")), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
