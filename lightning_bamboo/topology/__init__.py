"""Where layers and nodes go: layouts, placements, and the failover, transfer and reconfiguration plans (no torch)."""

from __future__ import annotations

from lightning_bamboo.topology.failover import FailoverPlan, Segment, layout_tag, plan_failover, plan_loss
from lightning_bamboo.topology.layout import (
    REDUNDANCY_MODES,
    Layout,
    balanced_parts,
    check_partition_option,
    check_parts,
    check_replica_memory,
    even_parts,
    micro_batches,
    partition_weights,
    pipeline_share,
    replica_holder,
    resolve_stages,
    split_micro_batches,
)
from lightning_bamboo.topology.machines import (
    Traffic,
    cross_machine_traffic,
    machine_order,
    placement_possible,
    replica_conflicts,
)
from lightning_bamboo.topology.policy import (
    ACTIONS,
    Decision,
    Placement,
    PolicyConfig,
    PolicyError,
    fresh_placement,
    machine_of,
    moved_nodes,
    reconfigure,
)
from lightning_bamboo.topology.transfer import Move, transfer_plan

__all__ = [
    "ACTIONS",
    "REDUNDANCY_MODES",
    "Decision",
    "FailoverPlan",
    "Layout",
    "Move",
    "Placement",
    "PolicyConfig",
    "PolicyError",
    "Segment",
    "Traffic",
    "balanced_parts",
    "check_partition_option",
    "check_parts",
    "check_replica_memory",
    "cross_machine_traffic",
    "even_parts",
    "fresh_placement",
    "layout_tag",
    "machine_of",
    "machine_order",
    "micro_batches",
    "moved_nodes",
    "partition_weights",
    "pipeline_share",
    "placement_possible",
    "plan_failover",
    "plan_loss",
    "reconfigure",
    "replica_conflicts",
    "replica_holder",
    "resolve_stages",
    "split_micro_batches",
    "transfer_plan",
]
