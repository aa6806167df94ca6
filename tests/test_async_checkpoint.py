"""AsyncCheckpoint: crash safety, error reporting, retention, the interval rule, and exact resume into other layouts."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.callbacks import AsyncCheckpoint, AsyncCheckpointError
from lightning_bamboo.errors import BambooConfigError
from tests.helpers import PYTHON, REPO, callback_from_yaml, max_abs_diff, reference_weights, run
from tests.scripts.async_writer_kill import LAYERS, make_stage, shard

KILL = str(REPO / "tests" / "scripts" / "async_writer_kill.py")
FIT = str(REPO / "tests" / "scripts" / "fit_async.py")


# ---------------------------------------------------------------------- helpers
def _read_until(proc: subprocess.Popen, predicate, timeout: float) -> list[str]:
    """Lines of ``proc``'s stdout up to the first one that satisfies ``predicate`` (bounded wait)."""
    lines: list[str] = []
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if selector.select(timeout=max(0.0, deadline - time.monotonic())):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if predicate(lines[-1]):
                return lines
    raise AssertionError(f"the writer did not reach the expected point in {timeout} s; output: {lines}")


def _assert_equals_saved(path: Path, step: int, global_step: int | None = None) -> None:
    """Load ``path`` into a fresh stage and optimizer: weights and momentum equal those of ``make_stage(step)``."""
    expected_stage, expected_opt = make_stage(step)
    stage, optimizer = make_stage(0)
    optimizer.step()  # give the optimizer its state slots, as a trained one has
    meta = ckpt.read_meta(path)
    states = ckpt.read_layers(path, range(LAYERS))
    ckpt.load_weights(stage, states)
    ckpt.load_optimizer(stage, optimizer, states, meta["bamboo"]["param_groups"])
    for (name, a), b in zip(stage.state_dict().items(), expected_stage.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(stage.parameters(), expected_stage.parameters(), strict=True):
        assert torch.equal(optimizer.state[a]["momentum_buffer"], expected_opt.state[b]["momentum_buffer"])
    assert meta["global_step"] == (step if global_step is None else global_step)


# ---------------------------------------------------------------------- crash safety
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause", [True, False], ids=["killed-after-layer-1", "killed-while-writing"])
def test_sigkill_while_writing_leaves_previous_checkpoint(tmp_path, pause):
    """SIGKILL the writer in the middle of checkpoint 2 (keep_last=1): checkpoint 1 loads and equals what was saved."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([PYTHON, KILL, "--dir", str(tmp_path), *(["--pause"] if pause else [])], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        target = "layer-0001.pt" if pause else "layer-0000.pt"
        lines = _read_until(proc, lambda line: line.startswith("wrote") and line.endswith(target), timeout=90)
        assert "committed 1" in lines
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stdin.close()
    assert proc.returncode == -signal.SIGKILL
    latest = ckpt.latest_checkpoint(tmp_path)
    if pause or latest is None or latest.name != ckpt.step_name(2):
        # checkpoint 2 never got its manifest: checkpoint 1 is still there, complete, and was not pruned
        assert latest == tmp_path / ckpt.step_name(1)
        assert not (tmp_path / ckpt.step_name(2)).exists()
        _assert_equals_saved(latest, 1)
    else:  # the kill came after the commit: then checkpoint 2 is complete and is the one kept
        _assert_equals_saved(latest, 2)
    if pause:
        staging = ckpt.staging_dir(tmp_path / ckpt.step_name(2), "run1")
        assert (staging / "layer-0000.pt").exists() and not (staging / ckpt.META).exists()
    # the next run (another token) commits, removes the dead run's staging directory and prunes
    ckpt.persist(tmp_path / ckpt.step_name(3), shard(3), world_size=1, token="run2", timeout=10, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.step_name(3)]
    _assert_equals_saved(tmp_path / ckpt.step_name(3), 3)


def test_snapshot_reuses_the_buffers_of_a_written_shard():
    first = shard(1)
    second = ckpt.take_shard(0, *make_stage(2), range(LAYERS), writes_layers=True, reuse=first)
    expected = shard(2)
    for layer in range(LAYERS):
        for name, tensor in second.layers[layer]["weights"].items():
            assert tensor.data_ptr() == first.layers[layer]["weights"][name].data_ptr()
            assert torch.equal(tensor, expected.layers[layer]["weights"][name])
        for name, saved in second.layers[layer]["optimizer"].items():
            assert torch.equal(saved["state"]["momentum_buffer"], expected.layers[layer]["optimizer"][name]["state"]["momentum_buffer"])
            assert saved["state"]["momentum_buffer"].data_ptr() == first.layers[layer]["optimizer"][name]["state"]["momentum_buffer"].data_ptr()


def test_keep_last_keeps_the_newest_commits(tmp_path):
    for step in (1, 2, 3):
        ckpt.persist(tmp_path / ckpt.step_name(step), shard(step), world_size=1, token="t", timeout=10, keep_last=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == [ckpt.step_name(2), ckpt.step_name(3)]
    # fit(ckpt_path=<the callback's directory>) resumes from the latest complete checkpoint in it
    assert ckpt.resolve_checkpoint(tmp_path) == tmp_path / ckpt.step_name(3)
    assert ckpt.resolve_checkpoint(tmp_path / ckpt.step_name(2)) == tmp_path / ckpt.step_name(2)
    assert sorted(os.listdir(tmp_path)) == [ckpt.step_name(2), ckpt.step_name(3)]


def _substage(stage: torch.nn.Module, layers: range) -> torch.nn.Module:
    """The layers of one pipeline stage, named by global index (as the engine's stage module)."""
    sub = torch.nn.Module()
    for i in layers:
        sub.add_module(str(i), getattr(stage, str(i)))
    return sub


def test_commit_waits_for_every_process_marker(tmp_path):
    """Rank 0's worker commits only after rank 1's files are on disk; without them it fails, bounded, naming rank 1."""
    stage, optimizer = make_stage(1)
    meta = {"bamboo": ckpt.bamboo_meta(LAYERS, [0, 4, LAYERS], 1, optimizer, world_size=2)}
    rank0 = ckpt.take_shard(0, _substage(stage, range(0, 4)), optimizer, range(0, 4), writes_layers=True, meta=lambda: meta)
    rank1 = ckpt.take_shard(1, _substage(stage, range(4, LAYERS)), optimizer, range(4, LAYERS), writes_layers=True)
    path = tmp_path / ckpt.step_name(1)
    errors: list[BaseException] = []

    def rank0_worker() -> None:
        try:
            ckpt.persist(path, rank0, world_size=2, token="t", timeout=60)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    worker = threading.Thread(target=rank0_worker)
    worker.start()
    marker = ckpt.marker_file(ckpt.staging_dir(path, "t"), 0)
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists() and not path.exists(), "rank 0 must not commit before rank 1's marker"
    ckpt.persist(path, rank1, world_size=2, token="t", timeout=60)
    worker.join(timeout=30)
    assert not errors and not worker.is_alive()
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [f"layer-{i:04d}.pt" for i in range(LAYERS)] + ["meta.pt", "rng-00000.pt", "rng-00001.pt"])
    assert max_abs_diff(ckpt.consolidate_checkpoint(path), stage.state_dict()) == 0.0

    lonely = tmp_path / ckpt.step_name(2)
    with pytest.raises(ckpt.CheckpointError, match=r"processes \[1\] of 2 have not finished writing"):
        ckpt.persist(lonely, rank0, world_size=2, token="t", timeout=0.2)
    assert not lonely.exists() and ckpt.latest_checkpoint(tmp_path) == path


# ---------------------------------------------------------------------- the callback, with a stand-in trainer
def _fake_trainer(tmp_path: Path) -> SimpleNamespace:
    stage, optimizer = make_stage(1)
    trainer = SimpleNamespace(world_size=1, global_rank=0, global_step=0, default_root_dir=str(tmp_path))

    def checkpoint_shard(checkpoint, reuse=None):
        meta = {**checkpoint, "bamboo": ckpt.bamboo_meta(LAYERS, [0, LAYERS], 1, optimizer, world_size=1)}
        return ckpt.take_shard(0, stage, optimizer, range(LAYERS), writes_layers=True, meta=lambda: meta, reuse=reuse)

    trainer.strategy = SimpleNamespace(root_device=torch.device("cpu"), broadcast=lambda obj, src=0: obj,
                                       checkpoint_shard=checkpoint_shard)
    trainer._checkpoint_connector = SimpleNamespace(dump_checkpoint=lambda weights_only: {"global_step": trainer.global_step})
    return trainer


def _step(callback: AsyncCheckpoint, trainer: SimpleNamespace, module: SimpleNamespace) -> None:
    trainer.global_step += 1
    callback.on_train_batch_end(trainer, module, None, None, trainer.global_step - 1)


@pytest.mark.parametrize("reported_at", ["next save", "teardown"])
def test_failed_write_is_raised_at_next_save_or_teardown(tmp_path, reported_at):
    trainer, logged = _fake_trainer(tmp_path), {}
    module = SimpleNamespace(log=lambda name, value, **kw: logged.__setitem__(name, value))
    callback = AsyncCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=1, keep_last=5)
    callback.setup(trainer, module, "fit")
    callback.on_train_start(trainer, module)
    _step(callback, trainer, module)
    callback._wait()
    assert ckpt.latest_checkpoint(tmp_path / "ckpts") == tmp_path / "ckpts" / ckpt.step_name(1)
    # the stall logged is the one the save measured and recorded for step 1, with the interval it used
    (event,) = callback.events
    assert event["step"] == 1 and event["path"] == str(tmp_path / "ckpts" / ckpt.step_name(1))
    assert logged["async_checkpoint/stall_seconds"] == event["stall_seconds"] == callback.stall_seconds
    assert isinstance(callback.stall_seconds, float) and event["interval"] == 1
    assert logged["async_checkpoint/interval"] == 1.0
    # the directory becomes unwritable (here: a file in its place); the next write fails in the background
    os.rename(tmp_path / "ckpts", tmp_path / "moved")
    (tmp_path / "ckpts").write_text("not a directory")
    _step(callback, trainer, module)  # snapshot taken, the write fails on the worker
    if reported_at == "next save":
        with pytest.raises(AsyncCheckpointError, match=r"step-00000002 failed: (FileExistsError|NotADirectoryError)"):
            _step(callback, trainer, module)
    else:
        with pytest.raises(AsyncCheckpointError, match=r"step-00000002 failed") as raised:
            callback.teardown(trainer, module, "fit")
        assert isinstance(raised.value.__cause__, OSError)
    _assert_equals_saved(tmp_path / "moved" / ckpt.step_name(1), 1, global_step=1)


