"""The chaos harness (``benchmarks/chaos.py``, its schedules and judgements in ``lightning_bamboo.testing.chaos``): the
schedules, and one seeded run of the demo against a clean run."""

from __future__ import annotations

import collections
import json

import pytest

from lightning_bamboo.testing import chaos
from tests.helpers import PYTHON, REPO, run


def _replay(schedule: chaos.Schedule, nodes: int = chaos.NODES) -> tuple[int, int]:
    """Follow a schedule's events in step order: (fewest nodes ever alive, nodes named before they exist)."""
    events = [(int(j.split("@")[1]), 0, "join", j.split("@")[0]) for j in schedule.join]
    events += [(int(p.split("@")[1].split(":")[0]), 1, "kill", p.split("@")[0]) for p in schedule.preempt + schedule.freeze]
    events += [(at, 1, "kill", f.split("@")[0]) for f, at in zip(schedule.fail_at, schedule.fail_steps, strict=True)]
    alive, fewest, unknown = {f"node{i}" for i in range(nodes)}, nodes, 0
    for _, _, kind, node in sorted(events):
        if kind == "join":
            alive.add(node)
        else:
            unknown += node not in alive
            alive.discard(node)
        fewest = min(fewest, len(alive))
    return fewest, unknown


@pytest.mark.parametrize("seed", range(20))
def test_schedules_are_seeded_reach_their_changes_and_never_empty_the_cluster(seed):
    schedule = chaos.make_schedule(seed, 30)
    assert schedule == chaos.make_schedule(seed, 30)  # the seed alone decides it
    assert schedule.changes >= 30
    assert (len(schedule.preempt) + len(schedule.freeze) + len(schedule.fail_at) + len(schedule.join)
            + schedule.kinds["kill_after_join"]) >= 30
    fewest, unknown = _replay(schedule)
    assert fewest >= 1 and unknown == 0
    assert schedule.steps > max(int(j.split("@")[1]) for j in schedule.join)


def test_every_kind_of_change_is_drawn_over_ten_seeds():
    kinds = set()
    for seed in range(10):
        kinds |= set(chaos.make_schedule(seed, 30).kinds)
    assert kinds >= {"kill", "notice", "freeze", "join", "kill_after_join", "two_non_neighbours", "node_and_holder",
                     "kill_after_restart", *chaos.INSIDE}
    assert "etcd_restart" not in kinds  # the embedded store cannot be restarted
    assert "etcd_restart" in set().union(*(chaos.make_schedule(seed, 30, etcd=True).kinds for seed in range(10)))


