"""Results per policy, the JSON report, the terminal table and the check against a real demo run."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.sim.ledger import RECOVERY_KINDS, Ledger, Point
from lightning_bamboo.sim.params import SimParams

# Bamboo (NSDI'23) headline numbers, printed beside ours
PAPER = {"bamboo_vs_checkpoint_throughput": 3.7, "bamboo_vs_on_demand_value": 2.4}
# published claims of the systems after Bamboo, printed beside what the simulator gives their policies
CLAIMS = {
    "recycle_vs_bamboo_throughput": "up to 1.64x (ReCycle, Gandhi et al., SOSP'24)",
    "parcae_vs_bamboo_throughput": (
        "up to 10x over earlier spot systems at high preemption rates (Parcae, Duan et al., NSDI'24)"
    ),
}


@dataclass(frozen=True)
class PolicyResult:
    """Totals of one policy over the whole replay (a rate is an average over ``hours``)."""

    name: str
    hours: float
    samples: float
    samples_per_second: float
    cost_dollars: float
    samples_per_dollar: float
    recovery_hours: float  # failover + reconfigure + restart pauses + work rolled back
    node_hours: float
    steps_completed: float
    preemptions: int
    recoveries: Mapping[str, int]
    reconfigurations: int
    breakdown_hours: Mapping[str, float]  # training, idle, checkpoint, failover, ... lost_work
    timeline: tuple[Point, ...] = field(repr=False, default=())

    @classmethod
    def from_ledger(cls, name: str, ledger: Ledger, end: float) -> PolicyResult:
        hours = end / 3600.0
        breakdown = {k: v / 3600.0 for k, v in ledger.seconds.items()}
        return cls(
            name=name,
            hours=hours,
            samples=ledger.samples,
            samples_per_second=ledger.samples / end,
            cost_dollars=ledger.cost,
            samples_per_dollar=ledger.samples / ledger.cost if ledger.cost > 0 else 0.0,
            recovery_hours=sum(breakdown[k] for k in RECOVERY_KINDS),
            node_hours=ledger.cost / ledger.price,
            steps_completed=ledger.steps,
            preemptions=ledger.preemptions,
            recoveries=dict(ledger.recoveries),
            reconfigurations=ledger.reconfigurations,
            breakdown_hours=breakdown,
            timeline=tuple(ledger.timeline),
        )

    def as_dict(self, timeline: bool = True) -> dict[str, Any]:
        out = {
            k: getattr(self, k)
            for k in (
                "hours",
                "samples",
                "samples_per_second",
                "cost_dollars",
                "samples_per_dollar",
                "recovery_hours",
                "node_hours",
                "steps_completed",
                "preemptions",
                "reconfigurations",
            )
        }
        out["recoveries"] = dict(self.recoveries)
        out["breakdown_hours"] = dict(self.breakdown_hours)
        if timeline:
            out["timeline"] = [
                {
                    "hours": p.seconds / 3600.0,
                    "samples_per_second": p.rate,
                    "samples": p.samples,
                    "cost_dollars": p.cost,
                    "nodes": p.nodes,
                    "active_nodes": p.active,
                }
                for p in self.timeline
            ]
        return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


@dataclass(frozen=True)
class SimReport:
    """Every policy's result for one trace and one set of parameters."""

    policies: Mapping[str, PolicyResult]
    params: SimParams
    trace: Mapping[str, object]
    inputs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> value, kind, source

    def comparison(self) -> dict[str, float | None]:
        p = self.policies
        out: dict[str, float | None] = {}
        if "bamboo" in p and "checkpoint" in p:
            out["bamboo_vs_checkpoint_throughput"] = _ratio(
                p["bamboo"].samples_per_second, p["checkpoint"].samples_per_second
            )
        if "bamboo" in p and "on_demand" in p:
            out["bamboo_vs_on_demand_value"] = _ratio(
                p["bamboo"].samples_per_dollar, p["on_demand"].samples_per_dollar
            )
            out["bamboo_vs_on_demand_throughput"] = _ratio(
                p["bamboo"].samples_per_second, p["on_demand"].samples_per_second
            )
        for other in ("recycle", "parcae"):
            if other in p and "bamboo" in p:
                out[f"{other}_vs_bamboo_throughput"] = _ratio(
                    p[other].samples_per_second, p["bamboo"].samples_per_second
                )
        return out

    def as_dict(self, timeline: bool = True) -> dict[str, Any]:
        return {
            "policies": {k: v.as_dict(timeline) for k, v in self.policies.items()},
            "comparison": self.comparison(),
            "paper": dict(PAPER),
            "trace": dict(self.trace),
            "params": self.params.as_dict(),
            "inputs": {k: dict(v) for k, v in self.inputs.items()},
        }

    def inputs_table(self) -> str:
        """Every input as a Markdown table: name, value, kind and source."""
        rows = ["| input | value | kind | source |", "|---|---:|---|---|"]
        for name, entry in self.inputs.items():
            source = str(entry["source"]).replace("|", "/")
            rows.append(f"| `{name}` | {entry['value']} | {entry['kind']} | {source} |")
        return "\n".join(rows)

    def write_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n", encoding="utf-8")

    def table(self) -> str:
        """The terminal table: one row per policy, then our ratios beside the paper's."""
        head = (
            f"{'policy':<18}{'samples/s':>10}{'cost $':>10}{'samples/$':>11}{'hours':>7}{'recovery h':>11}"
            f"{'node-h':>8}{'preempt':>8}{'recoveries (rc/ckpt)':>21}"
        )
        rows = [head, "-" * len(head)]
        for name, r in self.policies.items():
            rec = f"{r.recoveries.get('redundant', 0)}/{r.recoveries.get('checkpoint', 0)}"
            rows.append(
                f"{name:<18}{r.samples_per_second:>10.1f}{r.cost_dollars:>10.1f}{r.samples_per_dollar:>11.0f}"
                f"{r.hours:>7.2f}{r.recovery_hours:>11.2f}{r.node_hours:>8.0f}{r.preemptions:>8}{rec:>21}"
            )
        labels = {
            "bamboo_vs_checkpoint_throughput": "Bamboo vs checkpoint-restart, throughput",
            "bamboo_vs_on_demand_value": "Bamboo vs on-demand, value (samples/$)",
        }
        labels["recycle_vs_bamboo_throughput"] = "ReCycle-style vs Bamboo, throughput"
        labels["parcae_vs_bamboo_throughput"] = "Parcae-style vs Bamboo, throughput"
        for key, value in self.comparison().items():
            if key in labels:
                ours = f"{value:.2f}x" if value is not None else "n/a"
                published = f"paper: {PAPER[key]}x" if key in PAPER else f"published: {CLAIMS[key]}"
                rows.append(f"{labels[key]}: {ours} ({published})")
        src = self.trace
        rows.append(
            f"trace: {src['source']}, {src['hours']:.2f} h, peak {src['peak_nodes']} nodes, "
            f"{src['removals']} removals"
        )
        return "\n".join(rows)


