"""Each process materialises only its layers, through a failover: a 4-stage job whose model is ``LayerSpec``s builds,
on every node, exactly its stage and its replica at start and, after a SIGKILL, exactly the layers that arrive (those
of its new stage and replica it did not hold: the ones it held are taken over as they are), and
ends bit-equal to the same job without the kill and within rounding of one process training the whole model built
under the same contract (real processes under the Bamboo launcher, every exit code checked)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_bamboo.engine.comm_cuda import CHUNK_TAGS, LANES, TIE_TAG
from lightning_bamboo.engine.comm_process import TRACE_ENV
from lightning_bamboo.testing import faults
from tests import helpers
from tests.helpers import PYTHON, REPO, launcher_exit_codes, max_abs_diff, optimizer_states, run

pytestmark = pytest.mark.timeout(300)

STEPS = 8
JOB = [PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON,
       str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--devices", "4", "--stages", "4", "--partition", "uniform",
       "--batch-size", "8", "--micro-batch-size", "2", "--steps", str(STEPS),
       "--layer-specs"]


def _job(out, mode="lazy", kill=None):
    trace = out / "comm-trace"  # every process's sends and receives, for the check of NCCL's lanes
    trace.mkdir()
    proc = run([*JOB, "--redundancy", mode, "--out", str(out)], timeout=240,
               env={TRACE_ENV: str(trace), **(faults.environment([kill]) if kill else {})})
    assert proc.returncode == 0, proc.stdout[-4000:]
    # (no tied weights here; one host: the replica's gradients go through shared memory, no chunk travels)
    helpers.pairs_alike_in_nccls_lanes(trace, set(LANES) - {TIE_TAG, CHUNK_TAGS})
    victim = kill.split("@")[0] if kill else None
    assert launcher_exit_codes(proc.stdout) == {f"node{i}": (-9 if f"node{i}" == victim else 0) for i in range(4)}
    builds: dict[str, list[int]] = {}
    census: dict[str, list[int]] = {}
    for found in re.finditer(r'\{"built": \d+, "node": "\w+", "meta": (?:true|false)\}', proc.stdout):
        record = json.loads(found.group())  # the nodes' lines may interleave in the launcher's output
        (census if record["meta"] else builds).setdefault(record["node"], []).append(record["built"])
    return builds, census


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    builds, census = _job(out)
    # uniform over 4 layers: node k holds layer k and the replica of its successor's, layer k + 1
    assert builds == {f"node{k}": [k, (k + 1) % 4] for k in range(4)}
    # the partition's parameter counts: every layer once per process, on the meta device, never materialised
    assert census == {f"node{k}": [0, 1, 2, 3] for k in range(4)}
    return out


def test_the_whole_model_build_equals_the_layer_wise_one(plain):
    reference = helpers.reference_weights(STEPS, 8, 1, 2, layer_specs=True)
    assert max_abs_diff(torch.load(plain / "final.pt"), reference) <= 1e-5
    assert max_abs_diff(helpers.reference_weights(0, 8, 1, 2, layer_specs=True),
                        helpers.reference_weights(0, 8, 1, 2)) > 0  # the contract is not the sequential one


@pytest.mark.parametrize("mode, kill, rebuilt", [
    # lazy, node2 lost: node1 serves layers 1-2 (its own layer 1 and its replica's layer 2, neither built again) with
    # the replica of node3's layer 3 (built: it arrives); node0's replica is now of 1-2 (it holds 1 already: only 2
    # arrives); node3 keeps layer 3 and the replica of layer 0 as they are
    ("lazy", "node2@5", {"node0": [2], "node1": [3], "node3": []}),
    # eager, node1 lost mid-step: node0 serves layers 0-1, taking layer 1 over from its replica, with the replica of
    # node2's layer 2 (built); node2 keeps its stage and replica; node3's replica is now of 0-1 (only 1 arrives)
    ("eager", "node1@5:6", {"node0": [2], "node2": [], "node3": [1]}),
], ids=["lazy", "eager-mid-step"])
def test_a_failover_builds_only_the_layers_that_arrive_and_ends_bit_exact(tmp_path, plain, mode, kill, rebuilt):
    builds, _ = _job(tmp_path, mode, kill)
    victim = kill.split("@")[0]
    after = {node: got[2:] for node, got in builds.items() if node != victim}  # each node's first two: stage, replica
    assert after == rebuilt, builds
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), torch.load(plain / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(tmp_path / "final.ckpt"), optimizer_states(plain / "final.ckpt")) == 0.0


def test_a_node_out_of_memory_in_a_failover_ends_with_the_fix_and_the_others_finish_bit_exact(tmp_path, plain):
    """node1 SIGKILLed at step 3; node3 then runs out of memory rebuilding its stage in that failover (a CUDA
    out-of-memory error injected there: this machine has no GPU to fill). node3 ends with ``OutOfDeviceMemory``,
    which names what did not fit and the fixes, and exits 1; node0 and node2 count it lost in the same failover, run
    the four layers between them and end with the weights and optimizer state of the run without a loss. The
    launcher exits 1: a node failed with an error. Nothing waits on the node that raised."""
    proc = run([*JOB, "--redundancy", "lazy", "--out", str(tmp_path)], timeout=240,
               env=faults.environment(["node1@3", "node3@failover!oom"]))
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {"node0": 0, "node1": -9, "node2": 0, "node3": 1}
    assert re.search(r"OutOfDeviceMemory: node3's stage and replica after the failover of step 3 \(parts .*\) did not "
                     r"fit in the memory of cpu\. Fix: replica_placement=\"host\"", proc.stdout), proc.stdout[-4000:]
    summary = [json.JSONDecoder().raw_decode(line)[0] for line in proc.stdout.splitlines()
               if line.startswith('{"global_step"')][-1]
    (failover,) = summary["failovers"]
    assert failover["lost"] == ["node1", "node3"] and failover["order"] == ["node0", "node2"]
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), torch.load(plain / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(tmp_path / "final.ckpt"), optimizer_states(plain / "final.ckpt")) == 0.0


def test_a_node_that_raises_mid_step_is_counted_lost_and_the_others_finish_bit_exact(tmp_path, plain):
    """node2 raises (an out-of-memory error, injected after 3 schedule steps of step 4) in the middle of a step, its
    sends and receives in flight: it exits 1, the others fail over without it, nothing waits on it, and the run ends
    with the weights of the run without a loss."""
    proc = run([*JOB, "--redundancy", "lazy", "--out", str(tmp_path)], timeout=240,
               env=faults.environment(["node2@4:3!oom"]))
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {"node0": 0, "node1": 0, "node2": 1, "node3": 0}
    assert "torch.OutOfMemoryError: CUDA out of memory (injected" in proc.stdout
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), torch.load(plain / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(tmp_path / "final.ckpt"), optimizer_states(plain / "final.ckpt")) == 0.0