#: the demo model's global gradient norm stays below 1 (0.47-0.86 over 95 steps, measured in one process), so
#: chaos.py's default clip of 1.0 never acts (a 26-step clean run ends bit-equal with and without it); 0.5 does
BF16_CLIPPED = ["--precision", "bf16", "--clip", "0.5"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("numerics", [BF16_CLIPPED], ids=["bf16_clip0.5"])
def test_a_seeded_chaos_run_ends_with_the_clean_runs_weights_optimizer_state_and_samples(tmp_path, numerics):
    """Seed 71, 13 changes on a real etcd server: a notice, joins, a frozen node (SIGSTOP), a node and its replica
    holder at once (a restart from the checkpoint, then a kill right after it), a node killed inside a live
    reconfiguration (a restart too), and the etcd server killed and started again twice, with the replica audit
    on and dropout in every layer: the weights and every AdamW state tensor equal the clean run's, every step trained on the clean run's
    samples, and every step finished. Recovery times are the benchmark's to judge (``benchmarks/chaos.py``
    without ``--no-bounds``): this test checks exactness, order and exit status, which a loaded machine must keep
    however late it recovers. In bf16 with fp32 master weights and clipping by the global norm (the clean run
    too): every mechanism of an fp32 run (replicas, failover, restarts, admission, the audit) and the precision
    path on top, still bit-exact against the clean run. The same schedules in fp32 are the benchmark's
    (``chaos.txt``: 10 seeds, 300 changes), and every demo test is an fp32 run against its clean run."""
    proc = run([PYTHON, str(REPO / "benchmarks" / "chaos.py"), "--seeds", "1", "--first-seed", "71", "--changes", "10",
                "--no-bounds", "--json", "--keep", str(tmp_path), *numerics], timeout=400)
    rows = [json.loads(line)["chaos_run"] for line in proc.stdout.splitlines() if line.startswith('{"chaos_run"')]
    assert proc.returncode == 0, proc.stdout[-4000:]
    (row,) = rows
    kinds = row["kinds"]
    assert row["changes"] >= 10 and kinds["node_and_holder"] == kinds["freeze"] == kinds["in_reconfiguration"] == 1
    assert len(row["etcd_restarts"]) == 2 and proc.stdout.count("etcd restarted at step") == 2
    assert row["exit_code"] == 0 and row["steps_completed"] == row["target_steps"]
    assert row["weights_difference"] == 0.0 and row["optimizer_difference"] == 0.0 and row["sample_problems"] == 0
    precision, clip = ("bf16", 0.5) if numerics else ("32", 0.0)
    assert (row["precision"], row["clip"]) == (precision, clip)
    assert f"precision {precision}, gradient clipping {clip:g}," in proc.stdout
    assert row["recoveries"]["redundant"] >= 1 and row["recoveries"]["checkpoint"] >= 1
    fired = tmp_path / "seed-71" / "fired"  # the kill inside the reconfiguration happened, once
    assert fired.is_dir() and [p.name for p in fired.iterdir()] == ["node2@reconfigure"]
    events = json.loads((tmp_path / "seed-71" / "report.json").read_text())["events"]
    assert any("frozen (SIGSTOP, never continued)" in event for event in events), events
    assert "dropout 0.1" in proc.stdout and "runs with a mismatch, short or over a bound 0" in proc.stdout


def test_several_pipeline_schedules_lose_and_add_whole_machines():
    """With 2 pipelines a machine is 2 nodes in a row of the demo's order (a node of each pipeline):
    they are killed at the same step, and replacement machines join whole."""
    kinds = collections.Counter()
    for seed in range(10):
        schedule = chaos.make_schedule(seed, 30, nodes=6, pipelines=2)
        kinds.update(schedule.kinds)
        kills_by_step = collections.Counter(int(p.split("@")[1].split(":")[0]) for p in schedule.preempt)
        if schedule.kinds["machine"]:
            assert max(kills_by_step.values()) >= 2  # a machine's nodes go at the same step
        joins_by_step = collections.Counter(int(j.split("@")[1]) for j in schedule.join)
        if schedule.kinds["machine_join"]:
            assert max(joins_by_step.values()) >= 2
        fewest, unknown = _replay(schedule, nodes=6)
        assert fewest >= 1 and unknown == 0
    assert kinds["machine"] >= 5 and kinds["machine_join"] >= 5
    assert "machine" not in set().union(*(chaos.make_schedule(seed, 30).kinds for seed in range(10)))


@pytest.mark.timeout(600)
def test_a_several_pipeline_chaos_run_stays_within_its_measured_noise_floor(tmp_path):
    """Seed 2 on 2 pipelines of 3 stages: a whole machine (a node of each pipeline) killed, a node killed inside
    the failover, a replacement machine joining; the replica audit on. The weights stay within the noise floor
    measured in the same call (a clean run with one weight one ulp up, and on one pipeline), every step trained
    once on the clean run's samples, and the run exited 0."""
    proc = run([PYTHON, str(REPO / "benchmarks" / "chaos.py"), "--pipelines", "2", "--seeds", "1", "--first-seed", "2",
                "--changes", "6", "--store", "embedded", "--no-bounds", "--json", "--keep", str(tmp_path)], timeout=560)
    rows = [json.loads(line)["chaos_run"] for line in proc.stdout.splitlines() if line.startswith('{"chaos_run"')]
    assert proc.returncode == 0, proc.stdout[-4000:]
    (row,) = rows
    assert row["kinds"]["machine"] == 1 and row["kinds"]["machine_join"] == 1 and row["kinds"]["in_failover"] == 1
    assert row["exit_code"] == 0 and row["steps_completed"] == row["target_steps"]
    assert 0.0 < row["floor"] and row["weights_difference"] <= row["floor"] and row["sample_problems"] == 0
    assert "noise floor after" in proc.stdout
    # the joining nodes were admitted and trained (a join that is refused still ends within the floor)
    report = json.loads((tmp_path / "seed-2" / "report.json").read_text())
    assert any(node.startswith("spare") for change in report["reconfigurations"] for node in change["order"]), report


@pytest.mark.timeout(120)
def test_the_demo_controller_waits_for_a_restarting_etcd():
    """The controller's store client tries again while etcd is down (killed, started again 2 s later on its data),
    where a plain client's call fails after its timeout."""
    import threading

    from lightning_bamboo.demo.controller import PatientStore
    from lightning_bamboo.membership import connect
    from lightning_bamboo.membership.protocol import StoreUnavailableError
    from lightning_bamboo.testing.etcd_server import EtcdServer

    with EtcdServer() as etcd:
        client = connect(etcd.url)
        try:
            client.put("/chaos/k", "v")
            etcd.kill()
            with pytest.raises(StoreUnavailableError):
                client.get("/chaos/k", timeout=0.5)
            restart = threading.Timer(2.0, etcd.start)
            restart.start()
            try:
                assert PatientStore(client, 60.0).get("/chaos/k", timeout=0.5).value == "v"
            finally:
                restart.join()
        finally:
            client.close()
