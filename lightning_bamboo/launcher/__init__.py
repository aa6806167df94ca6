"""A local launcher whose workers survive each other's death: one process per node, a store, a watcher.

Lightning's launcher and torchrun's agent kill every worker when one dies, which is exactly
what a spot cluster must not do. This one starts ``nodes`` copies of a command with the
environment of a one-process-per-node cluster (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, the
store URL and the node names), announces a worker that dies in the membership store at once
(so the survivors learn of it in milliseconds, not after a lease expires), and returns when
every worker has exited. It starts the first worker alone and the others once that one is past its
script's checks (at the job's start rendezvous), so a refused configuration or a script that fails before its
job is met by one process, not by every node::

    python -m lightning_bamboo.launcher --nodes 4 -- python train.py --stages 4

Across machines, run one supervisor per machine against a shared etcd, each naming its node, the
initial pipeline and the address its peers reach it at::

    python -m lightning_bamboo.launcher --store etcd://10.0.0.1:2379 --node node1 \
        --peers node0,node1,node2,node3 --addr 10.0.0.12 -- python train.py --stages 4

A supervisor started later with ``--join`` (and no ``--peers``) adds a standby node that a
``RebalanceCallback`` admits into the running job. With ``--min-nodes N`` instead of ``--peers`` the
job forms of the machines that registered first once they run N nodes (``membership.fleet``).
"""

from __future__ import annotations

from lightning_bamboo.launcher.cluster import (
    ASSIGN_KEY,
    FINISHED_GRACE_SECONDS,
    FINISHED_LIMIT_SECONDS,
    INTERFACE_VARS,
    OFFER_KEY,
    STOP_GRACE_SECONDS,
    STOP_SIGNALS,
    WORKER_ENV,
    Cluster,
    HangWatch,
    node_names,
    spawn_after_first,
    stopping,
    visible_gpus,
    wait_for_workers,
    worker_device,
    worker_env_help,
)
from lightning_bamboo.launcher.command import main, store_with_credentials, supervise
from lightning_bamboo.launcher.jobs import PRELOAD_ENV, JobResult, check_preload, launch, run_job
from lightning_bamboo.launcher.node_plan import NodePlan, job_nodes, plan_node, resolve_workers

__all__ = [
    "ASSIGN_KEY", "FINISHED_GRACE_SECONDS", "FINISHED_LIMIT_SECONDS", "INTERFACE_VARS", "OFFER_KEY", "PRELOAD_ENV",
    "STOP_GRACE_SECONDS", "STOP_SIGNALS", "WORKER_ENV", "Cluster", "HangWatch", "JobResult", "NodePlan",
    "check_preload", "job_nodes", "launch", "main", "node_names", "plan_node", "resolve_workers", "run_job",
    "spawn_after_first", "stopping", "store_with_credentials", "supervise", "visible_gpus", "wait_for_workers",
    "worker_device", "worker_env_help",
]