@dataclass(frozen=True)
class Validation:
    """Simulator vs a real demo run: relative errors and whether all are within tolerance.

    ``rate_error`` compares samples per second when both sides report it (a demo run has a fixed
    number of steps, so its speed is what a prediction of it can miss); ``None`` otherwise.
    """

    steps_error: float
    recoveries_error: float
    tolerance: float
    rate_error: float | None = None

    @property
    def ok(self) -> bool:
        errors = [self.steps_error, self.recoveries_error]
        if self.rate_error is not None:
            errors.append(self.rate_error)
        return all(e <= self.tolerance for e in errors)


def relative_error(predicted: float, measured: float) -> float:
    """``|predicted - measured| / measured`` (0 when both are 0, infinite when only ``measured`` is)."""
    if measured:
        return abs(predicted - measured) / abs(measured)
    return 0.0 if predicted == measured else float("inf")


def compare_with_demo(demo_report: Mapping[str, Any], predicted: Any, tolerance: float = 0.15) -> Validation:
    """Compare a ``lightning-bamboo demo --report`` JSON (``steps_completed``, ``recoveries``, and
    ``samples_per_second`` when present) with a prediction of the same run.

    ``predicted`` is a :class:`PolicyResult` or a :class:`lightning_bamboo.sim.demo.DemoPrediction`
    (anything with ``steps_completed``, ``recoveries`` and ``samples_per_second``). The demo must
    replay the same compressed trace slice the simulator was given.
    """
    missing = [k for k in ("steps_completed", "recoveries") if k not in demo_report]
    if missing:
        raise BambooConfigError(
            f"the demo report lacks {missing} (has {sorted(demo_report)}); pass the JSON of `lightning-bamboo demo --report`"
        )
    demo_rec = sum(int(v) for v in dict(demo_report["recoveries"]).values())
    sim_rec = sum(predicted.recoveries.values())
    rate = None
    if "samples_per_second" in demo_report and getattr(predicted, "samples_per_second", None) is not None:
        rate = relative_error(float(predicted.samples_per_second), float(demo_report["samples_per_second"]))
    return Validation(
        relative_error(float(predicted.steps_completed), float(demo_report["steps_completed"])),
        relative_error(sim_rec, demo_rec),
        tolerance,
        rate,
    )
