"""Hydrozoa-style planner: profile layers, model a step, choose the layout (pure modules need no torch)."""

from __future__ import annotations

from lightning_bamboo.planner.costmodel import (
    Hardware,
    LayerCost,
    LayerProfile,
    ModelProfile,
    RedundancyCost,
    StageEstimate,
    StepEstimate,
    estimate_step,
    redundancy_cost,
)
from lightning_bamboo.planner.plan import (
    Alternative,
    Infeasible,
    LayerTooLargeError,
    NoFeasiblePlanError,
    Plan,
    PlanTable,
    plan,
    plan_table,
)
from lightning_bamboo.planner.solver import NoSplit, Split, solve_split

__all__ = [
    "Alternative",
    "Hardware",
    "Infeasible",
    "LayerCost",
    "LayerProfile",
    "LayerTooLargeError",
    "ModelProfile",
    "NoFeasiblePlanError",
    "NoSplit",
    "Plan",
    "PlanTable",
    "RedundancyCost",
    "Split",
    "StageEstimate",
    "StepEstimate",
    "estimate_step",
    "plan",
    "plan_table",
    "redundancy_cost",
    "solve_split",
]
