"""The demo cluster's shape (pure): standby processes, the global batch, the model's layers, a job's layout."""

from __future__ import annotations

#: standby processes beyond a full pipeline (joined nodes past that wait without a process until a place frees)
STANDBY_PROCESSES = 1
#: seconds of notice the default preemption with notice gets (see default_preempt)
DEFAULT_NOTICE = 2
#: samples per step over all pipelines (each of P pipelines loads GLOBAL_BATCH / P; the worker's micro-batch is 2)
GLOBAL_BATCH = 8
#: the demo GPT's pipeline layers (lightning_bamboo.demo.worker.CONFIG: 6 blocks + embedding + head)
DEMO_LAYERS = 8


def default_preempt(nodes: int, stages: int, steps: int) -> str:
    """What ``make demo`` shows when no ``--preempt`` or ``--trace`` is given, for any cluster.

    A middle node (``node{nodes // 2}``) is SIGKILLed when a quarter of the steps are done; one pipeline
    of 4 or more nodes also loses its last node with a 2-second notice at 7/12 of the steps (4 nodes,
    24 steps: ``node2@6,node3@14:2``). One node, or fewer than 2 steps: nothing to show, no preemption.
    """
    if nodes < 2 or steps < 2:
        return ""
    events = [f"node{nodes // 2}@{max(1, steps // 4)}"]
    if nodes == stages and nodes >= 4:
        events.append(f"node{nodes - 1}@{max(1, steps * 7 // 12)}:{DEFAULT_NOTICE}")
    return ",".join(events)


def layout_for(nodes: int, stages: int, width: int, global_batch: int, micro_batch: int) -> tuple[int, int]:
    """``(nodes used, depth)`` of a job started on ``nodes`` nodes: the start's layout (``width`` nodes in
    pipelines of ``stages``) when they are there, else as many whole pipelines as fit (and share the global
    batch in whole micro-batches), else one shallower pipeline of them all."""
    if nodes < stages:
        return nodes, nodes
    pipelines = min(width, nodes) // stages
    while global_batch % (pipelines * micro_batch):
        pipelines -= 1
    return pipelines * stages, stages
