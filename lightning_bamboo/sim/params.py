"""Simulator parameters: defaults with their sources from ``data/sim_params.json``, overridable anywhere."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_bamboo.errors import BambooConfigError

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "data" / "sim_params.json"

#: where an input's value comes from (the ``kind`` of every entry of the parameter file)
KINDS = ("measured", "published", "released-code", "assumption", "choice", "override")


class ParamError(BambooConfigError):
    """A simulator parameter is unknown, malformed or out of range."""


@dataclass(frozen=True)
class SimParams:
    """Every number the simulator uses (meaning, unit and provenance: ``data/sim_params.json``)."""

    stages: int = 12
    min_stages: int = 6
    layers: int = 48
    micro_batch_size: int = 8
    global_micro_batches: int = 48
    pipeline_micro_batches: int = 0
    step_seconds: float = 4.0
    step_pipelines: int = 4
    single_pipeline_step_seconds: float = 0.0
    step_fixed_seconds: float = 0.0
    redundancy_overhead: float = 0.1
    failover_slowdown: float = 1.5
    failover_seconds: float = 5.0
    reconfigure_seconds: float = 20.0
    restart_seconds: float = 60.0
    checkpoint_save_seconds: float = 20.0
    checkpoint_interval_seconds: float = 0.0
    bamboo_checkpoint_interval_seconds: float = 600.0
    snapshot_seconds: float = 0.0
    node_ready_seconds: float = 45.0
    rejoin_seconds: float = 20.0
    max_overloaded_fraction: float = 0.05
    spot_price: float = 0.91
    on_demand_price: float = 3.06
    on_demand_nodes: int = 0
    nodes: int = 0
    hours: float = 0.0
    migration_seconds: float = 20.0
    predicted_fraction: float = 0.5

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ParamError(
                    f"parameter {f.name} must be a finite number (got {value!r}); pass e.g. {f.name}=1"
                )
            if f.type == "int":
                if value != int(value):
                    raise ParamError(
                        f"parameter {f.name} must be a whole number (got {value!r}); pass {f.name}={int(value)}"
                    )
                object.__setattr__(self, f.name, int(value))
            else:
                object.__setattr__(self, f.name, float(value))
        positive = (
            "spot_price",
            "on_demand_price",
            "step_seconds",
            "stages",
            "layers",
            "micro_batch_size",
            "global_micro_batches",
            "step_pipelines",
            "min_stages",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                hint = " (a price is dollars per node-hour)" if name.endswith("price") else ""
                raise ParamError(
                    f"parameter {name} must be > 0 (got {getattr(self, name)}){hint}; pass {name}=<positive>"
                )
        non_negative = (
            "redundancy_overhead",
            "failover_seconds",
            "reconfigure_seconds",
            "restart_seconds",
            "checkpoint_save_seconds",
            "pipeline_micro_batches",
            "checkpoint_interval_seconds",
            "bamboo_checkpoint_interval_seconds",
            "snapshot_seconds",
            "node_ready_seconds",
            "rejoin_seconds",
            "single_pipeline_step_seconds",
            "step_fixed_seconds",
            "on_demand_nodes",
            "nodes",
            "hours",
            "max_overloaded_fraction",
            "migration_seconds",
            "predicted_fraction",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ParamError(
                    f"parameter {name} must be >= 0 (got {getattr(self, name)}); pass {name}=0 or more"
                )
        if self.predicted_fraction > 1:
            raise ParamError(
                f"predicted_fraction is a share of removals, at most 1 (got {self.predicted_fraction}); "
                "pass predicted_fraction=1 to foresee every removal"
            )
        if self.failover_slowdown < 1:
            raise ParamError(
                f"failover_slowdown must be >= 1: running two stages cannot be faster (got {self.failover_slowdown})"
            )
        if self.min_stages > self.stages or self.layers < self.stages:
            raise ParamError(
                f"need min_stages <= stages <= layers (min_stages: {self.min_stages}, stages: {self.stages}, "
                f"layers: {self.layers}); adjust one of them"
            )
        if self.step_pipelines > self.global_micro_batches:
            raise ParamError(
                f"step_pipelines ({self.step_pipelines}) cannot exceed global_micro_batches "
                f"({self.global_micro_batches}): each pipeline needs a micro-batch"
            )

    @property
    def samples_per_step(self) -> int:
        """Samples per step of the reference layout (``step_pipelines`` pipelines)."""
        if self.pipeline_micro_batches:
            return self.micro_batch_size * self.pipeline_micro_batches * self.step_pipelines
        return self.micro_batch_size * self.global_micro_batches

    def replace(self, **changes: Any) -> SimParams:
        """A copy with ``changes`` (unknown names raise :class:`ParamError`)."""
        _check_names(changes)
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def _check_names(names: Iterable[str]) -> None:
    known = {f.name for f in dataclasses.fields(SimParams)}
    if unknown := sorted(set(names) - known):
        raise ParamError(f"unknown simulator parameter(s) {unknown}; known: {sorted(known)}")


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ParamError(
            f"cannot read parameter file {str(path)!r}: {exc}; pass a JSON file like {DEFAULT_PATH}"
        ) from exc
    params = data.get("params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or any(
        not isinstance(v, dict) or "value" not in v for v in params.values()
    ):
        raise ParamError(
            f"parameter file {str(path)!r} must be {{'params': {{name: {{'value': ..., 'kind': ..., 'source': ...}}}}}}"
        )
    return data


def provenance(path: str | os.PathLike[str] = DEFAULT_PATH) -> dict[str, str]:
    """``name -> where its value comes from`` as recorded in the parameter file."""
    return {k: str(v.get("source", v.get("provenance", ""))) for k, v in _read(path)["params"].items()}


def describe_inputs(
    params: SimParams,
    sources: Mapping[str, str] | None = None,
    path: str | os.PathLike[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """``{name: {"value", "kind", "source"}}`` for every input of ``params`` (the report's ``inputs``).

    ``sources`` names the source of values set by the caller (a scenario); a value that is neither
    there nor equal to the parameter file's default is marked ``override``.
    """
    entries = _read(path or DEFAULT_PATH)["params"]
    out: dict[str, dict[str, Any]] = {}
    for name, value in params.as_dict().items():
        entry = entries.get(name, {})
        if sources and name in sources:
            kind, _, text = sources[name].partition(": ")
            if kind not in KINDS:
                kind, text = "assumption", sources[name]
        elif entry and entry.get("value") == value:
            kind = str(entry.get("kind", "assumption"))
            text = str(entry.get("source", entry.get("provenance", "")))
        else:
            default = entry.get("value", "none")
            kind, text = "override", f"set for this run (--param or Python); the bundled default is {default}"
        out[name] = {"value": value, "kind": kind, "source": text}
    return out


def _commit() -> str | None:
    """The short commit of the working tree this package runs from (None outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def convert(name: str, text: str) -> int | float:
    """Parse ``text`` as the type of parameter ``name``."""
    _check_names([name])
    kind = {f.name: f.type for f in dataclasses.fields(SimParams)}[name]
    try:
        value = float(text)
    except ValueError:
        raise ParamError(f"parameter {name} needs a number (got {text!r}); pass e.g. {name}=1") from None
    if kind == "int":
        if value != int(value):
            raise ParamError(
                f"parameter {name} must be a whole number (got {text!r}); pass {name}={int(value)}"
            )
        return int(value)
    return value


def parse_overrides(items: Iterable[str]) -> dict[str, int | float]:
    """``["key=value", ...]`` (from ``--param``) -> typed overrides."""
    out: dict[str, int | float] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ParamError(f"--param needs KEY=VALUE (got {item!r}); e.g. --param spot_price=0.91")
        out[key.strip()] = convert(key.strip(), text.strip())
    return out


def load_params(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> SimParams:
    """Parameters from ``path`` (default: the bundled file), then ``overrides`` on top."""
    values = {k: v["value"] for k, v in _read(path or DEFAULT_PATH)["params"].items()}
    values.update(overrides or {})
    _check_names(values)
    clean: dict[str, Any] = {k: convert(k, str(v)) if isinstance(v, str) else v for k, v in values.items()}
    return SimParams(**clean)


def record_measurement(
    key: str,
    value: Any,
    provenance_text: str,
    path: str | os.PathLike[str] = DEFAULT_PATH,
    section: str = "params",
) -> None:
    """Replace one default with a measured value (for benchmarks); the provenance says how it was measured.

    ``section="params"`` (default): the cluster-scale defaults of ``simulate``. ``section="demo"``:
    the demo-scale times of :mod:`lightning_bamboo.sim.demo` (this machine's ``lightning-bamboo demo``),
    kept apart so that demo numbers never pass for GPU-cluster ones.
    """
    if section not in SECTIONS:
        raise ParamError(f"unknown parameter section {section!r}; use one of {sorted(SECTIONS)}")
    if not provenance_text.strip():
        raise ParamError(f"a measurement of {key} needs a provenance (which benchmark, machine, date)")
    data = _read(path)
    if section == "params":
        _check_names([key])
        SimParams(**{**{k: v["value"] for k, v in data["params"].items()}, key: value})  # validates
        entries = data["params"]
    else:
        block = data.setdefault("demo", {"about": SECTIONS["demo"], "params": {}})
        entries = block.setdefault("params", {})
        known = {f.name for f in dataclasses.fields(DemoParams)}
        if key not in known:
            raise ParamError(f"unknown demo parameter {key!r}; known: {sorted(known)}")
        if not isinstance(value, (int, float, dict)) or isinstance(value, bool):
            raise ParamError(f"demo parameter {key} takes a number or a depth -> seconds mapping (got {value!r})")
    entry = entries.setdefault(key, {})
    entry["value"] = value
    if section == "params":
        commit = _commit()
        if commit and "commit" not in provenance_text:
            provenance_text = f"{provenance_text} (commit {commit})"
        entry.pop("provenance", None)
        entry["kind"] = "measured"
        entry["source"] = provenance_text
    else:
        entry["provenance"] = provenance_text
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


SECTIONS = {
    "params": "cluster-scale defaults of lightning-bamboo simulate (GPT-2-like job on a p3 GPU cluster)",
    "demo": (
        "DEMO SCALE, not GPU-cluster numbers: times of `lightning-bamboo demo` (built-in 8-layer GPT, one "
        "pipeline, 8 samples/step) on the machine that ran benchmarks/sim_calibrate.py; used by "
        "lightning_bamboo.sim.demo and benchmarks/sim_validation.py only"
    ),
}


@dataclass(frozen=True)
class DemoParams:
    """Demo-scale times (seconds on the machine that ran ``benchmarks/sim_calibrate.py``)."""

    step_seconds: Mapping[int, float]  # pipeline depth -> seconds per step, with replicas
    step_seconds_no_redundancy: Mapping[int, float]  # pipeline depth -> seconds per step, no replicas
    failover_seconds: float  # from a loss to the redone step starting on the shorter pipeline
    restart_seconds: float  # from a loss to the first step after reloading the checkpoint starting
    checkpoint_save_seconds: float  # pause after every checkpoint_every-th step
    end_seconds: float = 0.0  # time the demo counts after its last step (final save, exit)
    startup_timeout_seconds: float = (
        0.0  # a worker lost while a restart starts: the others wait this long, then fail
    )
    samples_per_step: int = 8
    reconfigure_seconds: float = 0.0  # a live reconfiguration (rebalance after a failover, admitting a node)
    join_seconds: float = 0.0  # from starting a joining node to it standing by (process and model start-up)
    standby_start_seconds: float = 0.0  # training time lost to one standby process starting (it shares the cores)
    #: with replicas, a fatal loss restarts the survivors in their running processes: from the loss to the
    #: first step after reloading the checkpoint (None: as long as ``restart_seconds``)
    restart_in_place_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("step_seconds", "step_seconds_no_redundancy"):
            table = getattr(self, name)
            if not table or any(int(d) < 1 or not float(s) > 0 for d, s in table.items()):
                raise ParamError(
                    f"demo parameter {name} needs depth -> seconds > 0 for depths >= 1 (got {table!r})"
                )
            object.__setattr__(self, name, {int(d): float(s) for d, s in table.items()})
        for name in (
            "failover_seconds",
            "restart_seconds",
            "checkpoint_save_seconds",
            "end_seconds",
            "startup_timeout_seconds",
            "reconfigure_seconds",
            "join_seconds",
            "standby_start_seconds",
            "restart_in_place_seconds",
        ):
            if getattr(self, name) is not None and not float(getattr(self, name)) >= 0:
                raise ParamError(f"demo parameter {name} must be >= 0 (got {getattr(self, name)!r})")
        if self.samples_per_step < 1:
            raise ParamError(f"demo parameter samples_per_step must be >= 1 (got {self.samples_per_step})")

    def step_time(self, depth: int, redundancy: bool) -> float:
        """Seconds per step at ``depth`` (a one-node pipeline has no replica): the measured value,
        linear between the measured depths around it, the nearest measured depth outside them."""
        table = self.step_seconds if redundancy and depth > 1 else self.step_seconds_no_redundancy
        if depth in table:
            return table[depth]
        below = [d for d in table if d < depth]
        above = [d for d in table if d > depth]
        if not below or not above:
            return table[max(below) if below else min(above)]
        d0, d1 = max(below), min(above)
        return table[d0] + (table[d1] - table[d0]) * (depth - d0) / (d1 - d0)
