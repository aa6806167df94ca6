"""``lightning-bamboo simulate`` end to end: report JSON contract, table, plot, errors, demo hook."""

from __future__ import annotations

import argparse
import json

import pytest

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.sim import cli
from lightning_bamboo.sim.params import SimParams
from lightning_bamboo.sim.report import compare_with_demo
from lightning_bamboo.sim.simulate import run_policy
from lightning_bamboo.sim.trace import parse_trace

TOY_TRACE = "0,add,n1\n0,add,n2\n0,add,n3\n0,add,n4\n100000,remove,n2\n200000,add,n5\n"
TOY_PARAMS = [
    "stages=2",
    "min_stages=1",
    "layers=2",
    "global_micro_batches=2",
    "step_pipelines=1",
    "node_ready_seconds=0",
    "hours=0.1",
]


def call(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_report_json_has_the_fixed_keys_and_a_plot(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(TOY_TRACE)
    argv = ["--trace", str(trace), "--report", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")]
    for p in TOY_PARAMS:
        argv += ["--param", p]
    assert call(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    # the fixed three, and the policies after Bamboo in the same table
    assert set(report["policies"]) == {"on_demand", "checkpoint", "bamboo", "recycle", "parcae"}
    for name, p in report["policies"].items():
        for key in ("samples_per_second", "cost_dollars", "samples_per_dollar", "hours", "recovery_hours"):
            assert isinstance(p[key], (int, float)), (name, key)
        assert p["hours"] == pytest.approx(0.1)
        assert p["timeline"][0]["hours"] == 0.0
    assert report["params"]["stages"] == 2
    # every input with its value and source (a fixed contract); the toy's values are overrides
    assert set(report["inputs"]) == set(SimParams().as_dict())
    for name, entry in report["inputs"].items():
        assert entry["value"] == report["params"][name] and entry["source"].strip(), name
    assert report["inputs"]["stages"]["kind"] == "override"
    assert report["inputs"]["spot_price"]["kind"] == "released-code"
    assert report["paper"] == {"bamboo_vs_checkpoint_throughput": 3.7, "bamboo_vs_on_demand_value": 2.4}
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    out = capsys.readouterr().out
    assert "bamboo" in out and "paper: 3.7x" in out and "paper: 2.4x" in out


def test_bundled_trace_by_name_and_scaling(capsys):
    assert (
        call(["--trace", "g4dn", "--nodes", "24", "--policies", "bamboo,checkpoint", "--param", "hours=1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "scaled" in out and "on_demand" not in out


def test_generated_trace_is_saved(tmp_path, capsys):
    path = tmp_path / "g.csv"
    argv = [
        "--generate",
        "--spot",
        "nodes=24",
        "--spot",
        "hours=2",
        "--spot",
        "seed=5",
        "--save-trace",
        str(path),
    ]
    assert call(argv) == 0
    assert path.read_text().startswith("0,add,node1\n")
    assert "2.00 h" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--trace", "{bad}"], ["line 2", "expected milliseconds,add|remove,nodeNAME"]),
        (["--trace", "{good}", "--param", "spot_price=0"], ["spot_price must be > 0"]),
        (["--trace", "{good}", "--param", "on_demand_price=-1"], ["on_demand_price must be > 0"]),
        (["--trace", "{empty}"], ["no nodes"]),
        ([], ["needs --trace"]),
        (["--trace", "{good}", "--policies", "bamboo,magic"], ["unknown policies ['magic']"]),
        (["--generate", "--spot", "colour=3"], ["--spot needs KEY=VALUE"]),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, argv, words):
    files = {"bad": "0,add,n1\n5,oops\n", "good": TOY_TRACE, "empty": "\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.csv").write_text(text)
    argv = [a.format(**{k: str(tmp_path / f"{k}.csv") for k in files}) for a in argv]
    assert call(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_compare_with_demo_hook():
    params = SimParams(
        stages=2,
        min_stages=1,
        layers=2,
        global_micro_batches=2,
        step_pipelines=1,
        node_ready_seconds=0.0,
        hours=0.1,
    )
    predicted, _ = run_policy("bamboo", parse_trace(TOY_TRACE.splitlines(), "t"), params, 360.0)
    steps = predicted.steps_completed
    total = sum(predicted.recoveries.values())
    good = {"steps_completed": steps * 1.1, "recoveries": {"redundant": total, "checkpoint": 0, "restart": 0}}
    v = compare_with_demo(good, predicted)
    assert v.ok and v.steps_error == pytest.approx(abs(steps - 1.1 * steps) / (1.1 * steps))
    bad = {"steps_completed": steps * 2, "recoveries": {"redundant": total}}
    assert not compare_with_demo(bad, predicted).ok
    with pytest.raises(BambooConfigError, match="lacks"):
        compare_with_demo({"steps": 3}, predicted)


def test_bamboo_paper_scenario_prints_both_ratios_beside_the_papers_and_cites_every_input(tmp_path, capsys):
    from lightning_bamboo.sim.params import KINDS
    from lightning_bamboo.sim.scenarios import BAMBOO_PAPER

    path = tmp_path / "r.json"
    argv = ["--scenario", "bamboo-paper", "--param", "hours=2", "--report", str(path)]
    assert call(argv) == 0
    out = capsys.readouterr().out
    assert "bamboo_vs_checkpoint_throughput: ours" in out and "published 3.7x" in out
    assert "bamboo_vs_on_demand_value: ours" in out and "published 2.4x" in out
    inputs = json.loads(path.read_text())["inputs"]
    for name, value in BAMBOO_PAPER.values.items():  # the scenario's values, each with its citation
        assert inputs[name]["value"] == value, name
        assert inputs[name]["kind"] in KINDS and inputs[name]["kind"] != "override", name
        if inputs[name]["kind"] == "released-code":
            assert "uclasystem/bamboo" in inputs[name]["source"] and "1057ba80" in inputs[name]["source"]
    assert inputs["step_seconds"]["value"] == 3.08 and inputs["stages"]["value"] == 8
    assert inputs["hours"]["kind"] == "override"  # --param on top of the scenario says so


def test_a_param_replaces_the_scenarios_value_and_its_source(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert call(["--scenario", "bamboo-paper", "--param", "hours=1", "--param", "stages=12",
                 "--param", "min_stages=6", "--report", str(path)]) == 0
    inputs = json.loads(path.read_text())["inputs"]
    assert inputs["stages"]["value"] == 12 and inputs["stages"]["kind"] == "choice"  # the bundled default's source
    assert inputs["min_stages"]["value"] == 6 and inputs["min_stages"]["kind"] == "assumption"


def test_unknown_scenario_exits_2_naming_the_known_ones(capsys):
    assert call(["--scenario", "bamboo-paperr"]) == 2
    err = capsys.readouterr().err
    assert "unknown scenario 'bamboo-paperr'" in err and "bamboo-paper" in err


def test_sweep_writes_a_real_png_with_named_axes(tmp_path, capsys):
    import matplotlib.image

    from lightning_bamboo.sim.simulate import simulate
    from lightning_bamboo.sim.sweep import parse_sweep, plot_sweep, sweep

    trace = tmp_path / "t.csv"
    trace.write_text(TOY_TRACE)
    png = tmp_path / "sweep.png"
    argv = ["--trace", str(trace), "--sweep", "restart_seconds=0:100:3", "--plot", str(png)]
    for p in TOY_PARAMS:
        argv += ["--param", p]
    assert call(argv) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[0] == "restart_seconds" and [r.split()[0] for r in rows[1:4]] == ["0", "50", "100"]
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 300 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05  # not a blank canvas
    # the same sweep in Python: the figure's axes carry the names, each line one point per value
    name, values = parse_sweep("restart_seconds=0:100:3")
    params = SimParams(**{**SimParams().as_dict(), **{k: float(v) for k, v in (p.split("=") for p in TOY_PARAMS)}})
    results = sweep(name, values, lambda n, v: simulate(parse_trace(TOY_TRACE.split(), "t"), params.replace(**{n: v})))
    fig = plot_sweep(name, results, tmp_path / "again.png")
    assert [ax.get_ylabel() for ax in fig.axes] == ["throughput (samples/s)", "value (samples/$)", "ratio",
                                                    "ETTR (of on-demand's samples)"]  # on-demand is among them
    assert fig.axes[-1].get_xlabel() == "restart_seconds" and fig.axes[-1].get_xscale() == "linear"
    assert all(len(line.get_xdata()) == 3 for line in fig.axes[0].get_lines())
    # a slower restart hurts checkpoint-restart (one loss at 100 s), not on-demand
    ck = [r.policies["checkpoint"].samples for _, r in results]
    od = [r.policies["on_demand"].samples for _, r in results]
    assert ck[0] > ck[1] > ck[2] and od[0] == od[2]


def test_sweep_of_a_synthetic_trace_field_and_bad_sweeps(tmp_path, capsys):
    argv = ["--generate", "--spot", "nodes=8", "--spot", "hours=1", "--sweep", "preemption_rate=0.1:1:2",
            "--param", "stages=4", "--param", "min_stages=2", "--param", "step_pipelines=2", "--param", "hours=1"]
    assert call(argv) == 0
    assert [r.split()[0] for r in capsys.readouterr().out.splitlines()[1:3]] == ["0.1", "1"]
    assert call(["--trace", "p3", "--sweep", "restart_seconds=1:2"]) == 2
    assert "PARAM=START:STOP:COUNT" in capsys.readouterr().err
    assert call(["--trace", "p3", "--sweep", "preemption_rate=0.1:1:2"]) == 2  # a --spot field needs --generate
    assert call(["--trace", "p3", "--sweep", "restart_seconds=1:2:1"]) == 2
    assert "COUNT must be at least 2" in capsys.readouterr().err


def test_mtbf_sweep_gives_each_policy_its_ettr_against_on_demand(tmp_path, capsys):
    import math

    from lightning_bamboo.sim.generate import SpotModel, generate_trace
    from lightning_bamboo.sim.sweep import mtbf_preemption_rate, parse_sweep

    # geometric spacing between the ends, units s/m/h, or a list
    name, values = parse_sweep("mtbf=5m:24h:3")
    assert name == "mtbf" and values[0] == 300 and values[2] == 86400
    assert math.isclose(values[1], math.sqrt(300 * 86400))
    assert parse_sweep("mtbf=1h,90,10m")[1] == [90, 600, 3600]
    # the rate gives the cluster, not each node, one failure per mtbf on average
    rate = mtbf_preemption_rate(600, 12)
    trace = generate_trace(SpotModel(nodes=12, hours=10, preemption_rate=rate, replacement_delay_seconds=60))
    removals = sum(e.kind == "remove" for e in trace.events)
    assert 0.8 * 60 <= removals <= 1.2 * 60, removals
    png = tmp_path / "ettr.png"
    argv = ["--sweep", "mtbf=5m,2h", "--spot", "nodes=12", "--spot", "hours=3", "--spot", "replacement_delay_seconds=60",
            "--param", "stages=4", "--param", "min_stages=2", "--param", "step_pipelines=3",
            "--policies", "checkpoint,bamboo", "--plot", str(png)]
    assert call(argv) == 0
    rows = capsys.readouterr().out.splitlines()
    header = rows[0].split()
    assert "on_demand" in header  # added: the reference of every ETTR
    ettr_cols = [i for i, h in enumerate(rows[0].split("  ")) if h.strip().startswith("ETTR")]
    assert rows[0].count("ETTR checkpoint") == 1 and rows[0].count("ETTR bamboo") == 1 and len(ettr_cols) == 2
    cells = {r.split()[0]: r.split() for r in rows[1:3]}
    assert set(cells) == {"5m", "2h"}
    # columns: value, 3 x /s, 3 x /$, ETTR checkpoint, ETTR bamboo, ratios
    ettr = {k: (float(v[7]), float(v[8])) for k, v in cells.items()}
    assert all(0 < x <= 1.0 for pair in ettr.values() for x in pair), ettr
    assert ettr["5m"][0] < ettr["2h"][0] and ettr["5m"][1] < ettr["2h"][1], ettr  # more failures, less progress
    assert ettr["5m"][1] > ettr["5m"][0], ettr  # failover beats a restart from a checkpoint when failures are frequent
    from lightning_bamboo.sim.simulate import simulate
    from lightning_bamboo.sim.sweep import plot_sweep

    params = SimParams(stages=4, min_stages=2, step_pipelines=3, hours=1)
    results = [(m, simulate(generate_trace(SpotModel(nodes=12, hours=1, preemption_rate=mtbf_preemption_rate(m, 12))),
                            params, ("on_demand", "bamboo"))) for m in (300.0, 3600.0)]
    fig = plot_sweep("mtbf", results, png)
    ax = fig.axes[-1]
    assert ax.get_ylabel().startswith("ETTR") and ax.get_xscale() == "log" and "minutes" in ax.get_xlabel()
    assert list(ax.get_lines()[0].get_xdata()) == [5.0, 60.0]


def test_mtbf_sweep_refuses_a_trace_and_bad_durations(capsys):
    assert call(["--trace", "p3", "--sweep", "mtbf=5m:1h:3"]) == 2
    assert "drop --trace" in capsys.readouterr().err
    # a scenario gives its inputs (its 8 stages of 48 layers, 3.08 s steps), not its trace
    assert call(["--scenario", "bamboo-paper", "--sweep", "mtbf=10m,1h", "--spot", "nodes=24", "--spot", "hours=2",
                 "--policies", "bamboo"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows[1:3]] == ["10m", "1h"] and "ETTR bamboo" in rows[0]
    assert call(["--sweep", "mtbf=5m:1h:3", "--spot", "preemption_rate=1"]) == 2
    assert "drop --spot preemption_rate" in capsys.readouterr().err
    assert call(["--sweep", "mtbf=0:1h:3"]) == 2
    assert "must be > 0" in capsys.readouterr().err
    assert call(["--sweep", "mtbf=5x:1h:3"]) == 2
    assert "not a duration" in capsys.readouterr().err
