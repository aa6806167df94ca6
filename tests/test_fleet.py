"""Rendezvous by count (``--min-nodes``): the roster as a pure choice, and supervisors meeting in a real store."""

from __future__ import annotations

import threading

import pytest

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.membership import EmbeddedServer, connect
from lightning_bamboo.membership.fleet import Registered, choose_roster, fleet_rendezvous
from lightning_bamboo.membership.keys import job_prefix

pytestmark = [pytest.mark.timeout(60)]


def test_the_job_forms_of_the_first_machines_once_they_run_enough_nodes():
    a, b, c = Registered("a", 2, 10), Registered("b", 2, 12), Registered("c", 2, 11)
    assert choose_roster([a], 4) is None
    assert choose_roster([b, a], 4) == ["a", "b"]
    assert choose_roster([b, a, c], 4) == ["a", "c", "b"]  # everyone registered when it formed, in arrival order
    assert choose_roster([b, a, c], 4, max_nodes=4) == ["a", "c"]
    assert choose_roster([Registered("big", 4, 1), Registered("small", 1, 2)], 1, max_nodes=3) == ["small"]
    with pytest.raises(BambooConfigError, match="--min-nodes <= --max-nodes"):
        choose_roster([], 4, max_nodes=2)


@pytest.fixture
def store_url():
    server = EmbeddedServer().start()
    try:
        yield server.url
    finally:
        server.stop()


def test_supervisors_meet_in_the_store_and_a_late_machine_becomes_standby(store_url):
    base = job_prefix("fleet")
    results: dict[str, object] = {}

    def machine(name: str) -> None:
        store = connect(store_url)
        try:
            results[name] = fleet_rendezvous(store, base, name, 1, min_nodes=3, max_nodes=None, timeout=20)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            results[name] = err
        finally:
            store.close()

    first = [threading.Thread(target=machine, args=(f"m{i}",)) for i in range(2)]
    for t in first:
        t.start()
    # two machines wait: no roster while only two of three nodes are up
    watcher = connect(store_url)
    try:
        seen = watcher.get_prefix(f"{base}machines/")
        while len(seen.kvs) < 2:
            seen = watcher.get_prefix(f"{base}machines/")
            watcher.wait_for_change(f"{base}machines/", seen.revision, timeout=1.0)
        assert watcher.get(f"{base}roster") is None and not results
        machine("m2")  # the third forms the job
        for t in first:
            t.join(timeout=20)
        machine("late")  # after the roster: standby at once, waiting for no one
    finally:
        watcher.close()
    roster = results["m2"]
    assert sorted(roster) == ["m0", "m1", "m2"] and roster[2] == "m2"  # in the order they registered
    assert results["m0"] == roster and results["m1"] == roster
    assert results["late"] is None


def test_machines_of_one_job_must_run_as_many_workers(store_url):
    base = job_prefix("mixed")
    store = connect(store_url)
    try:
        store.put(f"{base}machines/a", '{"workers": 2}')
        with pytest.raises(BambooConfigError, match="same --workers"):
            fleet_rendezvous(store, base, "b", 1, min_nodes=4, max_nodes=None, timeout=5)
        with pytest.raises(BambooConfigError, match="did not form within 0.5 s"):
            fleet_rendezvous(store, job_prefix("alone"), "b", 1, min_nodes=4, max_nodes=None, timeout=0.5)
    finally:
        store.close()
