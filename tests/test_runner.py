"""``PipelineRunner`` driven without a Trainer: a step, a failover and a reconfiguration, exact.

No Lightning here nor in the node script (``tests/scripts/runner_node.py``): the runner is the
door any training loop can drive.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from lightning_bamboo.launcher import launch
from lightning_bamboo.launcher.forks import SHARED_ENV
from tests.helpers import PRELOAD, REPO, shared_fork_server

SCRIPT = REPO / "tests" / "scripts" / "runner_node.py"
STEPS = 6


def _run(out: Path, env: dict[str, str] | None = None, reconfigure_at: int = -1, device: str = "cpu",
         redundancy: str = "lazy") -> dict[str, int]:
    out.mkdir()
    command = [sys.executable, str(SCRIPT), str(out), str(STEPS), str(reconfigure_at), device, redundancy]
    if torch.cuda.is_available():  # each node its own interpreter (a preloaded one is refused where GPUs are)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return launch(command, 3, env={"PYTHONPATH": path, **(env or {})}, timeout=240)
    # the nodes are forks of the suite's shared server (it imported torch once), not three interpreters importing it
    shared = {SHARED_ENV: shared_fork_server(), "DS_ACCELERATOR": "cpu"}
    return launch(command, 3, env={**shared, **(env or {})}, preload=PRELOAD.split(","), timeout=240)


def _layers(out: Path) -> dict[int, dict]:
    layers: dict[int, dict] = {}
    for path in sorted(out.glob("*.pt")):
        layers.update(torch.load(path, weights_only=False))
    return layers


def _assert_same_weights(clean: Path, chaos: Path) -> None:
    """Every layer's weights and optimizer state of the run with a loss equal the clean run's, bit for bit."""
    want, got = _layers(clean), _layers(chaos)
    assert sorted(want) == sorted(got) == list(range(6))
    for layer in range(6):
        for name, tensor in want[layer]["weights"].items():
            assert torch.equal(got[layer]["weights"][name], tensor), f"layer {layer} {name}"
        for name, param in want[layer]["optimizer"].items():
            assert param["state"].keys() == got[layer]["optimizer"][name]["state"].keys()
            for key, value in param["state"].items():  # AdamW's step, exp_avg, exp_avg_sq
                assert torch.equal(torch.as_tensor(got[layer]["optimizer"][name]["state"][key]), torch.as_tensor(value)), (
                    f"layer {layer} {name} {key}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_runner_without_lightning_steps_fails_over_and_reconfigures_to_the_clean_runs_weights(tmp_path, device,
                                                                                               capfd):
    """Every layer has dropout: after the failover node1 runs node2's layers, and after the reconfiguration
    a layer moves, yet each draws the clean run's masks (``engine.layer_rng``). On ``cuda`` the three nodes
    share one GPU: stages, replicas and the redundant forward run there, the groups move GPU tensors through
    the abortable backend's host transport."""
    clean = _run(tmp_path / "clean", device=device)
    assert clean == {"node0": 0, "node1": 0, "node2": 0}
    # node2 SIGKILLs itself at the start of step 2; node1 serves its stage from the replica, then at
    # step 4 the two survivors re-split the six layers evenly (a layer moves, replicas are rebuilt)
    capfd.readouterr()
    codes = _run(tmp_path / "chaos", env={"BAMBOO_FAIL_AT": "node2@2", "BAMBOO_LOG_LEVEL": "INFO"}, reconfigure_at=4,
                 device=device)
    assert codes == {"node0": 0, "node1": 0, "node2": -9}
    # each node logs its predicted and measured memory once per stage it builds: at its first step, and at the first
    # step after the failover and after the reconfiguration (``runtime.memory``)
    logs = "".join(capfd.readouterr())
    for node in ("node0", "node1"):
        told = re.findall(rf"{node}: memory after (its first step[^:]*): predicted peak [\d.]+ GiB \(stage [\d.]+, "
                          r"replica [\d.]+, activations [\d.]+, buffers [\d.]+, communication process [\d.]+, baseline "
                          r"[\d.]+; the worker [\d.]+ GiB at its [\w -]+\), measured [\d.]+ GiB", logs)
        assert told == ["its first step"] + ["its first step since its stage was rebuilt"] * 2, logs[-3000:]
    reports = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "chaos").glob("*.json")}
    assert set(reports) == {"node0", "node1"}
    for report in reports.values():
        assert [(f["step"], f["lost"]) for f in report["failovers"]] == [(2, ["node2"])]
        assert report["parts"] == [0, 3, 6] and report["nodes"] == ["node0", "node1"]
        assert report["device"] == ("cuda:0" if device == "cuda" else "cpu")
        assert report["engines"] == 1  # the two replaced engines' weights and optimizer state went with them
    # the reconfiguration builds only the layers that arrive: layer 2 (node1 -> node0) in node0's stage and in
    # node1's replica (node1's old object of it served its stage, whose optimizer the framework may still touch: a
    # stage's objects never become a replica's); every other layer is the node's own object from before
    assert reports["node0"]["taken_over"] == {"stage": [0, 1], "replica": [3, 4, 5]}
    assert reports["node1"]["taken_over"] == {"stage": [3, 4, 5], "replica": [0, 1]}
    _assert_same_weights(tmp_path / "clean", tmp_path / "chaos")


@pytest.mark.timeout(300)
def test_eager_redundant_forwards_with_dropout_are_reused_after_a_kill_and_the_weights_stay_exact(tmp_path, capfd):
    """3 stages x 4 micro-batches, eager: node1 runs the redundant forwards of node2's stage for micro-batches 0
    and 1 at schedule step 4 of step 2; node2 is SIGKILLed at schedule step 8. The redone step recomputes node1's
    own layers to the same inputs (same dropout masks), so both kept forwards are reused, their dropout masks
    being node2's; the weights equal the clean run's bit for bit."""
    clean = _run(tmp_path / "clean", redundancy="eager")
    assert clean == {"node0": 0, "node1": 0, "node2": 0}
    capfd.readouterr()
    codes = _run(tmp_path / "chaos", env={"BAMBOO_FAIL_AT": "node2@2:8"}, redundancy="eager")
    assert codes == {"node0": 0, "node1": 0, "node2": -9}
    logs = "".join(capfd.readouterr())
    assert "node1: the redone step reused 2 of 2 kept redundant forwards (micro-batches [0, 1])" in logs, logs[-3000:]
    _assert_same_weights(tmp_path / "clean", tmp_path / "chaos")
