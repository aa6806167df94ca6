"""``lightning-bamboo plan``, called through ``run`` (the lead wires it into the console script)."""

from __future__ import annotations

import argparse
import itertools
import json

from lightning_bamboo.planner import cli
from lightning_bamboo.topology.layout import DEFAULT_REDUNDANCY


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--example", "gpt", "--repeats", "1", "--warmup", "0", "--micro-batch-sizes", "1,2", *argv])


def test_json_plan_has_the_contract_keys(capsys, tmp_path) -> None:
    saved = tmp_path / "profile.json"
    assert cli.run(parse("--world-size", "4", "--json", "--n-layer", "2", "--save-profile", str(saved))) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["stages"] * data["pipelines"] == 4
    assert data["partition"][0] == 0 and data["partition"][-1] == 4 and len(data["partition"]) == data["stages"] + 1
    assert data["micro_batch_size"] * data["micro_batches"] * data["pipelines"] == 32
    assert data["predicted_step_seconds"] > 0
    # the same profile read back gives the same plan
    assert cli.run(parse("--world-size", "4", "--json", "--profile", str(saved))) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["partition"] == data["partition"] and again["predicted_step_seconds"] == data["predicted_step_seconds"]


def test_table_lists_every_world_size(capsys, tmp_path) -> None:
    assert cli.run(parse("--world-size", "3", "--n-layer", "1")) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.strip() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "2", "3"]


def test_eager_plans_count_the_replicas_and_price_the_redundant_forwards(capsys, tmp_path) -> None:
    saved = tmp_path / "profile.json"
    assert cli.run(parse("--world-size", "4", "--n-layer", "2", "--save-profile", str(saved), "--redundancy", "eager")) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("workers"))
    assert "max MiB" in header and "no-rep MiB" in header and "+rc s" in header
    # 3 workers and a batch of 32: one pipeline of 3 stages, each holding its successor's stage besides its own;
    # a 3-stage pipeline's bubbles (about 2 micro-batches' forward and backward) hold a few of the successor's
    # 16 or 32 forwards (micro-batches of 2 or 1), not all
    assert cli.run(parse("--world-size", "3", "--json", "--profile", str(saved), "--redundancy", "eager")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["redundancy"] == "eager" and data["stages"] == 3 and data["micro_batches"] >= 16
    m = data["micro_batches"]
    forwards = data["redundant_forwards"]
    assert len(forwards) == 3 and all(0 <= f <= m for f in forwards) and max(forwards) > 0 and min(forwards) < m
    assert all(a > b for a, b in zip(data["stage_memory_bytes"], data["stage_memory_without_replica_bytes"], strict=True))
    assert cli.run(parse("--world-size", "3", "--json", "--profile", str(saved), "--redundancy", "off")) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["redundancy_seconds"] == 0 and off["stage_memory_bytes"] == off["stage_memory_without_replica_bytes"]


def test_auto_is_the_default_lazy_for_one_pipeline_and_off_for_several_unless_on_one_machine(capsys, tmp_path) -> None:
    """``lightning-bamboo plan`` defaults to the strategy's ``redundancy``; 'auto' is resolved for each layout: one
    pipeline is lazy (priced, its replicas counted), several are off, and lazy again with ``--one-machine``."""
    saved = tmp_path / "profile.json"
    assert parse("--world-size", "2").redundancy == DEFAULT_REDUNDANCY == "auto"
    assert cli.run(parse("--world-size", "4", "--n-layer", "2", "--save-profile", str(saved))) == 0
    capsys.readouterr()
    seen = set()
    for world, one_machine in itertools.product((2, 3, 4), (False, True)):
        extra = ("--one-machine",) if one_machine else ()
        assert cli.run(parse("--world-size", str(world), "--json", "--profile", str(saved), *extra)) == 0
        data = json.loads(capsys.readouterr().out)
        kept = data["stages"] > 1 and (data["pipelines"] == 1 or one_machine)
        assert data["redundancy"] == ("lazy" if kept else "off"), (world, one_machine, data)
        with_replica = data["stage_memory_bytes"] != data["stage_memory_without_replica_bytes"]
        assert with_replica == kept, (world, one_machine, data)
        seen.add(data["redundancy"])
    assert "lazy" in seen, "no layout of one pipeline was chosen: the test shows nothing of auto's replicas"


def test_memory_too_small_is_a_clear_error(capsys) -> None:
    # 0.6155 GiB: a quarter of a MiB beyond what a worker holds besides its layers (planner.memory.fixed_bytes)
    assert cli.run(parse("--world-size", "2", "--json", "--n-layer", "1", "--memory-gib", "0.6155")) == 2
    err = capsys.readouterr().err
    assert "MiB" in err and "limit" in err
    assert cli.run(parse("--world-size", "2", "--json", "--n-layer", "1", "--memory-gib", "0.5")) == 2
    assert "leaves nothing for the model: a worker holds 0.62 GiB besides its layers" in capsys.readouterr().err


def test_the_console_dispatcher_runs_it(capsys, monkeypatch) -> None:
    import lightning_bamboo.cli as top

    monkeypatch.setitem(top.COMMANDS, "plan", ("lightning_bamboo.planner.cli", "plan"))
    argv = ["plan", "--example", "gpt", "--world-size", "2", "--json", "--n-layer", "1", "--repeats", "1",
            "--warmup", "0", "--micro-batch-sizes", "1"]
    assert top.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["stages"] in (1, 2)


def test_activation_checkpointing_plans_with_less_memory_and_a_longer_step(capsys, tmp_path) -> None:
    saved = tmp_path / "profile.json"
    one = ("--world-size", "1", "--json", "--micro-batch-sizes", "2")
    assert cli.run(parse(*one, "--n-layer", "2", "--save-profile", str(saved))) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.run(parse(*one, "--profile", str(saved), "--activation-checkpointing", "1")) == 0
    checkpointed = json.loads(capsys.readouterr().out)
    assert (plain["activation_checkpointing"], checkpointed["activation_checkpointing"]) == (0, 1)
    assert max(checkpointed["stage_memory_bytes"]) < max(plain["stage_memory_bytes"])
    assert checkpointed["predicted_step_seconds"] > plain["predicted_step_seconds"]  # every forward runs again
