"""The runtime's membership: ``membership.session.Session`` with torch's process groups and the step guard.

The protocol (commits, the lost-set agreement, admission, collectives) is ``membership/session.py``'s and
imports no torch; here is what it needs of torch: ``TorchGroups`` forms and aborts the process groups
(``engine.groups``, ``engine.comm_process``), and ``Session.guard`` runs a step that a loss ends at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

from lightning_bamboo.engine.comm_process import BACKEND, abort_generation
from lightning_bamboo.engine.groups import reform_process_group
from lightning_bamboo.engine.guard import StepGuard
from lightning_bamboo.errors import FatalLoss, PeerLost
from lightning_bamboo.membership import session as membership
from lightning_bamboo.membership.protocol import Store
from lightning_bamboo.membership.records import Reconfiguration
from lightning_bamboo.membership.session import GroupFormer, joining, launched_by_bamboo
from lightning_bamboo.runtime.leave import LEAVE

__all__ = ["GroupFormer", "PeerLost", "Reconfiguration", "Session", "TorchGroups", "joining", "launched_by_bamboo",
           "start_session"]

log = logging.getLogger(__name__)

class TorchGroups:
    """The ``GroupFormer`` of a worker: ``torch.distributed`` process groups on ``backend`` (the abortable
    ``"bamboo"`` one unless the user chose), re-formed through the membership store (``reform_process_group``)."""

    def __init__(self, backend: str = BACKEND) -> None:
        self.backend = backend
        #: the new rank 0's TCPStore, kept alive while its group lives
        self.tcp_store: Any = None

    def reform(self, store: Store, job: str, generation: int, order: Sequence[str], me: str, *, timeout: float,
               tag: str, gone: Callable[[], Collection[str]]) -> tuple[int, int]:
        rank, world, self.tcp_store = reform_process_group(store, job, generation, order, me, timeout, tag=tag,
                                                           gone=gone, backend=self.backend)
        return rank, world

    def abort(self) -> None:
        abort_generation()


class Session(membership.Session):
    """A node's membership session (``membership.session.Session``) plus the guard its steps run under."""

    def wait_as_standby(self) -> Reconfiguration | None:
        """A standby node's wait, as both doors wait: the admission that names it, or None when the job finished
        first (the session stopped). A job abandoned after a fatal loss stops the session and raises ``FatalLoss``."""
        try:
            record = self.wait_admission()
        except FatalLoss:  # the job was abandoned: this node leaves it
            self.stop()
            raise
        if record is None:
            log.warning("%s: the job finished before this standby node was needed", self.node)
            self.stop()
        return record

    def guard(self) -> StepGuard:
        """A ``StepGuard`` watching this session's peers: a loss ends the guarded step at once (``PeerLost``)."""
        return StepGuard(self.detector.event, self.lost_peers, self.detection_timeout,
                         check_fenced=lambda: self.check_member("go on with its step"), probe=self.probe_peers)


def start_session(detection_timeout: float, rendezvous_timeout: float, backend: str = BACKEND) -> Session:
    """The session of a worker the Bamboo launcher started: registered, past the start rendezvous (or standing by,
    when it joins a running job), forming its groups on ``backend``; it leaves when this process's one request to
    leave says so (``runtime.leave.LEAVE``, read at each commit)."""
    session = Session.from_environment(detection_timeout, rendezvous_timeout, TorchGroups(backend), LEAVE.requested)
    assert isinstance(session, Session)
    return session
