"""Sensitivity of the comparison to one input: ``simulate --sweep PARAM=a:b:n`` and its PNG.

``--sweep mtbf=5m:24h:n`` sweeps the failure rate itself: ``n`` synthetic traces whose whole cluster
loses a node every ``mtbf`` on average (geometrically spaced, since a 5-minute and a 24-hour mean
time between failures are the ends of one scale; or a list, ``mtbf=5m,10m,1h``). Every table then also gives each policy's
effective training time ratio (ETTR): the samples it trained over the samples the same number of
on-demand nodes, never preempted and paying no fault-tolerance overhead, train in the same wall
time, i.e. the share of the wall time that became training progress.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_bamboo.sim.params import ParamError, SimParams, convert
from lightning_bamboo.sim.report import PAPER, SimReport

if TYPE_CHECKING:
    from matplotlib.figure import Figure


#: the cluster's mean time between failures: swept over synthetic traces (``--generate``)
MTBF = "mtbf"
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``"300"``, ``"300s"``, ``"5m"``, ``"24h"`` -> seconds (> 0)."""
    text = text.strip()
    scale = _UNITS.get(text[-1:].lower(), 0.0)
    number = text[:-1] if scale else text
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        raise ParamError(f"--sweep mtbf: {text!r} is not a duration; write seconds or e.g. 5m, 24h") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ParamError(f"--sweep mtbf: a mean time between failures must be > 0 (got {text!r})")
    return seconds


def mtbf_preemption_rate(mtbf_seconds: float, nodes: int) -> float:
    """The per-node-hour preemption rate at which ``nodes`` nodes lose one of them every ``mtbf_seconds``."""
    return 3600.0 / (mtbf_seconds * nodes)


def mtbf_trace(mtbf_seconds: float, nodes: int, hours: float, replacement_delay_seconds: float, seed: int = 0):
    """A synthetic trace of the simulator's model whose ``nodes`` nodes lose one every ``mtbf_seconds`` on average,
    each replaced after ``replacement_delay_seconds`` (mean): one point of ``--sweep mtbf=...``, for the benchmarks
    that run it for real."""
    from lightning_bamboo.sim.generate import SpotModel, generate_trace

    return generate_trace(SpotModel(nodes=nodes, hours=hours, preemption_rate=mtbf_preemption_rate(mtbf_seconds, nodes),
                                    replacement_delay_seconds=replacement_delay_seconds, seed=seed))


def parse_sweep(text: str, extra: Iterable[str] = ()) -> tuple[str, list[float]]:
    """``"restart_seconds=30:600:5"`` -> the input's name and 5 evenly spaced values from 30 to 600.

    The name is a simulator parameter or one of ``extra`` (the synthetic trace model's fields with
    ``--generate``). Values of whole-number parameters are rounded and repeated ones dropped.
    """
    name, sep, spec = text.partition("=")
    parts = spec.split(":")
    if name == MTBF and sep and len(parts) == 1 and "," in spec:  # a list: mtbf=5m,10m,1h
        return name, sorted({parse_duration(part) for part in spec.split(",")})
    if name == MTBF and len(parts) == 3:
        try:
            count = int(parts[2])
        except ValueError:
            raise ParamError(f"--sweep mtbf: COUNT must be a whole number (got {parts[2]!r})") from None
        if count < 2:
            raise ParamError(f"--sweep mtbf: COUNT must be at least 2 to draw a line (got {count})")
        start, stop = parse_duration(parts[0]), parse_duration(parts[1])
        return name, sorted({start * (stop / start) ** (i / (count - 1)) for i in range(count)})
    known = {f.name for f in dataclasses.fields(SimParams)} | set(extra)
    if not sep or len(parts) != 3 or name not in known:
        raise ParamError(
            f"--sweep needs PARAM=START:STOP:COUNT with PARAM a simulator input (got {text!r}); "
            f"e.g. --sweep restart_seconds=30:600:5 or --sweep mtbf=5m:24h:8; inputs: {sorted(known | {MTBF})}"
        )
    try:
        start, stop, count = float(parts[0]), float(parts[1]), int(parts[2])
    except ValueError:
        raise ParamError(f"--sweep {name}: START and STOP are numbers, COUNT a whole number (got {spec!r})") from None
    if count < 2:
        raise ParamError(f"--sweep {name}: COUNT must be at least 2 to draw a line (got {count})")
    values = [start + (stop - start) * i / (count - 1) for i in range(count)]
    if name in {f.name for f in dataclasses.fields(SimParams)}:
        values = [float(convert(name, str(round(v) if _is_int(name) else v))) for v in values]
    unique: list[float] = []
    for v in values:
        if v not in unique:
            unique.append(v)
    return name, unique


def _is_int(name: str) -> bool:
    return {f.name: f.type for f in dataclasses.fields(SimParams)}[name] == "int"


