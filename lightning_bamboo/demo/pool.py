"""The demo's warm pool: worker processes started ahead of need, their modules imported, waiting to become a node.

A node that joins the demo cluster (a replacement machine of the trace or of ``--join``), or one that a
restart from a checkpoint must start while no process of the job is left to run it, takes a process of
the pool instead of starting an interpreter. Importing torch, DeepSpeed and Lightning costs 4-5 s of a
core, and far more at idle priority beside a training pipeline on shared cores: a restart that found no
process ready waited that long (10-18 s in the chaos runs). The pool stands for machines that arrive
booted, as a cloud's warm pool (EC2 Auto Scaling's, for one) keeps instances initialized ahead of a
scale-out; a trace's "add" is then a machine that can run at once. Each process taken is replaced at
once; the replacement starts at idle CPU priority (the first ones start with the job, at its priority).

A pooled worker (``python -m lightning_bamboo.demo.worker --pooled``) offers its process under the
pool's own job (``membership.offers.offer_process``, the same offer a survivor of a fatal loss makes) and
runs whatever it is assigned: a rank of a job, or a node joining one as a standby node.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the worker's argument that makes it a pooled process
POOLED = "--pooled"


class WarmPool:
    """Up to ``size`` pooled processes of ``command`` (plus ``POOLED``) for ``cluster``; ``take`` hands one to a node.

    Their offers live under the job ``job`` of the cluster's store, apart from every job they may be given;
    their output goes to ``log`` until they run a node.
    """

    def __init__(self, cluster: Any, size: int, command: Sequence[str], job: str, log: Path) -> None:
        self.cluster, self.size, self.command, self.job, self.log = cluster, size, [*command, POOLED], job, log
        self.procs: dict[str, Any] = {}
        self.started = 0
        # the first ones start beside the job's processes, at their priority: ready by the time it trains
        self.fill(idle=False)

    def fill(self, idle: bool = True) -> None:
        """Start pooled processes until there are ``size`` (forgetting any that died); ``idle``: at idle CPU
        priority, as a replacement beside a training pipeline starts (it takes the cycles training leaves)."""
        from lightning_bamboo.membership.node import (
            JOB_ENV,
            JOIN_ENV,
            NODE_ENV,
            NODES_ENV,
            idle_priority_supported,
        )

        for name in [n for n, p in self.procs.items() if p.poll() is not None]:
            del self.procs[name]
        while len(self.procs) < self.size:
            self.started += 1
            name = f"warm{self.started}"
            env = {**self.cluster.env, JOB_ENV: self.job, NODE_ENV: name, NODES_ENV: name}
            env.pop(JOIN_ENV, None)  # what it runs as comes with its assignment
            with open(self.log, "ab") as log:
                proc = self.procs[name] = self.cluster.start_process(self.command, env, stdout=log, stderr=log)
            if idle and idle_priority_supported():  # as Cluster.spawn_joiner starts standby nodes: before it starts a thread
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))

    def ready(self) -> list[str]:
        """The pooled processes that finished their imports and wait for an assignment, oldest first."""
        if not self.procs:
            return []
        offered = self.cluster.offered_by(self.job)
        return [n for n, p in self.procs.items() if n in offered and p.poll() is None]

    def take(self, name: str, args: Sequence[str], rank: int | None, world: Sequence[str], log: Path) -> str:
        """Run node ``name`` with worker ``args`` in a pooled process (``rank`` None: as a node that joins the
        running job; see ``Cluster.reuse``), its output into ``log``, and start its replacement.

        Returns ``"ready"`` if the process had done its imports, ``"starting"`` if not (the oldest is taken,
        the closest to ready: it runs the node as soon as they are done, sooner than a process started
        now), ``""`` if the pool is empty."""
        ready = self.ready()
        starting = [n for n, p in self.procs.items() if p.poll() is None and n not in ready]
        if not ready and not starting:
            return ""
        pooled = (ready or starting)[0]
        self.cluster.reuse(name, args, rank, world, offered_in=self.job, process=pooled, log=str(log))
        self.cluster.adopt(name, self.procs.pop(pooled))
        self.fill()
        return "ready" if ready else "starting"

    def close(self) -> None:
        """Stop every pooled process (they wait for an assignment that will not come)."""
        from lightning_bamboo.launcher.cluster import signal_worker

        for proc in self.procs.values():
            signal_worker(proc, signal.SIGKILL, wait=True)
        self.procs.clear()

