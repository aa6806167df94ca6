"""Cluster-scale simulator: replay spot traces under on-demand, checkpoint-restart, Bamboo and its successors."""

from lightning_bamboo.sim.params import SimParams, describe_inputs, load_params, record_measurement
from lightning_bamboo.sim.report import PolicyResult, SimReport, compare_with_demo
from lightning_bamboo.sim.scenarios import SCENARIOS, Scenario, scenario
from lightning_bamboo.sim.simulate import run_policy, simulate
from lightning_bamboo.sim.trace import (
    Trace,
    TraceError,
    TraceEvent,
    bundled_trace,
    read_trace,
    scale_trace,
    slice_trace,
)

__all__ = [
    "SCENARIOS",
    "PolicyResult",
    "Scenario",
    "SimParams",
    "SimReport",
    "Trace",
    "TraceError",
    "TraceEvent",
    "bundled_trace",
    "compare_with_demo",
    "describe_inputs",
    "load_params",
    "read_trace",
    "record_measurement",
    "run_policy",
    "scale_trace",
    "scenario",
    "simulate",
    "slice_trace",
]
