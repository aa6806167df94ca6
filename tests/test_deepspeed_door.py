"""The DeepSpeed door with failover: ``examples/deepspeed_spot.py`` (DeepSpeed's pipeline example moved onto spot
machines with a few changed lines) under the Bamboo launcher, real SIGKILLs, every exit code checked."""

from __future__ import annotations

import difflib
import re
import shutil

import pytest
import torch

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo import consolidate_checkpoint
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.testing import faults
from tests.helpers import (
    PYTHON,
    REPO,
    launch_beside_a_standby_machine,
    launcher_exit_codes,
    max_abs_diff,
    optimizer_states,
    run,
)

pytestmark = pytest.mark.timeout(300)

PLAIN, SPOT = REPO / "examples" / "deepspeed_pipe.py", REPO / "examples" / "deepspeed_spot.py"
STEPS = 12


def _code(path):
    """The script's lines without its module docstring."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3:].splitlines()


def test_the_spot_example_differs_from_plain_deepspeed_in_a_few_lines():
    changed = [line for line in difflib.unified_diff(_code(PLAIN), _code(SPOT), lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(changed) <= 10, changed
    assert "-import deepspeed" in changed and "+import lightning_bamboo" in changed
    assert '+        "bamboo": {"redundancy": "lazy"},' in changed


def _train(out, script=SPOT, nodes=4, stages=4, kill=(), extra=()):
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", str(nodes), "--", PYTHON, str(script),
                "--steps", str(STEPS), "--stages", str(stages), "--save-dir", str(out), *extra], timeout=240,
               env=faults.environment(list(kill)) if kill else None)
    assert proc.returncode == 0, proc.stdout[-4000:]
    victims = {k.split("@")[0] for k in kill if not k.endswith("!term")}  # a notice leaves with 0
    codes = launcher_exit_codes(proc.stdout)
    assert {n: c for n, c in codes.items() if n not in victims} == {f"node{i}": 0 for i in range(nodes)
                                                                     if f"node{i}" not in victims}, codes
    assert all(codes[v] == -9 for v in victims), codes
    assert f"step {STEPS}: loss" in proc.stdout and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


def _final(out):
    meta = ckpt.read_meta(out / "final")
    return consolidate_checkpoint(out / "final"), optimizer_states(out / "final"), meta


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    _train(out, extra=("--save-every", "6"))
    return out


@pytest.mark.parametrize("mode, kill", [("lazy", "node2@5"), ("eager", "node1@5:6"), ("lazy", "node2@5:3!term"),
                                        ("auto", "node2@5")],
                         ids=["lazy", "eager-mid-step", "sigterm-notice", "auto-one-pipeline"])
def test_a_sigkilled_node_is_taken_over_and_the_run_ends_bit_exact(tmp_path, clean, mode, kill):
    """A SIGKILL is taken over from the replica and the step redone; a SIGTERM (a notice) mid-step lets the node
    finish the step and leave with exit 0, its stage served from the replica from the next step on. With one
    pipeline, ``"auto"`` keeps every replica (no stage has a copy elsewhere) and fails over as lazy does."""
    script = tmp_path / "spot.py"
    script.write_text(SPOT.read_text().replace('"redundancy": "lazy"', f'"redundancy": "{mode}"'))
    stdout = _train(tmp_path / "out", script=script, kill=[kill])
    node = kill.split("@")[0]
    if kill.endswith("!term"):
        assert f"{node}: leaving after a preemption notice" in stdout and f"lost ['{node}'] at step 6" in stdout
    else:
        assert f"lost ['{node}'] at step 5" in stdout
    weights, states, meta = _final(tmp_path / "out")
    clean_weights, clean_states, clean_meta = _final(clean)
    assert max_abs_diff(weights, clean_weights) == 0.0 and max_abs_diff(states, clean_states) == 0.0
    # every step drew the same 4 micro-batches from the data, none skipped or drawn twice by the redone step
    assert meta["data_position"] == clean_meta["data_position"] == STEPS * 4
    assert meta["bamboo"]["global_steps"] == STEPS


def test_a_bad_notices_entry_is_refused_with_the_known_sources():
    from lightning_bamboo.deepspeed_api import bamboo_options

    with pytest.raises(BambooConfigError, match=r"names \['ec2'\]; the known notice sources are \['aws', 'azure', 'gcp'\]"):
        bamboo_options({"bamboo": {"notices": ["ec2"]}})
    with pytest.raises(BambooConfigError, match="notice_interval"):
        bamboo_options({"bamboo": {"notices": ["aws"], "notice_interval": 0}})
    assert bamboo_options({"bamboo": {"notices": {"aws": "http://127.0.0.1:1"}}}).notices == {"aws": "http://127.0.0.1:1"}


def test_notices_outside_the_bamboo_launcher_are_refused(monkeypatch):
    """Without the launcher no one could take a leaving node's stage: refused before any process group forms."""
    from deepspeed.pipe import PipelineModule

    import lightning_bamboo
    from lightning_bamboo.membership.node import STORE_ENV

    monkeypatch.delenv(STORE_ENV, raising=False)
    # a PipelineModule's construction needs a process group; isinstance is all initialize asks before this rule
    module = PipelineModule.__new__(PipelineModule)
    with pytest.raises(BambooConfigError, match=r'"bamboo.notices" = \[\'aws\'\]: .* needs the Bamboo launcher'):
        lightning_bamboo.initialize(model=module, config={"train_micro_batch_size_per_gpu": 1,
                                                          "bamboo": {"notices": ["aws"]}})


