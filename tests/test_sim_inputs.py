"""Simulator inputs: trace files, parameters, the synthetic trace model, and their errors."""

from __future__ import annotations

import json

import pytest

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.sim.generate import SpotModel, generate_trace
from lightning_bamboo.sim.params import (
    DEFAULT_PATH,
    KINDS,
    ParamError,
    SimParams,
    describe_inputs,
    load_params,
    parse_overrides,
    provenance,
    record_measurement,
)
from lightning_bamboo.sim.simulate import checkpoint_interval, on_demand_nodes, prepare, simulate
from lightning_bamboo.sim.trace import (
    FORMAT,
    Trace,
    TraceError,
    TraceEvent,
    bundled_trace,
    parse_trace,
    read_trace,
    scale_trace,
    write_trace,
)

# ---- traces


def test_bundled_p3_trace_reads_with_its_known_shape():
    trace = read_trace(bundled_trace("p3"))
    lines = [line for line in bundled_trace("p3").read_text().splitlines() if line.strip()]
    assert len(trace.events) == len(lines)
    assert trace.events[0] == TraceEvent(0, "add", "node1")
    assert trace.removals == sum(",remove," in line for line in lines)
    assert trace.peak_nodes == max(n for _, n in trace.node_counts())
    assert trace.duration_seconds == int(lines[-1].split(",")[0]) / 1000


