"""Sensitivity of the comparison to one input: ``simulate --sweep PARAM=a:b:n`` and its PNG."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_bamboo.sim.params import ParamError, SimParams, convert
from lightning_bamboo.sim.report import PAPER, SimReport

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def parse_sweep(text: str, extra: Iterable[str] = ()) -> tuple[str, list[float]]:
    """``"restart_seconds=30:600:5"`` -> the input's name and 5 evenly spaced values from 30 to 600.

    The name is a simulator parameter or one of ``extra`` (the synthetic trace model's fields with
    ``--generate``). Values of whole-number parameters are rounded and repeated ones dropped.
    """
    name, sep, spec = text.partition("=")
    parts = spec.split(":")
    known = {f.name for f in dataclasses.fields(SimParams)} | set(extra)
    if not sep or len(parts) != 3 or name not in known:
        raise ParamError(
            f"--sweep needs PARAM=START:STOP:COUNT with PARAM a simulator input (got {text!r}); "
            f"e.g. --sweep restart_seconds=30:600:5; inputs: {sorted(known)}"
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


def sweep_table(name: str, results: Sequence[tuple[float, SimReport]]) -> str:
    """One row per value: each policy's samples/s and samples/$, then the ratios (throughput unless marked $)."""
    policies = list(results[0][1].policies)
    ratios = [k for k in SHORT if k in results[0][1].comparison()]
    cols = [f"{p} /s" for p in policies] + [f"{p} /$" for p in policies] + [SHORT[k] for k in ratios]
    widths = [max(len(c) + 2, 10) for c in cols]
    rows = [f"{name:>24}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))]
    for value, report in results:
        cells = [f"{report.policies[p].samples_per_second:.2f}" for p in policies]
        cells += [f"{report.policies[p].samples_per_dollar:.0f}" for p in policies]
        c = report.comparison()
        cells += [f"{c[k]:.2f}x" if c.get(k) is not None else "n/a" for k in ratios]
        rows.append(f"{value:>24g}" + "".join(f"{x:>{w}}" for x, w in zip(cells, widths, strict=True)))
    return "\n".join(rows)


def plot_sweep(name: str, results: Sequence[tuple[float, SimReport]], path: str | os.PathLike[str]) -> Figure:
    """Write a PNG of every policy's throughput and value, and Bamboo's ratios, against ``name``.

    Returns the figure (closed for drawing; its axes keep their labels) so callers can inspect it.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    xs = [v for v, _ in results]
    fig, (ax_rate, ax_value, ax_ratio) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
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
    ax_ratio.set_xlabel(name)
    source = os.path.basename(str(results[0][1].trace["source"]))
    ax_rate.set_title(f"{source}: sensitivity to {name}", fontsize=9)
    for ax in (ax_rate, ax_value, ax_ratio):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = f"{os.fspath(path)}.tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)  # never a half-written PNG
    plt.close(fig)
    return fig
