"""The fault injection spec: what each item arms, and that a process named by one is SIGKILLed."""

from __future__ import annotations

import signal
import subprocess

import pytest

from lightning_bamboo.testing import faults
from lightning_bamboo.testing.faults import Fault
from tests.helpers import PYTHON, REPO


def test_a_spec_reads_as_its_items():
    assert faults.parse(" node1@4, node2@4:3,,node0@failover ") == (
        Fault("node1", "4"), Fault("node2", "4", 3), Fault("node0", "failover"))
    assert faults.parse("") == ()


@pytest.mark.parametrize("item", ["node1", "node1@", "@4", "node1@4:x", "node1@4:0"])
def test_a_malformed_item_is_refused_with_the_form(item):
    with pytest.raises(ValueError, match="NODE@"):
        faults.parse(item)


def test_environment_arms_a_child_and_checks_its_items(tmp_path):
    assert faults.environment(["node1@4", Fault("node2", "save8")]) == {"BAMBOO_FAIL_AT": "node1@4,node2@save8"}
    assert faults.environment(["node1@4:3"], once_dir=tmp_path) == {
        "BAMBOO_FAIL_AT": "node1@4:3", "BAMBOO_FAIL_ONCE_DIR": str(tmp_path)}
    with pytest.raises(ValueError):
        faults.environment(["node1-4"])


def test_nothing_armed_returns_at_once(monkeypatch):
    monkeypatch.delenv("BAMBOO_FAIL_AT", raising=False)
    faults._armed.cache_clear()
    try:
        assert not faults.armed("node1")
        faults.reached("node1", 4)
        faults.reached("node1", 4, 2)
    finally:
        faults._armed.cache_clear()


REACH = """
from lightning_bamboo.testing import faults
for point, instruction in [(3, None), (4, 2), ("save4", None), (4, None), ("failover", None)]:
    print(point, instruction, faults.armed("node1"), flush=True)
    faults.reached("node1", point, instruction)
    faults.reached("node2", point, instruction)
"""


def _reach(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-c", REACH], cwd=REPO, env={"PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_named_node_is_killed_at_its_point_and_not_before():
    proc = _reach(faults.environment(["node1@4", "node2@failover"]))
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split("\n")[:-1] == ["3 None True", "4 2 True", "save4 None True", "4 None True"]
    assert "node1: injected SIGKILL at step 4" in proc.stderr


def test_an_instruction_item_fires_only_mid_step():
    proc = _reach(faults.environment(["node1@4:2"]))
    assert proc.returncode == -signal.SIGKILL and proc.stdout.split("\n")[:-1] == ["3 None True", "4 2 True"]


def test_with_a_once_dir_each_item_fires_once(tmp_path):
    env = faults.environment(["node2@save4"], once_dir=tmp_path)
    assert _reach(env).returncode == -signal.SIGKILL
    assert [p.name for p in tmp_path.iterdir()] == ["node2@save4"]
    second = _reach(env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split()[-3:] == ["failover", "None", "False"]
