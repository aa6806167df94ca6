"""A job on this machine: ``run_job``/``launch`` start its nodes as local workers and report how each ended."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.launcher.cluster import (
    STOP_GRACE_SECONDS,
    Cluster,
    node_names,
    spawn_after_first,
    stopping,
    visible_gpus,
    wait_for_workers,
)


@dataclass(frozen=True)
class JobResult:
    """How a local job ended: each node's exit code (negative: killed by that signal), the nodes the launcher
    killed as hung after the job finished, and the job's nodes when it finished (None: it never finished;
    empty: finished without naming them)."""

    codes: Mapping[str, int]
    hung: frozenset[str] = frozenset()
    finished_nodes: frozenset[str] | None = None

    @property
    def ok(self) -> bool:
        """The launcher's exit status is 0: some node finished cleanly, every other one was killed (a node the job
        lost: SIGKILL, as a preemption or a frozen machine's end), and every node that was still in the job when it
        finished exited 0 (one the launcher had to kill as hung did not finish cleanly)."""
        codes = self.codes.values()
        if not (any(c == 0 for c in codes) and all(c in (0, -signal.SIGKILL) for c in codes)):
            return False
        return not (self.finished_nodes or frozenset()) & {n for n, c in self.codes.items() if c != 0}

    def failed_members(self) -> list[str]:
        """The nodes still in the job when it finished that did not exit 0."""
        return sorted(n for n in self.finished_nodes or () if self.codes.get(n, 0) != 0)


def run_job(
    command: Sequence[str],
    nodes: int,
    *,
    store: str = "embedded",
    job: str = "bamboo",
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    stop_grace: float = STOP_GRACE_SECONDS,
    report: bool = False,
    pid_dir: str | None = None,
    preload: Sequence[str] = (),
) -> JobResult:
    """Run ``command`` as ``nodes`` workers on this machine; returns how each ended (``launch`` for the codes).

    ``report``: one line per worker on stderr as it starts (node, pid, rank, device); ``pid_dir``: ``<node>.pid``
    there while each worker runs; ``preload``: see :func:`check_preload`."""
    if nodes < 1:
        raise BambooConfigError(f"a job needs at least one node (nodes: {nodes})")
    check_preload(preload)
    names = node_names(nodes)
    cluster = Cluster(store, job, env, local_workers=nodes, report=report, pid_dir=pid_dir, preload=preload,
                      preload_runs=("*",))
    try:
        with stopping(cluster, stop_grace) as stop:
            spawn_after_first(cluster, stop, names[0], lambda name: cluster.spawn(name, command, names.index(name), names),
                              names[1:])
            hung = wait_for_workers(cluster, stop, None if timeout is None else time.monotonic() + timeout,
                                     kill_hung=True)
        return JobResult(dict(cluster.codes), frozenset(hung), cluster.finished_nodes())
    finally:
        cluster.close()


#: the environment variable that gives ``--preload`` its default (a comma-separated list of modules)
PRELOAD_ENV = "BAMBOO_PRELOAD"


def check_preload(modules: Sequence[str]) -> None:
    """``preload``: modules (``torch,lightning,deepspeed``) that one interpreter imports once; each worker whose
    command is ``python SCRIPT.py`` or ``python -m MODULE`` (this python) starts as a fork of it instead of
    importing them again (4-5 s of a core per worker, per restart in a process of its own). For machines without
    GPUs: refused where CUDA devices are visible, since the import may initialise the CUDA driver, which a forked
    worker then cannot use; refused for a module this python cannot find."""
    if not modules:
        return
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise BambooConfigError(f"--preload names {', '.join(missing)}, which this python ({sys.executable}) cannot "
                                f"import; install it or leave it out of --preload")
    gpus = visible_gpus()
    if gpus:
        raise BambooConfigError(f"--preload forks every worker from one interpreter that imported "
                                f"{', '.join(modules)}, which on a machine with GPUs ({gpus} visible) may initialise "
                                f"the CUDA driver, which a forked worker cannot use; start the workers without "
                                f"--preload (and unset {PRELOAD_ENV}) here")


def launch(command: Sequence[str], nodes: int, **options: Any) -> dict[str, int]:
    """Run ``command`` as ``nodes`` workers (``options``: ``run_job``'s); returns each node's exit code (negative:
    killed by that signal)."""
    return dict(run_job(command, nodes, **options).codes)
