"""A local launcher whose workers survive each other's death: one process per node, a store, a watcher.

Lightning's launcher and torchrun's agent kill every worker when one dies, which is exactly
what a spot cluster must not do. This one starts ``nodes`` copies of a command with the
environment of a one-process-per-node cluster (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, the
store URL and the node names), announces a worker that dies in the membership store at once
(so the survivors learn of it in milliseconds, not after a lease expires), and returns when
every worker has exited::

    python -m lightning_bamboo.launcher --nodes 4 -- python train.py --stages 4
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from lightning_bamboo.engine.failover import free_port
from lightning_bamboo.errors import BambooConfigError

STORE_ENV, JOB_ENV, NODE_ENV, NODES_ENV = "BAMBOO_STORE", "BAMBOO_JOB", "BAMBOO_NODE", "BAMBOO_NODES"
#: set to "1" for a node that joins a running job: it waits as standby until a reconfiguration admits it
JOIN_ENV = "BAMBOO_JOIN"


def node_names(nodes: int) -> list[str]:
    return [f"node{i}" for i in range(nodes)]


class Cluster:
    """Worker processes, one per node, sharing a store; a dead worker is announced at once.

    ``spawn`` starts a node, ``kill`` sends it a real signal, ``poll`` reaps exited workers
    (announcing the unexpected deaths in the store) and returns them.
    """

    def __init__(self, store: str = "embedded", job: str = "bamboo", env: Mapping[str, str] | None = None) -> None:
        from lightning_bamboo.membership import connect, resolve_store
        from lightning_bamboo.membership.registry import Registry

        self.url, self._server = resolve_store(store)
        self.job = job
        self.env = {**os.environ, **(env or {}), STORE_ENV: self.url, JOB_ENV: job, "NODE_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        self.procs: dict[str, subprocess.Popen] = {}
        self.codes: dict[str, int] = {}
        self.store = connect(self.url)
        self._reporter = Registry(self.store, job, "launcher")

    def spawn(self, name: str, command: Sequence[str], rank: int, world: Sequence[str], **popen: object) -> None:
        env = {**self.env, JOB_ENV: self.job, NODES_ENV: ",".join(world), "WORLD_SIZE": str(len(world)), "RANK": str(rank),
               "LOCAL_RANK": str(rank), NODE_ENV: name}
        env.pop(JOIN_ENV, None)
        self._start(name, command, env, popen)

    def spawn_joiner(self, name: str, command: Sequence[str], **popen: object) -> None:
        """Start a node that joins the running job: standby until a reconfiguration admits it."""
        env = {**self.env, JOB_ENV: self.job, NODES_ENV: name, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
               NODE_ENV: name, JOIN_ENV: "1"}
        self._start(name, command, env, popen)

    def _start(self, name: str, command: Sequence[str], env: dict[str, str], popen: Mapping[str, object]) -> None:
        self.codes.pop(name, None)
        self.procs[name] = subprocess.Popen(list(command), env=env, **popen)  # type: ignore[call-overload]

    def new_job(self, job: str) -> None:
        """Later workers (e.g. a restart from a checkpoint) use a fresh key space in the store."""
        from lightning_bamboo.membership.registry import job_prefix

        self.job = self._reporter.job = job
        self._reporter.base = job_prefix(job)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    @property
    def running(self) -> list[str]:
        return [n for n, p in self.procs.items() if n not in self.codes and p.poll() is None]

    def poll(self) -> dict[str, int]:
        """Reap workers that exited since the last call; announce the ones that died."""
        exited = {}
        for name, proc in self.procs.items():
            if name in self.codes or proc.poll() is None:
                continue
            self.codes[name] = exited[name] = proc.returncode
            if proc.returncode != 0 and self.running:
                try:  # tell the survivors now; the lease would take its TTL
                    self._reporter.announce_loss(name, f"process exited with {proc.returncode}", timeout=2.0)
                except Exception as err:  # noqa: BLE001 - the lease is the backstop
                    print(f"[launcher] could not announce the loss of {name}: {err}", file=sys.stderr)
        return exited

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        self.store.close()
        if self._server is not None:
            self._server.stop()


def launch(
    command: Sequence[str],
    nodes: int,
    *,
    store: str = "embedded",
    job: str = "bamboo",
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> dict[str, int]:
    """Run ``command`` as ``nodes`` workers; returns each node's exit code (negative: killed by that signal)."""
    if nodes < 1:
        raise BambooConfigError(f"a job needs at least one node (nodes: {nodes})")
    names = node_names(nodes)
    cluster = Cluster(store, job, env)
    try:
        for rank, name in enumerate(names):
            cluster.spawn(name, command, rank, names)
        deadline = None if timeout is None else time.monotonic() + timeout
        while cluster.running:
            cluster.poll()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"workers still running after {timeout} s: {cluster.running}")
            time.sleep(0.05)
        cluster.poll()
        return dict(cluster.codes)
    finally:
        cluster.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_bamboo.launcher", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--store", default="embedded", help="embedded (default) or etcd://HOST:PORT")
    parser.add_argument("--job", default="bamboo")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    codes = launch(command, args.nodes, store=args.store, job=args.job)
    print("[launcher] exit codes: " + ", ".join(f"{n}={c}" for n, c in codes.items()), file=sys.stderr)
    return 0 if any(c == 0 for c in codes.values()) and all(c in (0, -9) for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
