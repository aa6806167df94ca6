"""Cluster-scale simulator: replay spot traces under on-demand, checkpoint-restart and Bamboo."""

from lightning_bamboo.sim.params import SimParams, load_params, record_measurement
from lightning_bamboo.sim.report import PolicyResult, SimReport, compare_with_demo
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
    "PolicyResult",
    "SimParams",
    "SimReport",
    "Trace",
    "TraceError",
    "TraceEvent",
    "bundled_trace",
    "compare_with_demo",
    "load_params",
    "read_trace",
    "record_measurement",
    "run_policy",
    "scale_trace",
    "simulate",
    "slice_trace",
]
