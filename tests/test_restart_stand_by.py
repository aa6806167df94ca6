"""A restart after a fatal loss that the other survivors make without this node: it stands by in its process.

The restart's survivors agree on the lost set of the next generation as a failover does (``Session.decide_lost``).
A live node that set names (it was late, or the others released it in an attempt it had not seen) must not end its
process with the fatal loss: it leaves the layout as a released node does and waits, under the same registration,
to be admitted again. Real sessions on one embedded store (``test_session_protocol``'s), a real ``NodeStage``; the
membership is decided before anything of the stage is needed, so the stage has no engine here.
"""

from __future__ import annotations

import pytest

from lightning_bamboo.errors import BambooConfigError, FatalLoss, PeerLost, Released
from lightning_bamboo.runtime.config import BambooConfig
from lightning_bamboo.runtime.restart import LeftOut, reform_after_fatal_loss, restart_layout, restart_shape
from lightning_bamboo.runtime.stage import NodeStage
from tests.test_session_protocol import job, server  # noqa: F401 - server is the fixture job() runs on

pytestmark = [pytest.mark.timeout(60)]


def test_a_survivor_the_agreed_lost_set_names_stands_by_instead_of_ending_with_the_fatal_loss(server):  # noqa: F811
    nodes = ["n0", "n1", "n2", "n3"]
    with job(server, "restart-late", nodes) as s:
        # n3 was lost with its replica holder n2 (fatal); n0 saw n1 late and put it in the agreed set too
        assert s["n0"].decide_lost(("n1", "n2", "n3"), nodes) == {"n1", "n2", "n3"}
        stage = NodeStage(BambooConfig(), host=None)  # type: ignore[arg-type]
        stage.attach(s["n1"])
        with pytest.raises(Released, match=r"n1 was released at step 5: the restart after a fatal loss goes on "
                                           r"without it: the survivors' lost set names it"):
            reform_after_fatal_loss(stage, FatalLoss("stage 3 (node n3) and its replica holder (node n2) are both "
                                                     "lost"), 5)
        keys = s["n1"].keys
        assert s["n1"].active and s["n1"].nodes == []  # in the job, out of the layout
        assert s["n0"].store.get(keys.standby("n1")) is not None  # waiting to be admitted again
        assert "n1" in s["n0"].released(s["n0"].generation + 1)  # said released, not lost
        # a survivor the set does not name goes on into the restart (here: it needs its stage next)
        other = NodeStage(BambooConfig(), host=None)  # type: ignore[arg-type]
        other.attach(s["n0"])
        with pytest.raises(BambooConfigError, match="the runner has no stage yet"):
            reform_after_fatal_loss(other, FatalLoss("the same loss"), 5)


def test_a_survivor_the_restarted_shape_leaves_out_is_not_waited_for_when_a_retry_has_room_for_it(server):  # noqa: F811
    """9 nodes as 3 pipelines of 3 stages (9 layers); n7 and n8 lost together (fatal): 7 survivors restart as 2 x 3
    and n6, the last in rank order, has no place. Its mark must not change the others' count (each computes the same
    layout whenever it reads), and once n0 is lost inside the restart, the retry's shape (6 survivors: 2 x 3 again)
    would hold n6, which stands by: the rendezvous names it at once, not after its timeout (300 s by default), and
    the survivors agree on a set without it."""
    nodes = [f"n{i}" for i in range(9)]

    def shape(survivors: int) -> tuple[int, int]:
        return restart_shape(survivors, 3, 9, 8)

    with job(server, "restart-left-out", nodes, rendezvous_timeout=60.0) as s:
        fatal = {"n7", "n8"}
        before_mark = restart_layout(s["n0"], nodes, fatal, (), shape, "lazy")
        assert before_mark[1] == 3 and sorted(before_mark[0]) == nodes[:6] and before_mark[2] is None
        assert restart_layout(s["n6"], nodes, fatal, (), shape, "lazy") == (
            [], 0, LeftOut("the restarted layout of 2 x 3 has no place for it", left_out=True))
        s["n6"].release(left_out=True)  # what the restart does with it (``runtime.failover.release``)
        generation = s["n0"].generation + 1
        assert "n6" in s["n0"].released(generation) and "n6" not in s["n0"].released(generation, left_out=False)
        assert restart_layout(s["n1"], nodes, fatal, (), shape, "lazy") == before_mark  # read after the mark: the same
        # n0 lost inside the restart: the survivors' next attempt counts 6 (n6 among them, standing by)
        retry, stages, why = restart_layout(s["n1"], nodes, {"n0"}, (), shape, "lazy")
        assert why is None and stages == 3 and "n6" in retry
        # (unmarked, it would wait for n6 until the rendezvous timeout, past this test's, and time out there)
        with pytest.raises(PeerLost, match=r"\['n6'\] released from the layout") as err:
            s["n1"].reform(retry, tag="retry")
        assert set(err.value.lost) == {"n6"}
        # the retry after it agrees without n6: 5 survivors, 2 x 2, the last (n5) left out in its turn
        again, stages, why = restart_layout(s["n1"], nodes, {"n0", "n6"}, (), shape, "lazy")
        assert s["n1"].decide_lost((), nodes) == {"n0", "n6", "n7", "n8"}
        assert (stages, sorted(again), why) == (2, ["n1", "n2", "n3", "n4"], None)


def test_the_restarted_shape_is_the_policys_and_never_deeper_than_the_model():
    # a chaos run under the launcher: 8 survivors of a 3-stage job of a 6-layer model restarted as one pipeline of 8
    # stages, which the model refused (more stages than layers), and every supervisor exited 1
    assert restart_shape(8, 3, 6, 8) == (4, 2)
    assert restart_shape(7, 6, 6, 8) == (1, 6)  # was one pipeline of 7: the seventh survivor stands by instead
    assert restart_shape(6, 3, 6, 8) == (2, 3) and restart_shape(9, 3, 6, 8) == (3, 3)  # whole pipelines: kept
    assert restart_shape(2, 4, 8, 8) == (1, 2)  # fewer than the depth: one pipeline of them all
    assert restart_shape(5, 3, 6, 1) == (1, 3)  # a global batch of one micro-batch feeds one pipeline
    for layers in range(1, 9):
        for depth in range(1, layers + 1):
            for survivors in range(1, 25):
                pipelines, stages = restart_shape(survivors, depth, layers, 16)
                assert 1 <= stages <= layers and 1 <= pipelines * stages <= survivors, (survivors, depth, layers)
    with pytest.raises(FatalLoss, match="no node is left"):
        restart_shape(0, 3, 6, 8)