@pytest.mark.timeout(60)  # far below the commit timeout of 600 s: a commit that waited it out fails the test
def test_checkpoint_in_flight_is_abandoned_when_the_processes_change(tmp_path):
    """A failover between two saves: the commit that waits for a lost process is given up, not waited out."""
    trainer, module = _fake_trainer(tmp_path), SimpleNamespace(log=lambda *a, **k: None)
    trainer.world_size, trainer.strategy.layout = 2, "2 stages"  # rank 1 will never write its files
    callback = AsyncCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=1, commit_timeout=600)
    callback.setup(trainer, module, "fit")
    callback.on_train_start(trainer, module)
    _step(callback, trainer, module)
    trainer.world_size, trainer.strategy.layout = 1, "1 stage"  # the survivors' new pipeline
    _step(callback, trainer, module)  # no error: the abandoned checkpoint is not a failed write
    callback.on_train_end(trainer, module)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "ckpts")] == [ckpt.step_name(2)]
    assert sorted(os.listdir(tmp_path / "ckpts")) == [ckpt.step_name(2)]  # the abandoned staging directory is gone
    _assert_equals_saved(tmp_path / "ckpts" / ckpt.step_name(2), 1, global_step=2)


@pytest.mark.timeout(60)
def test_on_exception_waits_a_grace_period_then_abandons(tmp_path, monkeypatch):
    from lightning_bamboo.callbacks import async_checkpoint

    monkeypatch.setattr(async_checkpoint, "ON_EXCEPTION_GRACE_SECONDS", 0.2)
    trainer, module = _fake_trainer(tmp_path), SimpleNamespace(log=lambda *a, **k: None)
    trainer.world_size = 2  # rank 1 died with the failure: its files never come
    callback = AsyncCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=1, commit_timeout=600)
    callback.setup(trainer, module, "fit")
    callback.on_train_start(trainer, module)
    _step(callback, trainer, module)
    callback.on_exception(trainer, module, RuntimeError("peer lost"))  # returns: no 600 s wait, no second error
    callback.teardown(trainer, module, "fit")
    assert ckpt.complete_checkpoints(tmp_path / "ckpts") == []


