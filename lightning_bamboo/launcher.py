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


def node_names(nodes: int) -> list[str]:
    return [f"node{i}" for i in range(nodes)]


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
    from lightning_bamboo.membership import connect, resolve_store
    from lightning_bamboo.membership.registry import Registry

    url, server = resolve_store(store)
    names = node_names(nodes)
    base = {
        **os.environ,
        **(env or {}),
        STORE_ENV: url,
        JOB_ENV: job,
        NODES_ENV: ",".join(names),
        "WORLD_SIZE": str(nodes),
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    procs: dict[str, subprocess.Popen] = {}
    codes: dict[str, int] = {}
    try:
        for rank, name in enumerate(names):
            procs[name] = subprocess.Popen(
                list(command), env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), NODE_ENV: name}
            )
        client = connect(url)
        reporter = Registry(client, job, "launcher")
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(codes) < len(procs):
            for name, proc in procs.items():
                if name in codes or proc.poll() is None:
                    continue
                codes[name] = proc.returncode
                if proc.returncode != 0 and len(codes) < len(procs):
                    # Tell the survivors now; the lease would take its TTL.
                    try:
                        reporter.announce_loss(name, f"process exited with {proc.returncode}", timeout=2.0)
                    except Exception as err:  # noqa: BLE001 - the lease is the backstop
                        print(f"[launcher] could not announce the loss of {name}: {err}", file=sys.stderr)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"workers still running after {timeout} s: {sorted(set(procs) - set(codes))}")
            time.sleep(0.05)
        client.close()
        return codes
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        if server is not None:
            server.stop()


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