def test_events_are_frozen():
    e = TraceEvent(0, "add", "node1")
    with pytest.raises(AttributeError):
        e.ms = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("0,add", "2 comma-separated fields"),
        ("12.5,add,node2", "not a whole number"),
        ("-3,add,node2", "not a whole number"),
        ("10,kill,node2", "'kill' is not 'add' or 'remove'"),
        ("10,add,", "empty"),
        ("10,add,node 2", "spaces"),
    ],
)
def test_malformed_line_names_file_line_text_and_format(tmp_path, bad, problem):
    path = tmp_path / "bad.csv"
    path.write_text(f"0,add,node1\n\n{bad}\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    msg = str(info.value)
    assert str(path) in msg and "line 3" in msg and repr(bad) in msg and problem in msg and FORMAT in msg


@pytest.mark.parametrize(
    "lines, words",
    [
        (["0,remove,node1"], ["'node1' is removed but is not live"]),
        (["0,add,node1", "0,add,node1"], ["already added"]),
        (["50,add,node1", "10,add,node2"], ["must not decrease", "previous event at 50 ms"]),
        (["# only a comment", ""], ["no nodes"]),
    ],
)
def test_trace_rules(lines, words):
    with pytest.raises(TraceError) as info:
        parse_trace(lines, "t.csv")
    for w in words:
        assert w in str(info.value)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(TraceError, match="no nodes"):
        read_trace(tmp_path / "empty.csv")


def test_write_then_read_round_trips(tmp_path):
    trace = parse_trace(["0,add,a", "0,add,b", "1500,remove,a"], "x")
    write_trace(trace, tmp_path / "t.csv")
    assert read_trace(tmp_path / "t.csv").events == trace.events


def test_scale_trace_keeps_times_and_scales_the_peak():
    trace = read_trace(bundled_trace("p3"))
    scaled = scale_trace(trace, 48)
    assert abs(scaled.peak_nodes - 48) <= 48 * 0.1
    assert {e.ms for e in scaled.events} == {e.ms for e in trace.events}
    assert scaled.removals == pytest.approx(trace.removals * 48 / trace.peak_nodes, rel=0.1)
    assert scale_trace(trace, trace.peak_nodes).events == trace.events


def test_live_at():
    trace = parse_trace(["0,add,a", "0,add,b", "1000,remove,a", "2000,add,c"], "x")
    assert trace.live_at(0.5) == {"a", "b"} and trace.live_at(1.0) == {"b"} and trace.live_at(9) == {"b", "c"}


# ---- parameters


def test_bundled_parameters_have_a_kind_and_a_source_for_every_field():
    data = json.loads(DEFAULT_PATH.read_text())["params"]
    assert set(data) == set(SimParams().as_dict())
    for key, entry in data.items():
        assert entry["kind"] in KINDS and entry["kind"] != "override", key
        assert entry["source"].strip(), key
        if entry["kind"] == "measured":  # a script of this repository and the commit it ran at
            assert "benchmarks/" in entry["source"] and "commit" in entry["source"], key
        if entry["kind"] == "assumption":
            assert "not measured" in entry["source"], key
        if entry["kind"] == "released-code":
            assert "uclasystem/bamboo" in entry["source"] and "commit" in entry["source"], key
    # benchmarks overwrite values in this file, so only its shape is fixed: every value loads
    loaded = load_params()
    assert {k: getattr(loaded, k) for k in data} == {k: v["value"] for k, v in data.items()}
    assert set(provenance()) == set(data)


@pytest.mark.parametrize("key", ["spot_price", "on_demand_price"])
@pytest.mark.parametrize("value", [0, -0.5])
def test_prices_must_be_positive(key, value):
    with pytest.raises(ParamError) as info:
        load_params(overrides={key: value})
    msg = str(info.value)
    assert key in msg and "> 0" in msg and str(value) in msg and "dollars per node-hour" in msg


def test_overrides_from_the_command_line_and_python():
    o = parse_overrides(["spot_price=0.5", "stages=6"])
    assert o == {"spot_price": 0.5, "stages": 6} and isinstance(o["stages"], int)
    p = load_params(overrides=o)
    assert p.spot_price == 0.5 and p.stages == 6
    assert p.replace(step_seconds=2).step_seconds == 2.0
    with pytest.raises(ParamError, match="unknown simulator parameter"):
        parse_overrides(["spot_prize=1"])
    with pytest.raises(ParamError, match="KEY=VALUE"):
        parse_overrides(["spot_price"])
    with pytest.raises(ParamError, match="whole number"):
        parse_overrides(["stages=2.5"])
    with pytest.raises(ParamError, match="needs a number"):
        parse_overrides(["stages=many"])
    with pytest.raises(ParamError, match="min_stages <= stages <= layers"):
        SimParams(stages=4, layers=2)


def test_record_measurement_replaces_one_value_with_its_provenance(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(DEFAULT_PATH.read_text())
    record_measurement("failover_seconds", 1.25, "benchmarks/preemption.py, 4 CPU nodes, 2026-11-21", path)
    assert load_params(path).failover_seconds == 1.25
    assert provenance(path)["failover_seconds"].startswith("benchmarks/preemption.py")
    entry = json.loads(path.read_text())["params"]["failover_seconds"]
    assert entry["kind"] == "measured" and "(commit " in entry["source"]  # the commit it ran at
    with pytest.raises(ParamError, match="needs a provenance"):
        record_measurement("failover_seconds", 1.0, " ", path)
    with pytest.raises(ParamError, match="must be > 0"):
        record_measurement("spot_price", 0.0, "x", path)


def test_auto_on_demand_size_and_young_interval():
    trace = parse_trace(["0,add,a", "0,add,b", "0,add,c", "3600000,remove,a", "7200000,remove,b"], "x")
    params = SimParams(stages=2, min_stages=1, layers=2, checkpoint_save_seconds=20.0, step_pipelines=1)
    assert on_demand_nodes(trace, params) == 2  # peak 3 rounded down to whole pipelines of 2
    # two removals in 7200 s: MTBF 3600 s; sqrt(2 * 20 * 3600) = 379.47 s
    assert checkpoint_interval(trace, 7200.0, params) == pytest.approx((2 * 20 * 3600) ** 0.5)


def test_a_trace_of_zero_length_needs_hours():
    trace = parse_trace(["0,add,a"], "x")
    with pytest.raises(ParamError, match="hours"):
        prepare(trace, SimParams())
    assert prepare(trace, SimParams(hours=1.0))[1] == 3600.0


# ---- synthetic traces


def test_generated_traces_are_reproducible_and_follow_the_model():
    model = SpotModel(nodes=20, hours=50.0, preemption_rate=0.5, replacement_delay_seconds=60.0, seed=3)
    a, b = generate_trace(model), generate_trace(model)
    assert a.events == b.events
    assert a.peak_nodes == 20
    # ~ nodes * rate * hours removals (the cluster stays near full with fast replacement)
    expected = 20 * 0.5 * 50.0
    assert 0.8 * expected < a.removals < 1.2 * expected
    assert generate_trace(SpotModel(nodes=20, hours=50.0, preemption_rate=0.5, seed=4)).events != a.events


def test_generated_bursts_and_notices():
    t = generate_trace(
        SpotModel(
            nodes=30,
            hours=10.0,
            preemption_rate=0.5,
            burst=5,
            burst_probability=1.0,
            notice_fraction=1.0,
            notice_seconds=30.0,
            seed=1,
        )
    )
    removes = [e for e in t.events if e.kind == "remove"]
    assert all(e.notice_seconds == 30.0 for e in removes)
    per_instant: dict[int, int] = {}
    for e in removes:
        per_instant[e.ms] = per_instant.get(e.ms, 0) + 1
    assert max(per_instant.values()) == 5


def test_spot_model_rejects_bad_values():
    with pytest.raises(BambooConfigError, match="preemption_rate > 0"):
        SpotModel(preemption_rate=0)


def test_simulating_a_generated_trace_gives_all_policies():
    trace = generate_trace(SpotModel(nodes=24, hours=4.0, preemption_rate=0.3, seed=0))
    report = simulate(trace, SimParams(hours=4.0))
    assert set(report.policies) == {"on_demand", "checkpoint", "bamboo"}
    for r in report.policies.values():
        assert r.samples > 0 and r.cost_dollars > 0
    # the spot cluster costs less than the on-demand one of the same peak size
    assert report.policies["bamboo"].cost_dollars < report.policies["on_demand"].cost_dollars


def test_trace_objects_validate_in_memory_too():
    with pytest.raises(TraceError, match="notice_seconds"):
        TraceEvent(0, "add", "a", notice_seconds=5.0)
    with pytest.raises(TraceError, match="no nodes"):
        Trace((), "x")


def test_simulator_and_policy_import_no_heavy_framework():
    import ast
    from pathlib import Path

    import lightning_bamboo.sim as sim_package
    import lightning_bamboo.topology.policy as policy_module

    files = [Path(policy_module.__file__), *Path(sim_package.__file__).parent.glob("*.py")]
    assert len(files) >= 10
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & {"torch", "deepspeed", "lightning", "pytorch_lightning"}, (path.name, roots)


def test_inputs_name_their_source_and_mark_what_the_caller_changed():
    params = load_params(overrides={"restart_seconds": 123.0, "step_seconds": 2.5})
    inputs = describe_inputs(params, {"step_seconds": "published: paper X, Table 1, 2.5 s"})
    assert set(inputs) == set(SimParams().as_dict())
    assert inputs["restart_seconds"]["kind"] == "override" and "default is 60" in inputs["restart_seconds"]["source"]
    assert inputs["step_seconds"] == {"value": 2.5, "kind": "published", "source": "paper X, Table 1, 2.5 s"}
    assert inputs["spot_price"]["kind"] == "released-code" and inputs["spot_price"]["value"] == 0.91


def test_predicted_fraction_is_a_share():
    with pytest.raises(ParamError, match="predicted_fraction is a share of removals, at most 1"):
        load_params(overrides={"predicted_fraction": 1.5})
