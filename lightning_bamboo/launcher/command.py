"""``python -m lightning_bamboo.launcher``: its command line, and ``supervise``, one machine's part of a job whose
other machines run supervisors of their own."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_bamboo.errors import CONFIG_EXIT_CODE, BambooConfigError
from lightning_bamboo.launcher.cluster import (
    INTERFACE_VARS,
    STOP_GRACE_SECONDS,
    Cluster,
    node_names,
    spawn_after_first,
    stopping,
    visible_gpus,
    wait_for_workers,
    worker_env_help,
)
from lightning_bamboo.launcher.jobs import PRELOAD_ENV, check_preload, run_job
from lightning_bamboo.launcher.node_plan import NodePlan, plan_node, resolve_workers
from lightning_bamboo.membership.address import free_port

DESCRIPTION = "A local launcher whose workers survive each other's death: one process per node, a store, a watcher."


def supervise(
    plan: NodePlan,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    stop_grace: float = STOP_GRACE_SECONDS,
    report: bool = False,
    pid_dir: str | None = None,
    preload: Sequence[str] = (),
) -> int:
    """Run one machine's nodes of a job whose other nodes run elsewhere (one supervisor per machine), as ``plan``
    (``plan_node``, from the command line's ``--node``, ``--peers`` or ``--min-nodes`` or ``--join``, ``--workers``,
    ``--stages``, ``--store``, ``--job``, ``--addr``) says.

    Returns the job's outcome as this machine saw it (``launcher.outcome.machine_status``): 0 once the job finished
    with every worker here that was still in it exiting 0 (the others exited 0 or were SIGKILLed, a vanished node),
    ``CONFIG_EXIT_CODE`` if one refused the job's configuration, a failed worker's status, or 1 when the job ended
    without finishing. The machine of
    the first node publishes the address of the initial process group in the store (``addr``
    and a free port there); the others wait for it (at most ``timeout`` s). A worker that dies is
    announced in the store at once, so its peers fail over in milliseconds. Every process group
    binds to the interface that owns ``addr``. ``report``, ``pid_dir`` and ``preload`` as for ``run_job``.
    """
    from lightning_bamboo.membership.keys import JobKeys, job_prefix

    store, job, node, command = plan.store, plan.job, plan.machine, list(plan.command)
    check_preload(preload)
    chosen = {k: os.environ[k] for k in INTERFACE_VARS if k in os.environ}  # the user's choice wins over ours
    cluster = Cluster(store, job, {**plan.env, **chosen, **(env or {})},
                      local_workers=len(plan.workers) if len(plan.workers) > 1 else None, report=report,
                      pid_dir=pid_dir, local_ranks={w: plan.local_rank(w) for w in plan.workers}, preload=preload,
                      preload_runs=("*",))
    try:
        with stopping(cluster, stop_grace) as stop:
            if plan.min_nodes is not None:
                from lightning_bamboo.membership.fleet import fleet_rendezvous

                roster = fleet_rendezvous(cluster.store, job_prefix(job), node, len(plan.workers), plan.min_nodes,
                                          plan.max_nodes, timeout)
                plan = plan.formed(roster)
                print(f"[launcher] {node}: " + ("the job formed without this machine: standby" if plan.joining else
                                                f"the job formed of {','.join(plan.nodes)}"), file=sys.stderr)
            if plan.joining:
                for worker in plan.workers:
                    cluster.spawn_joiner(worker, command)
            else:
                key = JobKeys(job).master
                if plan.publisher in plan.workers:
                    master = {"host": plan.addr, "port": free_port(plan.addr)}
                    cluster.store.put(key, json.dumps(master))
                else:
                    master = wait_for_address(cluster.store, key, timeout, f"the first node {plan.publisher!r} to publish its address")
                cluster.env.update({"MASTER_ADDR": str(master["host"]), "MASTER_PORT": str(master["port"])})
                if report and plan.publisher in plan.workers:
                    print(f"[launcher] {plan.placement()}", file=sys.stderr, flush=True)
                spawn_after_first(cluster, stop, plan.workers[0],
                                  lambda worker: cluster.spawn(worker, command, plan.nodes.index(worker), plan.nodes),
                                  plan.workers[1:])
            wait_for_workers(cluster, stop, announce_always=True)
        from lightning_bamboo.launcher.outcome import machine_status

        return machine_status(cluster, plan.workers)
    finally:
        cluster.close()


def wait_for_address(store: Any, key: str, timeout: float, what: str) -> dict[str, Any]:
    from lightning_bamboo.membership.watch import wait_for_key

    kv = wait_for_key(store, key, timeout)
    if kv is None:
        raise BambooConfigError(f"waited {timeout:g} s for {what} ({key} in the store); start that node, or raise --timeout")
    return dict(json.loads(kv.value))


def store_with_credentials(args: argparse.Namespace) -> str:
    """``--store`` with ``--cacert``/``--cert``/``--key``/``--user``/``--password-file`` in its query: the URL
    the workers inherit names them (paths and a name; the password stays in the environment or its file)."""
    from lightning_bamboo.membership.credentials import with_credentials

    options = {name: getattr(args, name) for name in ("cacert", "cert", "key", "user", "password_file")}
    if not any(options.values()):
        return str(args.store)
    if not str(args.store).startswith("etcd://"):
        given = ", ".join(f"--{k.replace('_', '-')}" for k, v in options.items() if v)
        raise BambooConfigError(f"{given} are etcd's credentials; give them with --store etcd://HOST:PORT (the "
                                f"embedded store takes a shared token from $BAMBOO_STORE_TOKEN instead)")
    return with_credentials(str(args.store), **options)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_bamboo.launcher", description=DESCRIPTION,
                                     epilog=worker_env_help() + "\n\nOne worker per GPU: --workers K (or auto) gives "
                                     "worker NAME.i LOCAL_RANK i, so it trains on cuda:i; pass Trainer(devices=K) "
                                     "(or LOCAL_WORLD_SIZE), the GPUs per machine, as everywhere in Lightning.\n"
                                     "At each worker's start the launcher prints one line on stderr: '[launcher] "
                                     "NODE: pid PID, rank R of N, device DEVICE'.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=None, help="run this many nodes here (one machine)")
    parser.add_argument("--node", default=None, help="run this machine's node(s) here (one supervisor per machine)")
    parser.add_argument("--workers", default=None, metavar="K|auto",
                        help="with --node: run K workers here, nodes NAME.0 .. NAME.K-1 (the machine is one failure "
                             "domain); worker NAME.i gets LOCAL_RANK i, GPU i on a GPU machine. 'auto': one per GPU "
                             "(torch.cuda.device_count()); refused on a machine without GPUs")
    parser.add_argument("--stages", type=int, default=None,
                        help="with --node: the pipeline depth the job runs, so that the nodes are ordered with every "
                             "stage's replica holder on another machine at that depth (default: an order that does it "
                             "at every depth where one exists; --dry-run says which)")
    parser.add_argument("--peers", default="", help="with --node: the initial pipeline's machines, in order, comma-separated")
    parser.add_argument("--min-nodes", type=int, default=None,
                        help="with --node, instead of --peers: the job forms of the machines registered first, once they "
                             "run this many nodes; later machines start as standby")
    parser.add_argument("--max-nodes", type=int, default=None, help="with --min-nodes: at most this many nodes in the job")
    parser.add_argument("--join", action="store_true", help="with --node: a standby machine joining a running job")
    parser.add_argument("--addr", default="127.0.0.1",
                        help="with --node: this machine's IP address that its peers reach (process groups bind to its interface); "
                        "'auto': the one it reaches the store from")
    parser.add_argument("--timeout", type=float, default=300.0, help="with --node: seconds to wait for the first node")
    parser.add_argument("--store", default="embedded", help="embedded (default) or etcd://HOST:PORT (credentials: "
                        "below, or in the URL's query under the same names: etcd://HOST:PORT?cacert=CA.pem&user=NAME)")
    for option, what in (("cacert", "the CA certificate that signed etcd's (TLS)"),
                         ("cert", "this machine's client certificate for etcd (TLS, with --key)"),
                         ("key", "the client certificate's private key"),
                         ("user", "the etcd user the job runs as; its password from $ETCDCTL_PASSWORD or --password-file, "
                                  "never the command line"),
                         ("password-file", "a file holding the etcd user's password")):
        parser.add_argument(f"--{option}", default=None, metavar="NAME" if option == "user" else "PATH",
                            help=f"etcd: {what} (etcdctl's name; docs/security.md)")
    parser.add_argument("--job", default="bamboo")
    parser.add_argument("--stop-grace", type=float, default=STOP_GRACE_SECONDS,
                        help="seconds the workers get to hand over after SIGTERM/SIGINT/SIGHUP to this launcher (they get "
                             "SIGTERM, a preemption notice) before they are killed; a second signal kills them at once")
    parser.add_argument("--pid-dir", default=None, metavar="DIR",
                        help="write DIR/NODE.pid (the worker's process id) for each worker while it runs: written "
                             "whole when it starts, removed once it exited (kill -9 $(cat DIR/node2.pid) preempts node2)")
    parser.add_argument("--preload", default=os.environ.get(PRELOAD_ENV, ""), metavar="MODULES",
                        help="comma-separated modules (e.g. torch,lightning,deepspeed) imported once by one interpreter "
                             "whose forks are the workers (python SCRIPT.py or python -m MODULE): each starts in "
                             f"milliseconds instead of seconds of imports. Machines without GPUs only. Default: ${PRELOAD_ENV}. With "
                             "$BAMBOO_FORK_SERVER, at that shared interpreter (launcher.forks.start_shared) if it fits")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print what would run, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    args = parser.parse_args(argv)
    args.store = store_with_credentials(args)
    preload = [m.strip() for m in args.preload.split(",") if m.strip()]
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    if (args.nodes is None) == (args.node is None):
        parser.error("give --nodes N (all nodes on this machine) or --node NAME (one machine of a larger job)")
    if args.node is not None:
        peers = [p for p in args.peers.split(",") if p]
        args.workers = resolve_workers(args.workers, visible_gpus() if args.workers == "auto" else 0)
        plan = plan_node(command, args.node, store=args.store, peers=peers, addr=args.addr, join=args.join,
                         workers=args.workers, job=args.job, min_nodes=args.min_nodes, max_nodes=args.max_nodes,
                         stages=args.stages)
        if args.dry_run:
            print(plan.describe())
            return 0
        code = supervise(plan, timeout=args.timeout, stop_grace=args.stop_grace, report=True, pid_dir=args.pid_dir,
                         preload=preload)
        print(f"[launcher] {args.node} exit code: {code}", file=sys.stderr)
        return code if code in (0, CONFIG_EXIT_CODE) else 1
    if args.workers is not None or args.stages is not None:
        parser.error("--workers and --stages go with --node (a machine of a larger job); on one machine use --nodes N "
                     "(worker i gets LOCAL_RANK i, GPU i on a GPU machine)")
    if args.dry_run:
        print(f"{args.nodes} node(s) here: {','.join(node_names(args.nodes))}; store {args.store}")
        print("command: " + shlex.join(command))
        return 0
    result = run_job(command, args.nodes, store=args.store, job=args.job, stop_grace=args.stop_grace, report=True,
                     pid_dir=args.pid_dir, preload=preload)
    print("[launcher] exit codes: " + ", ".join(f"{n}={c}" for n, c in result.codes.items()), file=sys.stderr)
    if CONFIG_EXIT_CODE in result.codes.values():
        return CONFIG_EXIT_CODE  # refused before it trained: the status of a wrong input, not of a failed run
    if result.failed_members():
        print(f"[launcher] the job finished with {','.join(sorted(result.finished_nodes or ()))}, and "
              f"{','.join(result.failed_members())} did not exit 0 after it (killed as hung: "
              f"{','.join(sorted(result.hung)) or 'none'}): the job did not end cleanly", file=sys.stderr)
    return 0 if result.ok else 1