def test_automatic_interval_is_measured_and_applied(tmp_path, monkeypatch):
    """1 s steps, 0.25 s snapshots, budget 1/16: the first checkpoint at first_auto_step, then every 4 steps."""
    from lightning_bamboo.callbacks import async_checkpoint

    clock, main = [0.0], threading.main_thread()
    # the training thread's clock advances by the test's steps; the writer's stands still (writes cost nothing)
    fake = SimpleNamespace(perf_counter=lambda: clock[0] if threading.current_thread() is main else 0.0)
    monkeypatch.setattr(async_checkpoint, "time", fake)
    trainer, module = _fake_trainer(tmp_path), SimpleNamespace(log=lambda *a, **k: None)
    take = trainer.strategy.checkpoint_shard

    def slow_snapshot(checkpoint, reuse=None):
        clock[0] += 0.25
        return take(checkpoint, reuse)

    trainer.strategy.checkpoint_shard = slow_snapshot
    callback = AsyncCheckpoint(dirpath=str(tmp_path / "ckpts"), overhead_budget=0.0625, first_auto_step=2, keep_last=1)
    callback.setup(trainer, module, "fit")
    callback.on_train_start(trainer, module)
    for _ in range(12):
        clock[0] += 1.0
        _step(callback, trainer, module)
    callback.on_train_end(trainer, module)
    assert [(e["step"], e["interval"]) for e in callback.events] == [(2, 2), (4, 4), (8, 4), (12, 4)]
    assert [e["stall_seconds"] for e in callback.events] == [0.25] * 4
    assert callback.state_dict()["interval"] == 4 and callback.step_seconds == 1.0