def test_a_bad_rebalance_entry_is_refused_naming_the_rule():
    from lightning_bamboo.deepspeed_api import bamboo_options
    from lightning_bamboo.runtime.rebalance import from_config as rebalancer_from_config

    with pytest.raises(BambooConfigError, match=r'"bamboo" section: rebalance must be true, false or a dict'):
        bamboo_options({"bamboo": {"rebalance": "yes"}})
    with pytest.raises(BambooConfigError, match=r"unknown keys in rebalance: \['depth'\]; known keys"):
        bamboo_options({"bamboo": {"rebalance": {"depth": 4}}})
    with pytest.raises(BambooConfigError, match=r"Rebalancer\(stages=0\): the preferred depth must be >= 1"):
        bamboo_options({"bamboo": {"rebalance": {"stages": 0}}})
    rebalancer = rebalancer_from_config({"stages": 4, "admit": False, "max_overloaded_fraction": 0.2})
    assert (rebalancer.stages, rebalancer.admit, rebalancer.max_overloaded_fraction) == (4, False, 0.2)
    assert rebalancer_from_config(False) is None and rebalancer_from_config(True).stages is None


def test_rebalancing_outside_the_bamboo_launcher_is_refused(monkeypatch):
    from deepspeed.pipe import PipelineModule

    import lightning_bamboo
    from lightning_bamboo.membership.node import STORE_ENV

    monkeypatch.delenv(STORE_ENV, raising=False)
    module = PipelineModule.__new__(PipelineModule)
    with pytest.raises(BambooConfigError, match=r'"bamboo.rebalance" = True moves layers .* needs the Bamboo launcher'):
        lightning_bamboo.initialize(model=module, config={"train_micro_batch_size_per_gpu": 1,
                                                          "bamboo": {"rebalance": True}})


def test_load_checkpoint_then_a_kill_ends_bit_exact_in_another_layout(tmp_path, clean):
    """The clean run's checkpoint of step 6 (4 stages) loaded by ``engine.load_checkpoint`` on 3 nodes of 3 stages,
    node1 killed at step 9: the clean run's weights and optimizer state at step 12."""
    saved = tmp_path / "ckpt"
    shutil.copytree(clean / "global_step6", saved / "global_step6")
    (saved / "latest").write_text("global_step6")
    stdout = _train(saved, nodes=3, stages=3, kill=["node1@9"], extra=("--resume",))
    assert "lost ['node1'] at step 9" in stdout
    weights, states, meta = _final(saved)
    clean_weights, clean_states, _ = _final(clean)
    assert max_abs_diff(weights, clean_weights) == 0.0 and max_abs_diff(states, clean_states) == 0.0
    assert meta["data_position"] == STEPS * 4


def test_without_replicas_a_kill_restarts_in_place_and_a_loop_with_its_own_iterator_rewinds_it(tmp_path, clean):
    """``"redundancy": "off"``: every loss is fatal. node2 killed at step 8; node0, node1 and node3 restart in
    their processes as 3 stages from global_step6; ``train_batch(data_iter=it)`` raises ``JobRestarted`` once, and
    the loop rewinds its iterator to its ``data_position``: the clean run's weights at step 12, bit for bit."""
    stdout = _train(tmp_path / "out", script=REPO / "tests" / "scripts" / "door_own_iterator.py", kill=["node2@8"],
                    extra=("--save-every", "6"))
    assert stdout.count("rewound to micro-batch 24 at step 6") == 3, stdout[-3000:]
    assert len(re.findall(r"restarted after a fatal loss at step 8 \(.*\) from \S+global_step6, step 6, in [\d.]+ s: "
                          r"3 stage\(s\) x 1 pipeline\(s\) of node0,node1,node3", stdout)) == 3, stdout[-3000:]
    assert "restarts 1" in stdout
    weights, states, meta = _final(tmp_path / "out")
    clean_weights, clean_states, _ = _final(clean)
    assert max_abs_diff(weights, clean_weights) == 0.0 and max_abs_diff(states, clean_states) == 0.0
    assert meta["data_position"] == STEPS * 4


def test_two_pipelines_with_a_kill_end_within_float_rounding(tmp_path):
    """2 pipelines of 2 stages; node1 killed at step 5: the whole pipeline redoes the step with the global batch (8
    micro-batches a step throughout), the released node waits as a standby and leaves with the job."""
    _train(tmp_path / "clean", stages=2)
    stdout = _train(tmp_path / "kill", stages=2, kill=["node1@5"])
    assert "node3: the job finished before this standby node was needed" in stdout
    weights, _, meta = _final(tmp_path / "kill")
    clean_weights, _, clean_meta = _final(tmp_path / "clean")
    assert max_abs_diff(weights, clean_weights) <= 1e-6
    assert meta["data_position"] == clean_meta["data_position"] == STEPS * 8