def sweep(
    name: str, values: Sequence[float], run: Callable[[str, float], SimReport]
) -> list[tuple[float, SimReport]]:
    """``run(name, value)`` for every value (the caller builds the trace and parameters)."""
    return [(v, run(name, v)) for v in values]


SHORT = {
    "bamboo_vs_checkpoint_throughput": "bamboo/ckpt",
    "bamboo_vs_on_demand_value": "bamboo/od $",
    "recycle_vs_bamboo_throughput": "recycle/bamboo",
    "parcae_vs_bamboo_throughput": "parcae/bamboo",
}


def ettr(report: SimReport) -> dict[str, float]:
    """Each policy's effective training time ratio: its samples over on-demand's in the same wall time
    (empty without the on-demand policy, the reference)."""
    reference = report.policies.get("on_demand")
    if reference is None or reference.samples <= 0:
        return {}
    return {name: result.samples / reference.samples for name, result in report.policies.items()}


def _value(name: str, value: float) -> str:
    if name != MTBF:
        return f"{value:g}"
    for unit, scale in (("h", 3600.0), ("m", 60.0)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}s"


def sweep_table(name: str, results: Sequence[tuple[float, SimReport]]) -> str:
    """One row per value: each policy's samples/s and samples/$, its ETTR (with on-demand among the
    policies), then the ratios (throughput unless marked $)."""
    policies = list(results[0][1].policies)
    ratios = [k for k in SHORT if k in results[0][1].comparison()]
    with_ettr = [p for p in policies if p != "on_demand"] if ettr(results[0][1]) else []
    cols = [f"{p} /s" for p in policies] + [f"{p} /$" for p in policies] + [f"ETTR {p}" for p in with_ettr]
    cols += [SHORT[k] for k in ratios]
    widths = [max(len(c) + 2, 10) for c in cols]
    rows = [f"{name:>24}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))]
    for value, report in results:
        cells = [f"{report.policies[p].samples_per_second:.2f}" for p in policies]
        cells += [f"{report.policies[p].samples_per_dollar:.0f}" for p in policies]
        ratio = ettr(report)
        cells += [f"{ratio[p]:.3f}" for p in with_ettr]
        c = report.comparison()
        cells += [f"{c[k]:.2f}x" if c.get(k) is not None else "n/a" for k in ratios]
        rows.append(f"{_value(name, value):>24}" + "".join(f"{x:>{w}}" for x, w in zip(cells, widths, strict=True)))
    return "\n".join(rows)


def plot_sweep(name: str, results: Sequence[tuple[float, SimReport]], path: str | os.PathLike[str]) -> Figure:
    """Write a PNG of every policy's throughput and value, and Bamboo's ratios, against ``name``.

    Returns the figure (closed for drawing; its axes keep their labels) so callers can inspect it.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    xs = [v / 60.0 if name == MTBF else v for v, _ in results]
    with_ettr = bool(ettr(results[0][1]))
    fig, axes = plt.subplots(4 if with_ettr else 3, 1, figsize=(8, 13 if with_ettr else 10), sharex=True)
    ax_rate, ax_value, ax_ratio = axes[:3]
    for policy in results[0][1].policies:
        ax_rate.plot(xs, [r.policies[policy].samples_per_second for _, r in results], marker="o", label=policy)
        ax_value.plot(xs, [r.policies[policy].samples_per_dollar for _, r in results], marker="o", label=policy)
    labels = {
        "bamboo_vs_checkpoint_throughput": "Bamboo / checkpoint-restart, throughput",
        "bamboo_vs_on_demand_value": "Bamboo / on-demand, value",
    }
    for key, label in labels.items():
        ys: list[Any] = [r.comparison().get(key) for _, r in results]
        if any(y is not None for y in ys):
            line = ax_ratio.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
            ax_ratio.axhline(PAPER[key], linestyle="--", color=line[0].get_color(), label=f"paper: {PAPER[key]}x")
    ax_ratio.axhline(1.0, color="grey", linewidth=0.8)
    ax_rate.set_ylabel("throughput (samples/s)")
    ax_value.set_ylabel("value (samples/$)")
    ax_ratio.set_ylabel("ratio")
    if with_ettr:
        ax_ettr = axes[3]
        for policy in results[0][1].policies:
            if policy != "on_demand":
                ax_ettr.plot(xs, [ettr(r)[policy] for _, r in results], marker="o", label=policy)
        ax_ettr.set_ylabel("ETTR (of on-demand's samples)")
        ax_ettr.set_ylim(0, 1.05)
    if name == MTBF:
        axes[-1].set_xscale("log")
    axes[-1].set_xlabel("mean time between failures (minutes)" if name == MTBF else name)
    source = os.path.basename(str(results[0][1].trace["source"]))
    ax_rate.set_title(f"{source}: sensitivity to {name}", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = f"{os.fspath(path)}.tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)  # never a half-written PNG
    plt.close(fig)
    return fig
