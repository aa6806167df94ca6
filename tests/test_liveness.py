"""A node's liveness port (``membership.liveness``) and what the session and the step guard do with it.

Real sockets, real processes and the embedded store: a port whose process ended is refused, a silent address is
unreachable, a live one answers; a session declares lost the peers whose port refused, and, for a stalled step,
those whose machine answered nothing when they are the minority, revoking their leases; the guard probes on a
communication error before it waits for the store, and while a step stalls.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from lightning_bamboo.engine.guard import STALL_MIN_SECONDS, StepGuard
from lightning_bamboo.errors import PeerLost
from lightning_bamboo.membership import EmbeddedServer
from lightning_bamboo.membership.fence import Fenced
from lightning_bamboo.membership.liveness import PROBE_SECONDS, Listener, probe
from tests.test_session_protocol import job

pytestmark = [pytest.mark.timeout(60)]


class Silent:
    """A port that answers no connection, as a machine gone silent: a listening socket that never accepts and whose
    queue is full (the kernel then drops every new connection's SYN). An unrouted address is no such thing on every
    machine: a firewall may refuse connections to it. ``answering``: it answers until ``go_silent``."""

    def __init__(self, answering: bool = False) -> None:
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64 if answering else 0)
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._fillers: list[socket.socket] = []
        if not answering:
            self.go_silent()

    def go_silent(self) -> None:
        """Fill the queue: connect until a connection is not answered."""
        while True:
            filler = socket.socket()
            filler.settimeout(0.2)
            self._fillers.append(filler)
            try:
                filler.connect(self._server.getsockname())
            except OSError:
                return
            assert len(self._fillers) < 1000, "the queue never filled"

    def close(self) -> None:
        for filler in self._fillers:
            filler.close()
        self._server.close()


@pytest.fixture
def silent():
    made: list[Silent] = []

    def make(answering: bool = False) -> Silent:
        made.append(Silent(answering))
        return made[-1]

    try:
        yield make
    finally:
        for s in made:
            s.close()


def test_a_probe_tells_an_answering_port_a_refused_one_and_a_silent_machine_apart(silent):
    live, gone, quiet = Listener("127.0.0.1"), Listener("127.0.0.1"), silent().address
    gone.close()
    try:
        started = time.monotonic()
        found = probe({"live": live.address, "gone": gone.address, "silent": quiet, "unreadable": "no port"})
        took = time.monotonic() - started
    finally:
        live.close()
    assert (set(found.answered), set(found.refused), set(found.unreachable)) == ({"live"}, {"gone"}, {"silent"})
    assert took < PROBE_SECONDS + 0.2  # bounded by its timeout, whatever does not answer


def test_a_port_is_refused_once_its_process_ends_though_a_child_it_forked_lives_on(tmp_path):
    script = textwrap.dedent("""
        import os, sys, time
        from lightning_bamboo.membership.liveness import listener
        address = listener("127.0.0.1").address
        if os.fork() == 0:   # the child outlives its parent, as a process it started would
            time.sleep(30)
            os._exit(0)
        print(address, flush=True)
        time.sleep(1.0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert probe({"node": address}).answered == {"node"}  # while the process lives
        assert proc.wait(timeout=30) == 0
        assert probe({"node": address}).refused == {"node"}  # its child still runs, and holds no copy of the port
    finally:
        import os
        import signal

        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the forked child, in the same session
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.fixture
def server():
    server = EmbeddedServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def listen():
    """``listen(n)``: ``n`` liveness listeners on loopback (one host: every node a machine-mate of every other),
    closed at the end."""
    made: list[Listener] = []

    def make(count: int) -> list[Listener]:
        made.extend(Listener("127.0.0.1") for _ in range(count))
        return made[-count:]

    try:
        yield make
    finally:
        for listener in made:
            listener.close()


def test_a_session_declares_lost_the_peers_whose_port_refused_and_a_silent_minority_for_a_stalled_step(
        server, silent, listen):
    nodes = ["n0", "n1", "n2", "n3", "n4"]
    listeners = dict(zip(nodes, listen(5), strict=True))
    alive = {n: listeners[n].address for n in nodes}
    n4 = silent(answering=True)
    alive["n4"] = n4.address  # its machine answers, then nothing
    with job(server, "live", nodes, alive) as sessions:
        n0 = sessions["n0"]
        n0.learn_reachable()  # as the thread each generation starts does: every port answers now
        listeners["n3"].close()  # n3's process is gone (its lease still runs)
        # a communication error: only a refusal counts
        assert n0.probe_peers() == {"n3"}
        assert "n3" not in n0.registry.members().live and "n4" in n0.registry.members().live
        # a stalled step: n4's machine answered neither connection, and n1, n2 answered: n4 is declared too
        n4.go_silent()
        assert n0.probe_peers(unreachable=True) == {"n4"}
        assert set(n0.registry.members().live) == {"n0", "n1", "n2"}
        deadline = time.monotonic() + 5
        while not {"n3", "n4"} <= n0.detector.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {"n3", "n4"} <= n0.detector.lost
        # n4's lease was revoked: the store refuses what it writes, however live it is
        with pytest.raises(Fenced):
            sessions["n4"].store.put(sessions["n4"].keys.commit(0, 0) + "n4", "1")


def test_a_node_that_finds_most_of_its_peers_silent_declares_nobody(server, silent, listen):
    """As a node cut off itself would see its peers: two of three silent. It is the one likely cut off, so it leaves
    the decision to their leases (and to the others' probes of it)."""
    c0, c3 = listen(2)
    c1, c2 = silent(answering=True), silent(answering=True)
    alive = {"c0": c0.address, "c1": c1.address, "c2": c2.address, "c3": c3.address}
    with job(server, "cut", list(alive), alive) as sessions:
        for s in sessions.values():
            s.learn_reachable()
        c1.go_silent()
        c2.go_silent()
        assert sessions["c0"].probe_peers(unreachable=True) == set()
        assert set(sessions["c0"].registry.members().live) == set(sessions)
        # as many answering as silent: still nobody (c3 probing c0, c1 only)
        assert sessions["c3"].probe_peers(["c0", "c1"], unreachable=True) == set()
        assert sessions["c3"].probe_peers(["c0", "c1", "c2"], unreachable=False) == set()  # silence is no refusal


def test_a_port_that_never_answered_says_nothing_when_it_refuses_or_stays_silent(server, silent, listen):
    """A firewall between the machines may reject connections to the liveness port (a reset, as a closed port
    gives) or drop them (silence): only a port that answered this node before counts."""
    nodes = ["f0", "f1", "f2", "f3", "f4"]
    listeners = dict(zip(nodes, listen(5), strict=True))
    alive = {n: listeners[n].address for n in nodes}
    listeners["f3"].close()  # refused from the start: never answered
    alive["f4"] = silent().address  # silent from the start
    with job(server, "wall", nodes, alive) as sessions:
        f0 = sessions["f0"]
        f0.learn_reachable()
        assert f0.probe_peers() == set()
        assert f0.probe_peers(unreachable=True) == set()
        assert set(f0.registry.members().live) == set(nodes)
        # f2's port answered f0 before: its refusal now counts
        listeners["f2"].close()
        assert f0.probe_peers() == {"f2"}


def test_a_machine_whose_processes_die_one_after_another_is_declared_in_one_probe(server, listen):
    """A machine's processes close their ports one after another as the kernel tears them down: a probe that finds
    one refused probes its machine-mates that still answered for a moment more (m1.1 beside m1.0: the launcher's
    machine, ``machine_of``), and declares every one that refuses then, so that the survivors agree on the whole
    machine at once. A node of another machine that goes as late is left to the next probe."""
    nodes = ["m0.0", "m1.0", "m1.1", "m2.0", "m2.1"]
    listeners = dict(zip(nodes, listen(5), strict=True))
    with job(server, "dying", nodes, {n: listeners[n].address for n in nodes}) as sessions:
        first = sessions["m0.0"]
        first.learn_reachable()
        listeners["m1.0"].close()
        later = [threading.Timer(0.1, listeners[n].close) for n in ("m1.1", "m2.0")]  # a tenth of a second later
        for timer in later:
            timer.start()
        try:
            assert first.probe_peers() == {"m1.0", "m1.1"}
        finally:
            for timer in later:
                timer.join()
        assert set(first.registry.members().live) == {"m0.0", "m2.0", "m2.1"}
        assert first.probe_peers() == {"m2.0"}


def test_the_guard_probes_on_a_communication_error_before_it_waits_and_while_a_step_stalls():
    lost = threading.Event()
    calls: list[bool] = []

    def found_dead(unreachable: bool) -> None:
        calls.append(unreachable)
        if not unreachable:
            lost.set()  # the probe declared the peer lost: the detector's event

    guard = StepGuard(lost, lambda: ("n1",), detection_timeout=30.0, probe=found_dead)

    def reset() -> None:
        raise RuntimeError("Connection reset by peer")

    started = time.monotonic()
    with pytest.raises(PeerLost, match="n1"):
        guard.run(reset)
    assert calls == [False]
    assert time.monotonic() - started < 5.0  # not the detection timeout: the probe answered first

    lost.clear()
    calls.clear()
    for _ in range(3):
        guard.run(lambda: time.sleep(0.01))  # quick steps: the stall threshold is their multiple, at least its floor
    assert guard.stalled() == pytest.approx(STALL_MIN_SECONDS)
    assert calls == []
    guard.run(lambda: time.sleep(STALL_MIN_SECONDS + 0.4))  # a stalled step: probed for silent machines
    assert calls == [True]
    assert not [t for t in threading.enumerate() if t.name == "bamboo-probe"]  # the round ended with the step
