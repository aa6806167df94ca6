"""The membership session's protocol, in one process: several ``Session`` objects on threads, one embedded store.

What the runtime relies on, each as a test: a step commits when every node committed, and a loss during
a commit fails it on every survivor (naming the lost node); two deciders with different suspicions end on
the union; a collective with a lost node fails on every survivor; a standby node is admitted by a record, or
released by the job's end; a node whose lease lapsed writes nothing. No torch: process groups are formed by
``Groups`` below, which only records what it was asked.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from lightning_bamboo.demo.controller import record_line
from lightning_bamboo.errors import BambooError, FatalLoss, PeerLost
from lightning_bamboo.membership import EmbeddedServer, Store, connect
from lightning_bamboo.membership import session as session_module
from lightning_bamboo.membership.fence import Fenced
from lightning_bamboo.membership.keys import JobKeys
from lightning_bamboo.membership.lease import abandon_job
from lightning_bamboo.membership.records import Failover, Reconfiguration, Restart, failover_record
from lightning_bamboo.membership.session import Session

pytestmark = [pytest.mark.timeout(60)]

#: a lease of 1 s (the registry's least): a node that stops its heartbeat is lost about a second later
DETECTION = 1.0
#: bounds every wait of a session in these tests; nothing here should come near it
RENDEZVOUS = 20.0
#: how long a test waits for its threads
JOIN = 30.0
#: two stages of three layers each become three of two, on a standby node n9
ADMIT_N9 = Reconfiguration(generation=1, order=("n0", "n1", "n9"), parts=(0, 2, 4, 6), old_order=("n0", "n1"),
                           old_parts=(0, 3, 6), sender="n0", tag="reconf", step=1, reason="admit n9")


class Groups:
    """A ``GroupFormer`` with no process group: rank = position in the order; it records every call."""

    def __init__(self) -> None:
        self.formed: list[tuple[int, tuple[str, ...], str]] = []
        self.aborts = 0

    def reform(self, store: Store, job: str, generation: int, order: Sequence[str], me: str, *, timeout: float,
               tag: str, gone: Callable[[], Collection[str]]) -> tuple[int, int]:
        if lost := set(gone()):
            raise PeerLost(f"{sorted(lost)} lost before the group formed", lost)
        self.formed.append((generation, tuple(order), tag))
        return list(order).index(me), len(order)

    def abort(self) -> None:
        self.aborts += 1


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    server = EmbeddedServer().start()
    try:
        yield server
    finally:
        server.stop()


def session(server: EmbeddedServer, job: str, node: str, nodes: Sequence[str], **kwargs: Any) -> Session:
    return Session(connect(server.url), job, node, nodes, groups=Groups(), detection_timeout=DETECTION,
                   rendezvous_timeout=kwargs.pop("rendezvous_timeout", RENDEZVOUS), **kwargs)


def on_threads(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run every call on a thread of its own, at once; name -> what it returned, or the exception it raised."""
    results: dict[str, Any] = {}
    start = threading.Barrier(len(calls))

    def run(name: str, call: Callable[[], Any]) -> None:
        start.wait(JOIN)
        try:
            results[name] = call()
        except BaseException as err:  # noqa: BLE001 - the test looks at it
            results[name] = err

    threads = [threading.Thread(target=run, args=item, name=f"session-{item[0]}", daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"threads still running after {JOIN} s: {stuck}"
    return results


@contextmanager
def job(server: EmbeddedServer, name: str, nodes: Sequence[str], alive: Mapping[str, str] | None = None,
        **kwargs: Any) -> Iterator[dict[str, Session]]:
    """The sessions of ``nodes``, opened together (the start rendezvous needs them all); stopped at the end.
    ``alive``: the liveness address each node publishes (``membership.liveness``; none by default)."""
    sessions = {node: session(server, name, node, nodes, alive=(alive or {}).get(node, ""), **kwargs)
                for node in nodes}
    try:
        opened = on_threads({node: s.open for node, s in sessions.items()})
        assert all(isinstance(result, Session) for result in opened.values()), opened
        yield sessions
    finally:
        for s in sessions.values():
            s.stop()


def lose(s: Session) -> None:
    """``s``'s node freezes: its heartbeat stops (its lease ends one TTL later) and it watches nothing."""
    s.registry.stop_heartbeat()
    s.detector.stop()


def wait_until(store: Store, prefix: str, holds: Callable[[set[str]], bool]) -> None:
    """Wait (bounded) until the keys under ``prefix`` satisfy ``holds``."""
    revision = 0
    for _ in range(200):
        snap = store.get_prefix(prefix)
        if holds({kv.key[len(prefix):] for kv in snap.kvs}):
            return
        revision = store.wait_for_change(prefix, max(revision, snap.revision), 0.5).revision
    raise AssertionError(f"{prefix} never held what was waited for")


def test_a_step_commits_when_every_node_committed(server):
    with job(server, "commit", ["n0", "n1", "n2"]) as s:
        assert not any(x.committed(0) for x in s.values())
        assert on_threads({n: (lambda x=x: x.commit(0)) for n, x in s.items()}) == dict.fromkeys(s)
        assert all(x.committed(0) for x in s.values())
        assert all(not x.leavers for x in s.values())


def test_a_step_a_live_node_never_commits_times_out_naming_it(server):
    with job(server, "stuck", ["n0", "n1"]) as s:
        s["n0"].rendezvous_timeout = 1.0
        with pytest.raises(BambooError, match=r"step 3 did not commit within 1.0 s .* no commit from \['n1'\] \(n1 live\)"):
            s["n0"].commit(3)


def test_a_node_lost_during_a_commit_fails_the_commit_on_every_survivor(server):
    with job(server, "lost", ["n0", "n1", "n2"]) as s:
        prefix = s["n0"].keys.commit(0, 0)
        results: dict[str, Any] = {}
        survivors = threading.Thread(target=lambda: results.update(
            on_threads({n: (lambda x=s[n]: x.commit(0)) for n in ("n0", "n1")})), daemon=True)
        survivors.start()
        wait_until(s["n0"].store, prefix, lambda got: got == {"n0", "n1"})  # both wait in the commit now
        lose(s["n2"])
        survivors.join(JOIN)
        assert not survivors.is_alive()
        for node in ("n0", "n1"):
            assert isinstance(results[node], PeerLost), results
            assert results[node].lost == ("n2",)
            assert "lost ['n2'] before step 0 committed" in str(results[node])
            assert not s[node].committed(0)
        # the survivors then agree on the loss
        assert on_threads({n: (lambda x=s[n]: x.decide_lost((), ["n0", "n1", "n2"])) for n in ("n0", "n1")}) == \
            {"n0": {"n2"}, "n1": {"n2"}}


def test_a_commit_put_by_a_node_lost_right_after_still_counts(server):
    with job(server, "late", ["n0", "n1", "n2"]) as s:
        s["n2"].store.put(s["n2"].keys.commit(0, 0, "n2"), "1")  # its part of the step is in
        lose(s["n2"])
        assert on_threads({n: (lambda x=s[n]: x.commit(0)) for n in ("n0", "n1")}) == {"n0": None, "n1": None}


def test_two_deciders_with_different_suspicions_end_on_the_union(server):
    nodes = ["n0", "n1", "n2", "n3"]
    with job(server, "decide", nodes) as s:
        for generation in range(8):  # eight races: whoever swaps first, the decision only grows
            for x in s.values():
                x.generation = generation
            first = on_threads({"n0": lambda: s["n0"].decide_lost(("n2",), nodes),
                                "n1": lambda: s["n1"].decide_lost(("n3",), nodes)})
            assert first["n0"] >= {"n2"} and first["n1"] >= {"n3"}
            assert first["n0"] <= {"n2", "n3"} and first["n1"] <= {"n2", "n3"}
            stored = s["n0"].store.get(s["n0"].keys.decision(generation + 1))
            assert set(json.loads(stored.value)) == {"n2", "n3"}
            # a decider that got less than the union (it swapped first) gets the union at its next attempt
            again = on_threads({"n0": lambda: s["n0"].decide_lost(("n2",), nodes),
                                "n1": lambda: s["n1"].decide_lost(("n3",), nodes)})
            assert again == {"n0": {"n2", "n3"}, "n1": {"n2", "n3"}}
        # a node the decision names follows it and never adds to it
        assert s["n2"].decide_lost(("n0",), nodes) == {"n2", "n3"}
        assert set(json.loads(s["n0"].store.get(s["n0"].keys.decision(8)).value)) == {"n2", "n3"}


def test_a_gather_with_a_lost_node_fails_on_every_survivor_and_works_after_the_reform(server):
    nodes = ["n0", "n1", "n2"]
    with job(server, "gather", nodes) as s:
        parts = on_threads({n: (lambda x=s[n], n=n: x.gather(f"from {n}")) for n in nodes})
        assert parts == dict.fromkeys(nodes, ["from n0", "from n1", "from n2"])  # rank order on every node
        lose(s["n2"])
        failed = on_threads({n: (lambda x=s[n]: x.gather("second")) for n in ("n0", "n1")})
        for node in ("n0", "n1"):
            assert isinstance(failed[node], PeerLost), failed
            assert "n2" in failed[node].lost
        # the failover in the store: agree on the lost set, re-form without it, and the same collective again
        lost = on_threads({n: (lambda x=s[n]: x.decide_lost((), nodes)) for n in ("n0", "n1")})
        assert lost == {"n0": {"n2"}, "n1": {"n2"}}
        formed = on_threads({n: (lambda x=s[n]: x.reform(["n0", "n1"], tag="without-n2")) for n in ("n0", "n1")})
        assert formed == {"n0": (0, 2), "n1": (1, 2)}
        assert [s[n].groups.formed for n in ("n0", "n1")] == [[(1, ("n0", "n1"), "without-n2")]] * 2
        assert all(s[n].generation == 1 and s[n].nodes == ["n0", "n1"] for n in ("n0", "n1"))
        again = on_threads({n: (lambda x=s[n]: x.gather("second")) for n in ("n0", "n1")})
        assert again == dict.fromkeys(("n0", "n1"), ["second", "second"])


def test_a_standby_node_is_admitted_by_a_record_and_enters_the_next_generation(server):
    with job(server, "admit", ["n0", "n1"]) as s:
        spare = session(server, "admit", "n9", [], joining=True).open()
        try:
            assert spare.nodes == [] and s["n0"].standby() == []  # not offered before it is seen to answer
            waiting: dict[str, Any] = {}
            # it puts its standby key every beat while it waits, however seldom it reads the rest (poll); an admission
            # wakes it at once (a wait of 60 s per poll would outlast the join below)
            waiter = threading.Thread(target=lambda: waiting.update(record=spare.wait_admission(poll=60.0, beat=0.05)))
            waiter.start()
            for _ in range(100):
                if s["n0"].standby() == ["n9"]:
                    break
                threading.Event().wait(0.05)
            assert s["n0"].standby() == ["n9"]
            for x in s.values():  # every node reports standby nodes at each commit: the same list on all
                x.admitting = True
            assert on_threads({n: (lambda x=x: x.commit(0)) for n, x in s.items()}) == dict.fromkeys(s)
            assert [x.joiners for x in s.values()] == [["n9"], ["n9"]]
            record = ADMIT_N9
            s["n0"].admit(record)
            waiter.join(JOIN)
            assert waiting["record"] == record
            entered = on_threads({"n0": lambda: s["n0"].reform(list(record.order), tag=record.tag),
                                  "n1": lambda: s["n1"].reform(list(record.order), tag=record.tag),
                                  "n9": lambda: spare.enter(record)})
            assert entered == {"n0": (0, 3), "n1": (1, 3), "n9": (2, 3)}
            assert all(x.generation == 1 and x.nodes == list(record.order) for x in (*s.values(), spare))
            assert s["n0"].standby() == [] and spare.store.get(spare.keys.standby("n9")) is None
        finally:
            spare.stop()


def test_a_standby_node_that_stops_answering_or_whose_machine_lost_a_node_is_not_offered(server, monkeypatch):
    """The first node offers a standby node only while its key keeps changing (it refreshes it as it waits): one
    cut off or frozen, whose lease has not run out yet, drops out of the list within a few seconds; so does one on
    a machine that just lost a node (the same failure may have taken it: its last refresh may predate it), until two
    of its refreshes landed after the loss was decided (a live mate trains on, it does not wait out a timeout)."""
    monkeypatch.setattr(session_module, "STANDBY_FRESH_SECONDS", 0.5)  # (3 s in a job)
    with job(server, "fresh", ["m0.0", "m1.0"]) as s:
        spares = {name: session(server, "fresh", name, [], joining=True).open() for name in ("m2.0", "m1.1")}
        try:
            first = s["m0.0"]
            for name, spare in spares.items():  # two refreshes each, as ``wait_admission`` writes them
                for beat in ("1", "2"):
                    spare.store.put(spare.keys.standby(name), beat)
                    first.standby()
            assert first.standby() == ["m1.1", "m2.0"]
            first.lost_machine(["m1.0"])  # a failover agreed that m1.0 is lost
            assert first.standby() == ["m2.0"]
            spares["m1.1"].store.put(spares["m1.1"].keys.standby("m1.1"), "3")  # sent before the loss, say
            assert first.standby() == ["m2.0"]
            spares["m1.1"].store.put(spares["m1.1"].keys.standby("m1.1"), "4")  # sent once that one was answered
            assert first.standby() == ["m1.1", "m2.0"]
            clock = time.monotonic() + session_module.STANDBY_FRESH_SECONDS + 0.2
            while time.monotonic() < clock:  # both stop answering: their leases run on, their keys stay
                threading.Event().wait(0.1)
            assert first.standby() == [] and "m2.0" in first.registry.members().live
        finally:
            for spare in spares.values():
                spare.stop()


def test_a_machine_s_worker_count_comes_from_its_supervisor_and_a_forged_one_counts_as_none(monkeypatch):
    """The count is the launcher's ``LOCAL_WORLD_SIZE`` (1 when unset or not a number); read back from a registration,
    anything but a small positive integer counts as 1 (the store may be written by others than the job)."""
    for value, count in (("2", 2), ("0", 1), ("two", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
        assert session_module._machine_workers() == count
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert session_module._machine_workers() == 1
    key = session_module.MACHINE_WORKERS_KEY
    assert [session_module._workers_of(meta) for meta in ({key: 2}, {key: True}, {key: "2"}, {key: 10**9}, {}, None)] \
        == [2, 1, 1, 1, 1, 1]


def test_a_machine_s_standby_workers_are_offered_together_or_after_a_bound(server, monkeypatch):
    """A supervisor of ``--workers 2`` registers each worker with its machine's count: the first node holds a
    machine's standby workers back until every one of them stands by (or is in the layout), so that one
    reconfiguration admits them all, not one a step after the other; a worker that never comes delays its mate
    ``MACHINE_GATHER_SECONDS`` only."""
    monkeypatch.setattr(session_module, "MACHINE_GATHER_SECONDS", 0.5)  # (1 s in a job)

    def spare(name: str) -> Session:
        node = session(server, "gather", name, [], joining=True, machine_workers=2).open()
        node.store.put(node.keys.standby(name), "2")  # it answers (a refresh, as ``wait_admission`` puts)
        return node

    with job(server, "gather", ["m0.0", "m1.0"]) as s:
        first, spares = s["m0.0"], [spare("m2.0")]
        try:
            first.standby()
            spares[0].store.put(spares[0].keys.standby("m2.0"), "3")
            assert first.standby() == []  # m2.1 has not registered yet: m2.0 waits for it
            spares.append(spare("m2.1"))
            assert first.standby() == ["m2.0", "m2.1"]  # both in one list: one admission
            spares.append(spare("m3.0"))  # m3.1 never starts: m3.0 is offered once the bound has passed
            held = time.monotonic()
            assert "m3.0" not in first.standby()
            while "m3.0" not in first.standby():
                assert time.monotonic() - held < 5.0, "m3.0 was never offered"
                threading.Event().wait(0.05)
            assert time.monotonic() - held >= session_module.MACHINE_GATHER_SECONDS - 0.05
            # a worker whose machine-mate is in the layout already (its other worker trains) is not held back
            spares.append(spare("m1.1"))
            assert "m1.1" in first.standby()
        finally:
            for node in spares:
                node.stop()


def test_a_node_released_by_the_failover_that_formed_the_generation_is_offered_at_first_sight(server):
    """n1 lost: n0 and n2 re-form without n3, whom the failover released (it stands by in its process). The layout's
    first node offers n3 at the first commit that sees its standby key, not a commit later as a node first seen
    (it answered a moment ago); a standby node it did not release still needs its key seen changing."""
    with job(server, "rel", ["n0", "n1", "n2", "n3"]) as s:
        spare = session(server, "rel", "n9", [], joining=True).open()
        try:
            for x in s.values():
                x.admitting = True
            assert s["n3"].decide_lost(("n1",), s["n3"].nodes) == {"n1"}
            s["n3"].release()
            s["n3"].stand_by()
            results = on_threads({n: (lambda x=s[n]: x.reform(["n0", "n2"])) for n in ("n0", "n2")})
            assert results == {"n0": (0, 2), "n2": (1, 2)}, results
            assert s["n0"].standby() == ["n3"]  # n9's key first seen, put before any look: not yet
            spare.store.put(spare.keys.standby("n9"), "2")
            assert s["n0"].standby() == ["n3", "n9"]
            # a standby node that comes after a look is offered at the next: its key was put in between
            late = session(server, "rel", "n8", [], joining=True).open()
            try:
                assert s["n0"].standby() == ["n3", "n8", "n9"]
            finally:
                late.stop()
        finally:
            spare.stop()


def test_the_nodes_a_failover_released_are_offered_to_every_survivor_before_the_next_step(server):
    """b.0 lost: a.0 and d.0 re-form, their failover released b.1 and c.0 (each stands by in its process). Every
    survivor gets the same standby list at once, before any commit of the new generation: c.0, not b.1 (its machine
    just lost a node), nor e.0 (named, but not standing by). A survivor that proposes later gets the first proposal."""
    with job(server, "offer", ["a.0", "b.0", "b.1", "c.0", "d.0"]) as s:
        for x in s.values():
            x.admitting = True
        for n in ("a.0", "d.0"):
            assert s[n].decide_lost(("b.0",), s[n].nodes) == {"b.0"}
        for n in ("b.1", "c.0"):
            s[n].release()
            s[n].stand_by()
        results = on_threads({n: (lambda x=s[n]: x.reform(["a.0", "d.0"])) for n in ("a.0", "d.0")})
        assert results == {"a.0": (0, 2), "d.0": (1, 2)}, results
        assert s["a.0"].offer_released({"b.1", "c.0", "e.0"}, step=5) == ["c.0"]
        s["d.0"]._machine_lost.clear()  # (it would propose b.1 too now: the first proposal stands)
        assert s["d.0"].offer_released({"b.1", "c.0", "e.0"}, step=5) == ["c.0"]
        assert s["a.0"].joiners == s["d.0"].joiners == ["c.0"]
        s["a.0"].admitting = False
        assert s["a.0"].offer_released({"c.0"}, step=6) == []  # no rebalancer admits standby nodes: none offered


def test_a_leaver_that_the_next_layout_does_not_hold_is_not_served_again(server):
    """n1 announces at step 0's commit that it leaves, and the standby list of that commit names n9. The survivors
    re-form without n1 (a restart after a fatal loss, say, before they switched at a step start): n1 is then no
    leaver of theirs any more, so the next step starts no failover for it, and the standby list waits for the new
    generation's first commit (a restart that admitted the old list's nodes at once, gone by then, failed again
    at every restart)."""
    with job(server, "leaver", ["n0", "n1", "n2"]) as s:
        for x in s.values():
            x.joiners = ["n9"]  # what step 0's commit would have said
        s["n1"].leave_requested = lambda: True
        assert on_threads({n: (lambda x=x: x.commit(0)) for n, x in s.items()}) == dict.fromkeys(s)
        assert s["n0"].leavers == {"n1"} and s["n2"].leavers == {"n1"}
        order = ["n0", "n2"]
        assert on_threads({n: (lambda n=n: s[n].reform(order, tag="restart")) for n in order}) == {
            "n0": (0, 2), "n2": (1, 2)}
        assert s["n0"].leavers == set() and s["n2"].leavers == set()
        assert s["n0"].joiners == [] and s["n2"].joiners == []


def test_a_rendezvous_gives_up_at_once_on_a_node_released_from_the_layout_it_forms(server):
    """Two pipelines: n1 lost; n3 decides first, on {n1}, and leaves the next layout released (its pipeline was
    dropped). n0 saw n2 lost too before deciding, so its order, a restart of n0 and n3, still names n3, who will not
    come: the rendezvous names n3 released at once (not after the rendezvous timeout), and the decision taken again
    with it names n3 lost without counting its machine lost (it stands by, and may be admitted soon)."""
    with job(server, "released", ["n0", "n1", "n2", "n3"]) as s:
        assert s["n3"].decide_lost(("n1",), s["n3"].nodes) == {"n1"}
        s["n3"].release()
        started = time.monotonic()
        with pytest.raises(PeerLost, match=r"\['n3'\] released from the layout") as raised:
            s["n0"].reform(["n0", "n3"], tag="restart")
        assert time.monotonic() - started < RENDEZVOUS / 4 and set(raised.value.lost) == {"n3"}
        assert s["n0"].decide_lost(("n2", *raised.value.lost), s["n0"].nodes) == {"n1", "n2", "n3"}
        assert "n3" not in s["n0"]._machine_lost and {"n1", "n2"} <= set(s["n0"]._machine_lost)


def test_a_node_back_as_standby_waits_for_an_admission_made_after_it_came_back(server):
    """n9 was admitted once (its record stays in the store); released, it registers again as a standby node. The old
    record names it, but its layout is gone: the new standby waits for an admission made since it came back (here
    none: the job finishes) instead of entering the old one (whose nodes may be lost by now)."""
    with job(server, "again", ["n0", "n1"]) as s:
        s["n0"].admit(ADMIT_N9)
        back = session(server, "again", "n9", [], joining=True).open()
        try:
            later = Reconfiguration(generation=3, order=("n0", "n9"), parts=(0, 3, 6), old_order=("n0", "n1"),
                                    old_parts=(0, 3, 6), sender="n0", tag="reconf-2", step=7, reason="admit n9 again")
            waited = on_threads({"n9": lambda: back.wait_admission(poll=0.2), "n0": lambda: s["n0"].admit(later)})
            assert waited == {"n9": later, "n0": None}
        finally:
            back.stop()
        wait_until(s["n0"].store, JobKeys("again").node(), lambda live: "n9" not in live)  # its lease ended
        back = session(server, "again", "n9", [], joining=True).open()
        try:
            assert on_threads({"n9": lambda: back.wait_admission(poll=0.2), "n0": s["n0"].finish}) == {
                "n9": None, "n0": None}
        finally:
            back.stop()


def test_a_standby_node_whose_lease_lapsed_registers_again_and_waits_on(server):
    """A standby node's keep-alives starve (a loaded machine) until its lease may have lapsed: instead of stopping
    with ``Fenced`` at its next write it registers again (it held no stage) and goes on waiting, live."""
    with job(server, "starved", ["n0"]) as s:
        spare = session(server, "starved", "n8", [], joining=True).open()
        try:
            spare.registry.stop_heartbeat()
            wait_until(s["n0"].store, JobKeys("starved").node(), lambda live: "n8" not in live)  # its lease ended
            assert spare.store.fenced
            seen: list[bool] = []

            def finish_once_back() -> None:
                wait_until(s["n0"].store, JobKeys("starved").node(), lambda live: "n8" in live)
                seen.append(True)
                s["n0"].finish()

            assert on_threads({"n8": lambda: spare.wait_admission(poll=0.2), "n0": finish_once_back}) == {
                "n8": None, "n0": None}
            assert seen and not spare.store.fenced
        finally:
            spare.stop()


def test_a_standby_node_stops_waiting_when_every_node_of_its_job_is_gone(server):
    """The job's only node freezes (its lease ends) and nobody finishes the job: the standby node gives up a
    detection timeout later with ``FatalLoss`` instead of waiting for ever (its launcher returns)."""
    with job(server, "dead", ["n0"]) as s:
        spare = session(server, "dead", "n8", [], joining=True).open()
        try:
            lose(s["n0"])
            with pytest.raises(FatalLoss, match="'dead' that n8 waited to join ended without finishing: none of its "
                                                "nodes has been live for 1 s"):
                spare.wait_admission(poll=0.2)
        finally:
            spare.stop()


def test_a_standby_node_stops_waiting_when_the_job_finishes_or_is_abandoned(server):
    with job(server, "end", ["n0"]) as s:
        spare = session(server, "end", "n8", [], joining=True).open()
        try:
            waited = on_threads({"n8": lambda: spare.wait_admission(poll=0.2), "n0": s["n0"].finish})
            assert waited == {"n8": None, "n0": None}
            assert json.loads(s["n0"].store.get(JobKeys("end").finished).value) == ["n0"]
        finally:
            spare.stop()
    with job(server, "abandoned", ["n0"]) as s:
        spare = session(server, "abandoned", "n8", [], joining=True).open()
        try:
            abandon_job(s["n0"].store, "abandoned", "n1 and its replica holder were lost together")
            with pytest.raises(FatalLoss, match="ended before admitting it: n1 and its replica holder"):
                spare.wait_admission(poll=0.2)
        finally:
            spare.stop()


def test_a_node_whose_lease_lapsed_writes_nothing(server):
    nodes = ["n0", "n1"]
    with job(server, "fenced", nodes) as s:
        cut_off = s["n1"]
        lose(cut_off)
        lapsed = threading.Event()
        while not lapsed.wait(0.05):  # bounded by the test's timeout: one TTL after its last keep-alive
            if cut_off.registry.lease_may_have_expired():
                lapsed.set()
        for write in (lambda: cut_off.commit(0), lambda: cut_off.decide_lost(("n0",), nodes),
                      lambda: cut_off.gather("late"), lambda: cut_off.confirm_member("commit a checkpoint")):
            with pytest.raises(Fenced, match="n1 refuses to .* its lease may have expired"):
                write()
        keys = s["n0"].keys
        assert s["n0"].store.get(keys.commit(0, 0, "n1")) is None
        assert s["n0"].store.get(keys.decision(1)) is None
        # what it could not write, the live node decides: n1 is lost
        assert s["n0"].decide_lost((), nodes) == {"n1"}
        cut_off.stop()
        assert cut_off.ended_fenced
        with pytest.raises(Fenced, match="membership ended while its lease may have lapsed"):
            cut_off.confirm_member("commit a checkpoint")


def test_after_the_job_a_node_counts_as_a_member_as_it_ended(server):
    """A save after the job (``trainer.save_checkpoint`` after ``fit``) runs once the session stopped and its
    heartbeat with it: the lease then lapses a TTL later, which must not make the node a lost one. ``check_member``
    (the step guard's question, no round trip) answers from how the session stopped."""
    with job(server, "after", ["n0", "n1"]) as s:
        s["n0"].stop()  # the job ended cleanly: its lease was held
        lose(s["n1"])
        while not s["n1"].registry.lease_may_have_expired():  # bounded by the test's timeout
            threading.Event().wait(0.05)
        with pytest.raises(Fenced, match="n1 refuses to go on with its step: its lease may have expired"):
            s["n1"].check_member("go on with its step")  # still in the job: its lease lapsed
        s["n1"].stop()
        while not s["n0"].registry.lease_may_have_expired():  # n0's heartbeat stopped with its session
            threading.Event().wait(0.05)
        s["n0"].check_member("go on with its step")  # ended a member: still one
        with pytest.raises(Fenced, match="membership ended while its lease may have lapsed"):
            s["n1"].check_member("go on with its step")


def test_a_leaver_announces_at_its_commit_and_departs_through_its_group_former(server):
    nodes = ["n0", "n1"]
    with job(server, "leave", nodes) as s:
        s["n1"].leave_requested = lambda: True  # a notice: n1 leaves after this step
        assert on_threads({n: (lambda x=x: x.commit(0)) for n, x in s.items()}) == dict.fromkeys(nodes)
        assert s["n1"].leaving and s["n0"].leavers == {"n1"} and s["n1"].leavers == set()
        with pytest.raises(SystemExit) as exit_status:
            s["n1"].depart()
        assert exit_status.value.code == 0 and s["n1"].groups.aborts == 1 and not s["n1"].active


def test_the_key_schema_reads_like_the_layout_in_the_docs():
    keys = JobKeys("demo")
    assert [keys.commit(2, 7), keys.commit(2, 7, "n1"), keys.joiners(2, 7), keys.decision(3), keys.admit(),
            keys.admit(3), keys.abandoned, keys.standby("n9"), keys.rdzv(0), keys.rdzv(3, "a-b"),
            keys.start_passed("n1"), keys.process_group(3, "a-b"), keys.released(3), keys.coll(2), keys.coll(2, 5),
            keys.failovers(3), keys.reconfigurations(), keys.confirmed("n1"), keys.finished, keys.progress("n1"),
            keys.agreement("rebalance", 2, 7), keys.node("n1"), keys.lost(), keys.leaving("n1"), keys.offer("n1"),
            keys.assign("n1"), keys.master, keys.refused] == [
        "/bamboo/demo/commit/2/7/", "/bamboo/demo/commit/2/7/n1", "/bamboo/demo/joiners/2/7",
        "/bamboo/demo/decision/3", "/bamboo/demo/admit/", "/bamboo/demo/admit/3", "/bamboo/demo/admit/abandoned",
        "/bamboo/demo/standby/n9", "/bamboo/demo/rdzv/0/", "/bamboo/demo/rdzv/3/a-b",
        "/bamboo/demo/rdzv/0-passed/n1", "/bamboo/demo/pg/3/a-b", "/bamboo/demo/released/3/",
        "/bamboo/demo/coll/2/", "/bamboo/demo/coll/2/5", "/bamboo/demo/failovers/3",
        "/bamboo/demo/reconfigurations/", "/bamboo/demo/confirmed/n1", "/bamboo/demo/finished",
        "/bamboo/demo/progress/n1", "/bamboo/demo/rebalance/2/7", "/bamboo/demo/nodes/n1", "/bamboo/demo/lost/",
        "/bamboo/demo/leaving/n1", "/bamboo/demo/offer/n1", "/bamboo/demo/assign/n1", "/bamboo/demo/master",
        "/bamboo/demo/refused",
    ]
    with pytest.raises(BambooError, match="a job name must be a non-empty printable name without '/'"):
        JobKeys("a/b")


def test_a_reconfiguration_record_keeps_its_json_and_checks_its_sender():
    stored = json.loads(ADMIT_N9.to_json())
    assert stored == {"generation": 1, "order": ["n0", "n1", "n9"], "parts": [0, 2, 4, 6], "old_order": ["n0", "n1"],
                      "old_parts": [0, 3, 6], "sender": "n0", "tag": "reconf", "step": 1, "reason": "admit n9",
                      "pipelines": 1, "old_pipelines": 1}
    assert Reconfiguration.from_json(ADMIT_N9.to_json()) == ADMIT_N9 and ADMIT_N9.joiners == ("n9",)
    timed = Reconfiguration.from_json({**stored, "seconds": 0.5})
    assert json.loads(timed.to_json())["seconds"] == 0.5
    with pytest.raises(BambooError, match=r"sender must run before and after it \(sender 'n9'"):
        Reconfiguration.from_json({**stored, "sender": "n9"})
    with pytest.raises(BambooError, match="order of 3 nodes does not split into 2 pipeline"):
        Reconfiguration.from_json({**stored, "pipelines": 2})


def test_failover_and_restart_records_keep_their_json_and_the_layouts_first_node_stores_them(server):
    failover = Failover(step=5, lost=("n2",), committed=False, seconds=0.8, redone=True, order=("n0", "n1", "n3"),
                        parts=(0, 2, 6, 8), pipelines=1, released=(), rows=(("n0", "n1", "n3"),),
                        old_parts=(0, 2, 4, 6, 8), old_pipelines=1)
    restart = Restart(lost=("n1", "n2"), order=("n0", "n3"), stages=2, pipelines=1, seconds=3.0, reason="lost n1, n2",
                      step=12, checkpoint="ckpts/step-00000010", from_step=10)
    assert json.loads(failover.to_json()) == {
        "step": 5, "lost": ["n2"], "committed": False, "seconds": 0.8, "redone": True, "order": ["n0", "n1", "n3"],
        "parts": [0, 2, 6, 8], "pipelines": 1, "released": [], "rows": [["n0", "n1", "n3"]],
        "old_parts": [0, 2, 4, 6, 8], "old_pipelines": 1}
    assert json.loads(restart.to_json()) == {"restart": True, "lost": ["n1", "n2"], "order": ["n0", "n3"],
                                             "stages": 2, "pipelines": 1, "seconds": 3.0, "reason": "lost n1, n2",
                                             "step": 12, "checkpoint": "ckpts/step-00000010", "from_step": 10}
    assert failover_record(failover.to_json()) == failover and failover_record(restart.to_json()) == restart
    assert not failover.restart and restart.restart
    with job(server, "records", ["n0", "n1"]) as s:
        s["n0"].record_failover(failover)
        s["n1"].record_failover(restart)  # kept, not stored: n1 is not the layout's first node
        stored = s["n0"].store.get_prefix(JobKeys("records").failovers()).kvs
        assert [failover_record(kv.value) for kv in stored] == [failover]
        assert s["n0"].failovers == [failover] and s["n1"].failovers == [restart]
    assert record_line(failover) == "step 5: failover in 0.80 s: lost n2; now n0 -> n1 -> n3; the step in flight is redone"
    assert record_line(restart) == "restart in 3.00 s after a fatal loss of n1, n2; now n0 -> n3"
