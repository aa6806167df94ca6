"""``lightning-bamboo simulate``: replay a spot trace under each policy; table, JSON report, PNG plot."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.sim.generate import SpotModel, generate_trace
from lightning_bamboo.sim.params import convert, load_params, parse_overrides
from lightning_bamboo.sim.scenarios import scenario
from lightning_bamboo.sim.simulate import simulate
from lightning_bamboo.sim.sweep import MTBF, mtbf_preemption_rate, parse_sweep, plot_sweep, sweep, sweep_table
from lightning_bamboo.sim.trace import Trace, bundled_trace, read_trace, write_trace

POLICY_NAMES = ("on_demand", "checkpoint", "checkpoint_oracle", "elastic", "bamboo", "bamboo_auto", "bamboo_in_pipeline",
                "recycle", "parcae")
DEFAULT_POLICIES = ("on_demand", "checkpoint", "bamboo", "recycle", "parcae")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        metavar="CSV",
        help="trace file (milliseconds,add|remove,nodeNAME), or 'p3' / 'g4dn' for a bundled one",
    )
    parser.add_argument(
        "--generate",
        action="store_true",
        help="draw a synthetic trace instead (see --spot); needs no --trace",
    )
    parser.add_argument(
        "--spot",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="synthetic trace model field, e.g. preemption_rate=0.3 (per node-hour), "
        f"fields: {', '.join(f.name for f in dataclasses.fields(SpotModel))}",
    )
    parser.add_argument(
        "--scenario",
        metavar="NAME",
        help="a named setting with cited inputs (bamboo-paper); --trace and --param still apply on top",
    )
    parser.add_argument("--save-trace", metavar="CSV", help="write the replayed (generated) trace here")
    parser.add_argument(
        "--params", metavar="JSON", help="parameter file (default: the bundled sim_params.json)"
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one parameter, e.g. --param spot_price=0.91 (repeatable)",
    )
    parser.add_argument(
        "--nodes", type=int, help="scale the trace so its peak is about N nodes (= --param nodes=N)"
    )
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated policies out of {', '.join(POLICY_NAMES)} (default: %(default)s)",
    )
    parser.add_argument("--report", metavar="JSON", help="write the full report (per policy and over time)")
    parser.add_argument("--plot", metavar="PNG", help="write throughput, cost and nodes over time")
    parser.add_argument(
        "--sweep",
        metavar="PARAM=A:B:N",
        help="replay once per value of one input (N values from A to B; a --spot field with --generate) and "
        "print a table; with --plot, the PNG shows throughput, value and the ratios against it. "
        "mtbf=5m:24h:N (or a list, mtbf=5m,10m,1h) sweeps the cluster's mean time between failures over "
        "synthetic traces (geometric spacing) and adds each policy's ETTR, its share of on-demand's training progress",
    )
    parser.add_argument(
        "--show-inputs", action="store_true", help="also print every input with its value, kind and source"
    )


def _spot_model(args: argparse.Namespace, spot: dict[str, float] | None = None) -> SpotModel:
    """The synthetic trace model of ``--spot KEY=VALUE`` (and ``spot``'s fields on top)."""
    fields = {f.name: f for f in dataclasses.fields(SpotModel)}
    values: dict[str, Any] = {}
    for item in args.spot:
        key, sep, text = item.partition("=")
        if not sep or key not in fields:
            raise BambooConfigError(f"--spot needs KEY=VALUE with KEY in {sorted(fields)} (got {item!r})")
        try:
            number = float(text)
        except ValueError:
            raise BambooConfigError(f"--spot {key} needs a number (got {text!r})") from None
        values[key] = int(number) if fields[key].type == "int" else number
    values.update(spot or {})
    return SpotModel(**values)


def _trace(args: argparse.Namespace, spot: dict[str, float] | None = None) -> tuple[Trace, float]:
    if args.generate:
        if args.trace:
            raise BambooConfigError("pass either --trace or --generate, not both")
        model = _spot_model(args, spot)
        return generate_trace(model), model.hours
    if args.spot:
        raise BambooConfigError("--spot only applies with --generate")
    path = args.trace or (scenario(args.scenario).trace if args.scenario else None)
    if not path:
        raise BambooConfigError("simulate needs --trace CSV (or 'p3' / 'g4dn'), --generate or --scenario NAME")
    if not os.path.exists(path) and path in ("p3", "g4dn"):
        path = bundled_trace(path)
    return read_trace(path), 0.0


def run(args: argparse.Namespace) -> int:
    try:
        if args.sweep and args.sweep.partition("=")[0] == MTBF:
            if args.trace:
                raise BambooConfigError(
                    "--sweep mtbf draws one synthetic trace per failure rate; drop --trace (the cluster is "
                    "--spot nodes=N, its other fields apply too; a --scenario gives its inputs, not its trace)"
                )
            if any(item.partition("=")[0] == "preemption_rate" for item in args.spot):
                raise BambooConfigError("--sweep mtbf sets the preemption rate; drop --spot preemption_rate")
            args.generate = True
        trace, hours = _trace(args)
        chosen = scenario(args.scenario) if args.scenario else None
        overrides: dict[str, Any] = dict(chosen.values) if chosen else {}
        sources = dict(chosen.sources) if chosen else {}
        command_line = parse_overrides(args.param)
        for name in command_line:
            sources.pop(name, None)  # a --param replaces the scenario's value and its source
        overrides.update(command_line)
        if args.nodes is not None:
            overrides["nodes"] = convert("nodes", str(args.nodes))
        if hours and "hours" not in overrides:
            overrides["hours"] = hours
        params = load_params(args.params, overrides)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        if unknown := [p for p in policies if p not in POLICY_NAMES]:
            raise BambooConfigError(f"unknown policies {unknown}; use a subset of {list(POLICY_NAMES)}")
        if args.sweep:
            return _run_sweep(args, params, policies, sources)
        if args.save_trace:
            write_trace(trace, args.save_trace)
        report = simulate(trace, params, policies, sources)
    except BambooConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if chosen:
        print(f"scenario {chosen.name}: {chosen.about}")
        comparison = report.comparison()
        for key, (value, citation) in chosen.claims.items():
            ours = comparison.get(key)
            print(f"  {key}: ours {ours:.2f}x, published {value}x ({citation})" if ours else f"  {key}: n/a")
    if args.show_inputs:
        print(report.inputs_table())
    if args.report:
        report.write_json(args.report)
        print(f"report: {Path(args.report)}")
    if args.plot:
        from lightning_bamboo.sim.plot import plot_report

        plot_report(report, args.plot)
        print(f"plot: {Path(args.plot)}")
    return 0


def _run_sweep(args: argparse.Namespace, params: Any, policies: list[str], sources: dict[str, str]) -> int:
    """``--sweep``: one replay per value; a table, and the PNG with ``--plot``."""
    spot_fields = [f.name for f in dataclasses.fields(SpotModel)] if args.generate else []
    name, values = parse_sweep(args.sweep, spot_fields)
    if name == MTBF and "on_demand" not in policies:
        policies = ["on_demand", *policies]  # the reference of every ETTR

    def one(name: str, value: float) -> Any:
        if name == MTBF:
            rate = mtbf_preemption_rate(value, _spot_model(args).nodes)
            trace, _ = _trace(args, {"preemption_rate": rate})
            return simulate(trace, params, policies, sources)
        if name in spot_fields:
            trace, hours = _trace(args, {name: value})
            return simulate(trace, params, policies, sources)
        trace, _ = _trace(args)
        return simulate(trace, params.replace(**{name: convert(name, str(value))}), policies, sources)

    results = sweep(name, values, one)
    print(sweep_table(name, results))
    if args.plot:
        plot_sweep(name, results, args.plot)
        print(f"plot: {Path(args.plot)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-bamboo simulate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