@pytest.mark.parametrize("interrupted", [False, True], ids=["admitted", "admission-interrupted"])
def test_rebalancing_admits_a_standby_machine_after_a_kill_and_the_run_ends_bit_exact(tmp_path, clean, interrupted):
    """``"rebalance": true``: four nodes (a local launcher) and a fifth machine standing by (``--node node4 --join``,
    another launcher on the same store). node2 is killed at step 5; node1 serves its stage from the replica, and at
    the next step boundary the rebalancer admits node4 as the fourth stage: it builds its PipelineModule, gets its
    layers, the step, the data position and the optimizer state from the running nodes, and trains to the end.
    The weights and optimizer state end bit-equal to the clean run's, every step on the clean run's samples.

    ``admission-interrupted``: node0, which admits node4, is killed once the admission is published, while node4
    enters the new layout's process group. node1 and node3 restart the job without either (from step 0: nothing
    was saved); node4 stands by again in its process, and the next admission takes it in, into the layout of then.
    """

    script = tmp_path / "spot.py"
    script.write_text(SPOT.read_text().replace('"redundancy": "lazy"', '"redundancy": "lazy", "rebalance": True'))
    proc, standby = launch_beside_a_standby_machine(
        "door", 4, "node4", [PYTHON, str(script), "--steps", str(STEPS), "--stages", "4", "--save-dir", str(tmp_path / "out")],
        env=faults.environment(["node2@5", "node0@admit"] if interrupted else ["node2@5"]))
    joined = standby.stdout
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {"node0": -9 if interrupted else 0, "node1": 0, "node2": -9,
                                                "node3": 0}, proc.stdout[-3000:]
    assert standby.returncode == 0, joined[-4000:]
    assert "lost ['node2'] at step 5" in proc.stdout
    assert re.search(r"node3: reconfiguring at step \d+: .* -> \['node0', 'node1', 'node4', 'node3'\] .*\(rebalance: "
                     r"1 standby nodes relieve 1 overloaded nodes\)", proc.stdout), proc.stdout[-3000:]
    if interrupted:
        assert re.search(r"node4: a node was lost while this node was admitted at step \d+ .*it stands by again",
                         joined), joined[-3000:]
        assert len(re.findall(r"(node[13]): restarted after a fatal loss", proc.stdout)) == 2, proc.stdout[-3000:]
    found = re.search(r"node4: joined the running job at step (\d+) \((\d+) micro-batches", joined)
    assert found, joined[-3000:]
    step, drawn = int(found[1]), int(found[2])
    assert (0 if interrupted else 5) < step < STEPS and drawn == step * 4  # the global batch from where the others are
    assert "Traceback" not in joined and "Traceback" not in proc.stdout
    weights, states, meta = _final(tmp_path / "out")
    clean_weights, clean_states, _ = _final(clean)
    assert max_abs_diff(weights, clean_weights) == 0.0 and max_abs_diff(states, clean_states) == 0.0
    assert meta["data_position"] == STEPS * 4 and meta["bamboo"]["global_steps"] == STEPS


def test_a_pipeline_module_with_tied_first_and_last_layers_ends_bit_exact_through_a_kill_of_the_first_stage(tmp_path):
    """``TiedLayerSpec("io", ...)`` on layer 0 and on the last layer (its ``forward_fn`` uses the weight transposed):
    DeepSpeed's own ``PipelineModule`` broadcasts the tied weight through the job's process group as it is built;
    the door keeps one copy per stage, equal, and a kill of node0 (whose stage the last node takes over) ends as
    the run without it, the tied module once in the consolidated weights."""
    script = tmp_path / "spot.py"
    text = SPOT.read_text()
    for old, new in (("    specs = []\n", '    specs = [TiedLayerSpec("io", nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Tanh)]\n'),
                     ("    return specs + [LayerSpec(nn.Linear, WIDTH, WIDTH)]",
                      '    return specs + [TiedLayerSpec("io", nn.Linear, WIDTH, WIDTH, forward_fn=lambda m, x: x @ m.weight)]'),
                     ("from deepspeed.pipe import LayerSpec, PipelineModule", "from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec")):
        assert old in text
        text = text.replace(old, new)
    script.write_text(text)
    _train(tmp_path / "clean", script=script)
    assert "lost ['node0'] at step 5" in _train(tmp_path / "kill", script=script, kill=["node0@5"])
    weights, states, meta = _final(tmp_path / "kill")
    clean_weights, clean_states, _ = _final(tmp_path / "clean")
    assert max_abs_diff(weights, clean_weights) == 0.0 and max_abs_diff(states, clean_states) == 0.0
    last = meta["bamboo"]["num_layers"] - 1
    assert meta["bamboo"]["ties"] == {"io": [0, last]} and not any(k.startswith(f"{last}.") for k in weights)
    saved = ckpt.read_layers(tmp_path / "kill" / "final", [0, last])
    assert all(torch.equal(saved[0]["weights"][k], saved[last]["weights"][k]) for k in ("weight", "bias"))
