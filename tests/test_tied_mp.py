"""Tied weights through real failovers: a GPT-2-style model whose output head is its token embedding
(``TiedLayerSpec``s on the first and the last stage) ends bit-equal to the run without a kill when the first
stage's node is SIGKILLed (lazy: the last node takes stage 0 over from its replica) and when the last stage's is,
mid-step, in a 2-stage job (eager: one node then holds both copies and reuses its kept forward). Real processes
under the Bamboo launcher, every exit code checked."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.engine.comm_cuda import CHUNK_TAGS, LANES
from lightning_bamboo.engine.comm_process import TRACE_ENV
from lightning_bamboo.testing import faults
from tests.helpers import (
    PYTHON,
    REPO,
    launcher_exit_codes,
    max_abs_diff,
    optimizer_states,
    pairs_alike_in_nccls_lanes,
    run,
)

pytestmark = pytest.mark.timeout(300)

#: n_layer 1: [embedding, block, final norm, head tied to the embedding], one layer per stage on 4 nodes
MODEL = ["--tied", "--n-layer", "1", "--partition", "uniform", "--batch-size", "8", "--micro-batch-size", "2",
         "--optimizer", "adamw", "--steps", "8"]


def _job(out, nodes, mode, kill=None):
    command = [PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", str(nodes), "--", PYTHON,
               str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--devices", str(nodes), "--stages", str(nodes),
               *MODEL, "--redundancy", mode, "--out", str(out)]
    trace = out / "comm-trace"  # every process's sends and receives, for the check of NCCL's lanes
    trace.mkdir()
    proc = run(command, timeout=240, env={TRACE_ENV: str(trace), **(faults.environment([kill]) if kill else {})})
    assert proc.returncode == 0, proc.stdout[-4000:]
    victim = kill.split("@")[0] if kill else None
    assert launcher_exit_codes(proc.stdout) == {f"node{i}": (-9 if f"node{i}" == victim else 0) for i in range(nodes)}
    # (one host: the replica's gradients go through shared memory from the first step, no chunk travels; the chunks'
    # lane is checked with an owner on another host in test_gradient_exchange)
    pairs_alike_in_nccls_lanes(trace, set(LANES) - {CHUNK_TAGS})
    return [json.JSONDecoder().raw_decode(line)[0] for line in proc.stdout.splitlines()
            if line.startswith('{"global_step"')][-1]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    assert _job(out, 4, "lazy")["failovers"] == []
    return out


def _same_as(out, plain):
    assert max_abs_diff(torch.load(out / "final.pt"), torch.load(plain / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(out / "final.ckpt"), optimizer_states(plain / "final.ckpt")) == 0.0
    # the checkpoint keeps each copy (each layer has its file), equal; the consolidated weights hold it once
    saved = ckpt.read_layers(out / "final.ckpt", [0, 3])
    assert saved[0]["weights"].keys() == saved[3]["weights"].keys() == {"tok.weight", "pos.weight"}
    assert all(torch.equal(saved[0]["weights"][k], saved[3]["weights"][k]) for k in saved[0]["weights"])
    assert not any(k.startswith("3.") for k in torch.load(out / "final.pt"))


def test_the_first_stage_killed_its_copy_taken_over_by_the_last_node_ends_bit_exact(tmp_path, plain):
    summary = _job(tmp_path, 4, "lazy", kill="node0@5")
    (failover,) = summary["failovers"]
    # node3 runs stage 0 from its replica, node2 runs layers 2-3 (its own and node3's from its replica)
    assert failover["lost"] == ["node0"] and failover["order"] == ["node3", "node1", "node2"]
    assert failover["parts"] == [0, 1, 2, 4]
    _same_as(tmp_path, plain)


def test_the_last_stage_killed_mid_step_one_node_holding_both_copies_ends_bit_exact(tmp_path, plain):
    """Two stages, eager: node1 (layers 2-3) is lost mid-step; node0 then runs every layer, both copies of the tied
    module in one stage, and ends with the weights of the 4-stage run (the layout never changes the numbers)."""
    summary = _job(tmp_path, 2, "eager", kill="node1@5:6")
    (failover,) = summary["failovers"]
    assert failover["lost"] == ["node1"] and failover["order"] == ["node0"] and failover["redone"]
    _same_as(tmp_path, plain)


def _tied_rank(rank: int, port: int, out: str) -> None:
    """One holder of a tied copy (rank 0: layer 0, rank 1: layer 3) in a real 2-process gloo group, with pieces of
    5 elements: the gradients travel in several rounds, more than the window."""
    import torch.distributed as dist

    from lightning_bamboo.engine import ties
    from tests.test_ties import SEED, backward, build_layers, specs, stage

    ties.PIECE = 5
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    layers = build_layers(specs, SEED).layers
    backward(layers, seed=1)  # each copy's own uses (both ranks compute all, each keeps its own copy's)
    mine = 0 if rank == 0 else 3
    ties.reduce_tied_gradients(stage({mine: layers[mine]}), {"embed": (0, 3)}, rank_of_layer=lambda i: 0 if i == 0 else 1)
    torch.save([p.grad for p in layers[mine].parameters()], f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_tied_gradients_sent_in_pieces_between_two_processes_sum_as_in_one(tmp_path):
    from lightning_bamboo.membership.address import free_port
    from tests.helpers import process_context
    from tests.test_ties import SEED, backward, build_layers, specs

    context = process_context()
    port = free_port()
    procs = [context.Process(target=_tied_rank, args=(rank, port, str(tmp_path))) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(120)
        assert [proc.exitcode for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    layers = build_layers(specs, SEED).layers
    backward(layers, seed=1)
    expected = [_zero_if_none(a) + _zero_if_none(b) for a, b in zip(layers[0].parameters(), layers[3].parameters(),
                                                                     strict=True)]
    assert max(p.numel() for p in layers[0].parameters()) > 5 * 2  # more rounds than the window
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), rank


def _zero_if_none(param):
    return param.grad if param.grad is not None else torch.zeros_like(param)
