"""A machine's supervisor reports the job's outcome: its workers' own codes where they decide, else the job's end.

Against a real embedded store (the one a ``Cluster`` starts), with the workers' exit codes as the supervisor
recorded them: a SIGKILLed worker is a vanished spot node, not a failure; the job's end decides the rest.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator

import pytest

from lightning_bamboo.errors import CONFIG_EXIT_CODE
from lightning_bamboo.launcher.cluster import Cluster
from lightning_bamboo.launcher.outcome import machine_status
from lightning_bamboo.membership.keys import JobKeys
from lightning_bamboo.membership.lease import Registry

pytestmark = [pytest.mark.timeout(60)]

KILLED = -signal.SIGKILL


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster("embedded", job="outcome")
    try:
        yield c
    finally:
        c.close()


def finish(c: Cluster, nodes: list[str]) -> None:
    c.store.put(JobKeys(c.job).finished, json.dumps(nodes))


@pytest.mark.parametrize(("codes", "finished", "status"), [
    ({"m0.0": 0, "m0.1": KILLED}, ["m0.0", "m1.0"], 0),  # m0.1 vanished mid-run; m0.0 finished the job
    ({"m0.0": KILLED, "m0.1": KILLED}, ["m1.0"], 0),  # this machine lost both; the job finished elsewhere
    ({"m0.0": 0, "m0.1": KILLED}, ["m0.0", "m0.1"], 1),  # m0.1 was still in the job at its end, and was killed
    ({"m0.0": CONFIG_EXIT_CODE, "m0.1": KILLED}, None, CONFIG_EXIT_CODE),  # a refusal, whatever the job did
    ({"m0.0": 1, "m0.1": 0}, ["m0.1"], 1),  # a worker failed (Fenced, a crash)
    ({"m0.0": 0, "m0.1": 0}, None, 0),  # both ended cleanly (one left after a notice, say): no wait for the end
])
def test_a_machines_status_is_its_workers_where_they_decide_else_the_jobs_end(cluster, codes, finished, status):
    cluster.codes.update(codes)
    if finished is not None:
        finish(cluster, finished)
    assert machine_status(cluster, list(codes), poll=0.05, gone_after=5.0) == status


def test_a_machine_whose_workers_were_killed_waits_for_the_job_to_finish_elsewhere(cluster):
    """Both workers SIGKILLed while the job runs on (another machine's node is live): the supervisor does not
    report until the job's end is marked, then 0."""
    cluster.codes.update({"m0.0": KILLED, "m0.1": KILLED})
    other = Registry(cluster.store, cluster.job, "m1.0", ttl=1.0)
    other.join()
    try:
        # the job's end is marked half a second into the wait: 0 can only come from reading that mark
        later = threading.Timer(0.5, finish, args=(cluster, ["m1.0"]))
        later.start()
        assert machine_status(cluster, ["m0.0", "m0.1"], poll=0.05, gone_after=5.0) == 0
        later.join()
    finally:
        other.stop_heartbeat()


def test_a_machine_whose_workers_were_killed_reports_a_job_nobody_finishes_as_failed(cluster):
    """Every node of the job gone and its end never marked: 1, once no node has been live for the bound."""
    cluster.codes.update({"m0.0": KILLED})
    assert machine_status(cluster, ["m0.0"], poll=0.05, gone_after=0.3) == 1