def test_automatic_interval_follows_the_overhead_budget():
    callback = AsyncCheckpoint(overhead_budget=0.035, first_auto_step=3)
    assert callback.proposed_interval() == 3  # nothing measured yet
    callback.step_seconds, callback.stall_seconds, callback.write_seconds = 1.0, 0.07, 0.5
    assert callback.proposed_interval() == 2  # 0.07 s per checkpoint is 3.5% of 2 steps
    callback.interference_seconds = 0.28  # steps were slowed while the worker wrote
    assert callback.proposed_interval() == 10  # (0.07 + 0.28) / (0.035 x 1 s)
    callback.write_seconds = 30.0
    assert callback.proposed_interval() == 30  # never snapshot while the previous write is still running
    restored = AsyncCheckpoint()
    restored.load_state_dict(callback.state_dict())
    assert restored.proposed_interval() == 30


@pytest.mark.parametrize("kwargs, message", [
    ({"every_n_train_steps": 0}, r"every_n_train_steps must be a positive integer, or None .* \(every_n_train_steps: 0\)"),
    ({"keep_last": 0}, r"keep_last must be a positive integer \(keep_last: 0\)"),
    ({"overhead_budget": 3.5}, r"between 0 and 1 exclusive \(overhead_budget: 3.5\); the default is 0.035"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(BambooConfigError, match=message):
        AsyncCheckpoint(**kwargs)


def test_configurable_from_cli_yaml():
    callback = callback_from_yaml(AsyncCheckpoint, "{dirpath: /ckpt, every_n_train_steps: 50, keep_last: 3, overhead_budget: 0.02}")
    assert isinstance(callback, AsyncCheckpoint)
    assert (callback.dirpath, callback.every_n_train_steps, callback.keep_last, callback.overhead_budget) == ("/ckpt", 50, 3, 0.02)


# ---------------------------------------------------------------------- exact resume (real processes)
STEPS, BATCH, MBS = 10, 8, 2


def _fit(out: Path, *args: str) -> dict:
    proc = run([PYTHON, FIT, "--out", str(out), "--steps", str(STEPS), "--micro-batch-size", str(MBS), *args], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    summary["output"] = proc.stdout
    return summary


@pytest.fixture(scope="module")
def four_stage_run(tmp_path_factory):
    """Uninterrupted: 4 stages, AsyncCheckpoint every 3 steps, keep_last=2."""
    out = tmp_path_factory.mktemp("four_stages")
    summary = _fit(out, "--devices", "4", "--stages", "4", "--batch-size", str(BATCH), "--partition", "uniform")
    return out, summary


def _optimizer_states(path: Path) -> dict[str, torch.Tensor]:
    layers = ckpt.read_layers(path, range(ckpt.read_meta(path)["bamboo"]["num_layers"]))
    return {f"{layer}.{name}": saved["state"]["momentum_buffer"]
            for layer, state in layers.items() for name, saved in state["optimizer"].items()}


@pytest.mark.timeout(300)
def test_four_stage_run_keeps_last_two_and_equals_single_process(four_stage_run):
    out, summary = four_stage_run
    assert [e["step"] for e in summary["events"]] == [3, 6, 9]
    assert sorted(os.listdir(out / "async")) == [ckpt.step_name(6), ckpt.step_name(9)]
    assert max_abs_diff(torch.load(out / "final.pt"), reference_weights(STEPS, BATCH, 1, MBS)) <= 1e-5
    assert ckpt.read_meta(out / "async" / ckpt.step_name(6))["bamboo"]["cursor"] == {"epoch": 0, "samples": 6 * BATCH, "global_batch": BATCH}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices, stages, batch, partition", [
    (4, 4, BATCH, "uniform"), (2, 2, BATCH, "parameters"), (4, 2, BATCH // 2, "0,1,4"),
], ids=["same-4-stages", "2-stages", "2x2"])
def test_resume_into_layout(four_stage_run, tmp_path, devices, stages, batch, partition):
    """fit(ckpt_path=step 6): loads weights and optimizer state exactly, then matches the uninterrupted run."""
    full, _ = four_stage_run
    saved = full / "async" / ckpt.step_name(6)
    resume_from = saved
    if stages == 2 and devices == 2:  # fit(ckpt_path=<a directory of checkpoints>) picks its latest one
        resume_from = tmp_path / "checkpoints"
        shutil.copytree(saved, resume_from / saved.name)
    summary = _fit(tmp_path, "--devices", str(devices), "--stages", str(stages), "--batch-size", str(batch),
                   "--partition", partition, "--resume", str(resume_from), "--dump-loaded")
    if devices != 4:  # other processes: their RNG streams cannot continue, and the run says so
        assert "random number generators are not restored" in summary["output"]
    assert summary["global_step"] == STEPS and [e["step"] for e in summary["events"]] == [9]
    # what was loaded, saved again from the new layout, is what was saved
    assert max_abs_diff(ckpt.consolidate_checkpoint(tmp_path / "loaded.ckpt"), ckpt.consolidate_checkpoint(saved)) == 0.0
    assert max_abs_diff(_optimizer_states(tmp_path / "loaded.ckpt"), _optimizer_states(saved)) == 0.0
    # training continues as if never interrupted
    tolerance = 0.0 if (devices, stages) == (4, 4) else 1e-5
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), torch.load(full / "final.pt")) <= tolerance
    assert max_abs_diff(_optimizer_states(tmp_path / "final.ckpt"), _optimizer_states(full / "final.ckpt")) <= tolerance
    if (devices, stages) == (4, 4):  # same processes: every RNG stream continues where it was saved
        for rank in range(devices):
            before = json.loads((full / f"draws-{rank}.json").read_text())
            after = json.loads((tmp_path / f"draws-{rank}.json").read_text())
            assert sorted(after, key=int) == ["6", "7", "8", "9"]
            assert all(after[k] == before[k] for k in after), f"rank {rank}: RNG states were not restored"
            assert after["6"] != before["0"], "a fresh process would draw this without the restore"
