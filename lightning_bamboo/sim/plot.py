"""PNG plots of a simulation: throughput, cost and nodes over time, one line per policy."""

from __future__ import annotations

import os
from collections.abc import Sequence

from lightning_bamboo.sim.ledger import Point
from lightning_bamboo.sim.report import SimReport


def binned_rate(timeline: Sequence[Point], end: float, bins: int = 200) -> tuple[list[float], list[float]]:
    """Time-weighted mean of the training rate over ``bins`` equal windows of ``[0, end]`` (hours, samples/s)."""
    width = end / bins
    sums = [0.0] * bins
    points = list(timeline)
    for i, p in enumerate(points):
        start, stop = p.seconds, (points[i + 1].seconds if i + 1 < len(points) else end)
        if not p.rate or stop <= start:
            continue
        for b in range(min(int(start / width), bins - 1), min(int(stop / width), bins - 1) + 1):
            overlap = min(stop, (b + 1) * width) - max(start, b * width)
            sums[b] += p.rate * max(overlap, 0.0)
    centres = [(b + 0.5) * width / 3600.0 for b in range(bins)]
    return centres, [s / width for s in sums]


def plot_report(report: SimReport, path: str | os.PathLike[str], bins: int = 200) -> None:
    """Write a PNG: samples/s (windowed mean), cumulative dollars, and nodes, against hours."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    end = float(str(report.trace["hours"])) * 3600.0
    fig, (ax_rate, ax_cost, ax_nodes) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for name, result in report.policies.items():
        hours, rate = binned_rate(result.timeline, end, bins)
        ax_rate.plot(hours, rate, label=f"{name} (mean {result.samples_per_second:.1f})")
        xs = [p.seconds / 3600.0 for p in result.timeline] + [end / 3600.0]
        ax_cost.plot(xs, [p.cost for p in result.timeline] + [result.cost_dollars], label=name)
        if name != "on_demand":
            ax_nodes.step(
                xs[:-1], [p.active for p in result.timeline], where="post", label=f"{name}: in layout"
            )
    spot = next((r for n, r in report.policies.items() if n != "on_demand"), None)
    if spot is not None:
        ax_nodes.step(
            [p.seconds / 3600.0 for p in spot.timeline],
            [p.nodes for p in spot.timeline],
            where="post",
            color="grey",
            label="spot nodes billed",
        )
    ax_rate.set_ylabel(f"samples/s ({end / bins / 60:.0f}-min mean)")
    ax_cost.set_ylabel("dollars spent")
    ax_nodes.set_ylabel("nodes")
    ax_nodes.set_xlabel("hours")
    for ax in (ax_rate, ax_cost, ax_nodes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_rate.set_title(f"{report.trace['source']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
