"""``Session``: one node's membership in a job (commits, the lost-set agreement, admission, collectives), torch-free.

The session speaks only to a ``Store``; forming and aborting process groups is passed in as a
``GroupFormer`` (the runtime's wraps ``torch.distributed``; the protocol tests pass one that only
counts), so the whole protocol runs in one process against the embedded store.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, TypeVar

from lightning_bamboo.errors import BambooError, FatalLoss, PeerLost
from lightning_bamboo.membership import liveness
from lightning_bamboo.membership.collectives import BarrierTimeoutError, GatherFailed, barrier, gather
from lightning_bamboo.membership.fence import Fenced, FencedStore
from lightning_bamboo.membership.keys import JobKeys
from lightning_bamboo.membership.lease import NodeIdInUseError, Registry
from lightning_bamboo.membership.members import Membership
from lightning_bamboo.membership.node import JOB_ENV, JOIN_ENV, NODE_ENV, NODES_ENV, STORE_ENV, node_address
from lightning_bamboo.membership.protocol import Store, StoreError, request_timeout_for, wait_riding_out
from lightning_bamboo.membership.records import Failover, Reconfiguration, Restart
from lightning_bamboo.membership.watch import LossDetector
from lightning_bamboo.testing import faults
from lightning_bamboo.topology.layout import machine_of

log = logging.getLogger(__name__)
T = TypeVar("T")

#: a standby node whose key has not changed for this long (it puts it every ``STANDBY_BEAT_SECONDS`` while it waits)
#: is not offered for admission: it may be cut off or frozen while its lease still runs (``Session.standby``)
STANDBY_FRESH_SECONDS = 3.0
#: how often a standby node puts its key while it waits: the running nodes offer it for admission once they have seen
#: the key change (it answers), so a node released or joining is offered this soon after it stands by
STANDBY_BEAT_SECONDS = 0.25
#: how long the first node holds back the standby workers of a machine while the rest of that machine's workers (as
#: many as its registration says its supervisor starts) have not stood by yet, so that one reconfiguration admits them
#: all; past it, those that stand by are offered as they are (a worker that never starts delays its mates this long)
MACHINE_GATHER_SECONDS = 1.0
#: the registration's field that says how many workers the node's supervisor starts on its machine (``--workers K``)
MACHINE_WORKERS_KEY = "machine_workers"
#: the value of a ``released/<generation>/<node>`` key put by a survivor that a restart's shape has no place for
#: (``Session.release(left_out=True)``); a released node puts ``1``
LEFT_OUT = "left-out"


class GroupFormer(Protocol):
    """How a session forms and aborts the process group of a generation (the runtime's: ``torch.distributed``).

    ``reform`` is called once every node of ``order`` passed the generation's rendezvous in the store;
    it leaves this process in the group of ``order`` (rank = position) and returns ``(rank, world size)``,
    or raises ``PeerLost`` when ``gone()`` names a node of ``order`` before the group formed.
    ``abort`` ends every operation of the current generation at once (a node that departs).
    """

    def reform(self, store: Store, job: str, generation: int, order: Sequence[str], me: str, *, timeout: float,
               tag: str, gone: Callable[[], Collection[str]]) -> tuple[int, int]: ...

    def abort(self) -> None: ...


def _machine_workers() -> int:
    """How many workers this process's supervisor starts on its machine (the launcher's ``LOCAL_WORLD_SIZE``)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _workers_of(meta: Any) -> int:
    """The machine's worker count a registration's ``meta`` states (1 when it states none it may: the store may be
    written by others than the job, so a value that is not a small positive integer counts as none)."""
    value = meta.get(MACHINE_WORKERS_KEY) if isinstance(meta, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096 else 1


def launched_by_bamboo() -> bool:
    """This process is a worker the Bamboo launcher started (its environment names the job's store)."""
    return STORE_ENV in os.environ


def joining() -> bool:
    """This process is a node joining a running job (it waits as standby until admitted)."""
    return launched_by_bamboo() and os.environ.get(JOIN_ENV) == "1"


class Session:
    """One node's view of the job: registered under a lease, watching its peers, deciding steps once.

    A step commits when every node of the pipeline has put ``commit/<generation>/<step>/<node>``
    (each puts it after its gradients, including the replica's, are exchanged). A node applies
    its update only after seeing all of them, so after a loss either every survivor has the
    gradients of a committed step (and applies them) or no one applies anything and the step
    is redone in the new layout: a step is never half applied.

    Built from a connected ``store`` (the session owns it: ``stop`` closes it), the job's name, this
    node's name, the job's nodes in launch order and the timeouts; nothing is read or written until
    :meth:`open` (register under a lease, then the start rendezvous, or standby when ``joining``).
    :meth:`from_environment` does both from the launcher's environment.
    """

    #: the nodes of the current generation's pipeline, in rank order (empty for a standby node)
    nodes: list[str]
    #: the membership watch of ``nodes`` (after ``open``)
    detector: LossDetector
    #: nodes that died while the job started (see ``start_without``); empty when all came up
    start_lost: frozenset[str] = frozenset()
    #: False once ``stop`` closed the store (after fit: collectives go through the process group again)
    active = True
    #: whether this node's lease may have lapsed when ``stop`` ran (``confirm_member`` refuses from then on)
    ended_fenced = False

    def __init__(
        self, store: Store, job: str, node: str, nodes: Sequence[str], *, groups: GroupFormer,
        detection_timeout: float, rendezvous_timeout: float, joining: bool = False,
        leave_requested: Callable[[], bool] = lambda: False, url: str = "", alive: str = "", machine_workers: int = 1,
    ) -> None:
        self.keys = JobKeys(job)
        self.url = url or str(getattr(store, "url", ""))
        self.job, self.node = job, node
        self.nodes = list(nodes) if not joining else []  # a joining node is in no pipeline until admitted
        self.groups = groups
        self.joining = joining
        self.detection_timeout = detection_timeout
        self.rendezvous_timeout = rendezvous_timeout
        #: whether this node was told to leave (a notice): read at every commit
        self.leave_requested = leave_requested
        self.generation = 0
        self.base = self.keys.base
        #: this node's liveness port (``membership.liveness``), published with its registration; empty: none
        self.alive = alive
        self._reachable: set[str] = set()  # the peers' liveness ports that answered this node (``learn_reachable``)
        meta: dict[str, Any] = {liveness.META_KEY: alive} if alive else {}
        if machine_workers > 1 and machine_of(node) != node:  # ``NAME.i``: one of the workers of machine NAME
            meta[MACHINE_WORKERS_KEY] = machine_workers
        self.registry = Registry(store, job, node, ttl=max(1.0, detection_timeout * 0.8), meta=meta or None)
        #: every write goes through the fence: nothing is written once this node may be declared lost
        self.store: Any = FencedStore(store, self.registry)
        self.failovers: list[Failover | Restart] = []
        self.leaving = False  # this node announced it leaves after the step in flight
        self.leavers: set[str] = set()  # peers that announced they leave (seen at a commit)
        self.admitting = False  # set by RebalanceCallback: standby nodes are reported at every commit
        self.joiners: list[str] = []  # standby nodes seen at the last commit (the same list on every node)
        self._collectives: dict[int, int] = {}  # generation -> collectives begun (see gather)
        self._collectives_dropped = 0  # generations below this have no collective keys left
        self._standing_since = 0  # the store's revision when this node registered as standby (see ``open``)
        # standby -> (key revision, when it changed, the revision seen before it: 0 when none)
        self._standby_seen: dict[str, tuple[int, float | None, int]] = {}
        self._machine_lost: dict[str, int] = {}  # machine -> the store's revision once a node of it was decided lost
        self._released_now: set[str] = set()  # released by the failover that formed this generation (``standby``)
        self._standby_looked: tuple[int, float] | None = None  # (store revision, when) of the last ``standby`` look
        self._gathering: dict[str, float] = {}  # machine -> when its standby workers were first held back for the rest

    @classmethod
    def from_environment(
        cls, detection_timeout: float, rendezvous_timeout: float, groups: GroupFormer,
        leave_requested: Callable[[], bool] = lambda: False,
    ) -> Session:
        """The session of a worker the Bamboo launcher started, opened (registered, past the start rendezvous
        or standing by): the store, job, node and nodes come from ``membership.node``'s variables."""
        from lightning_bamboo.membership import connect

        if not launched_by_bamboo():
            raise BambooError(f"a membership session needs the launcher's environment ({STORE_ENV} is not set); "
                              "start the job with `lightning-bamboo run` or `python -m lightning_bamboo.launcher`")
        url, node = os.environ[STORE_ENV], os.environ[NODE_ENV]
        nodes = [n for n in os.environ.get(NODES_ENV, node).split(",") if n]
        bound = request_timeout_for(detection_timeout)  # a slow store delays this node; only its lease loses it
        store = connect(url, timeout=bound, request_timeout=bound)
        session = cls(store, os.environ.get(JOB_ENV, "bamboo"), node, nodes, groups=groups,
                      detection_timeout=detection_timeout, rendezvous_timeout=rendezvous_timeout,
                      joining=joining(), leave_requested=leave_requested, url=url,
                      alive=liveness.listener(node_address()).address, machine_workers=_machine_workers())
        return session.open()

    def open(self) -> Session:
        """Register under a lease; then stand by (``joining``) or pass the job's start rendezvous. Returns self."""
        try:
            self.registry.join()
        except BaseException:
            self.store.close()
            raise
        if self.joining:
            # an admission names this standby node only after the running nodes saw this key: one written before
            # it (this node was in the job before, released or restarted since) is not for the node waiting now
            self._standing_since = self.store.put(self.keys.standby(self.node), "1")
        else:
            faults.reached(self.node, "start")  # tests: a node that dies while the job starts
            try:
                self.store.put(self.keys.reached(self.node), "1")  # its checks passed: the launcher starts the others
                self._start_rendezvous(self.rendezvous_timeout)
            except BaseException:
                self.registry.stop_heartbeat()  # this node never joined the job: leave nothing running
                self.store.close()
                raise
        self.detector = self._watch(self.nodes)
        self._learn_reachable_soon()
        return self

    def _start_rendezvous(self, timeout: float) -> None:
        """Wait for every node of the job to come up; a node announced dead meanwhile ends the wait at once.

        (Before any process group exists: a TCPStore rendezvous would wait its whole timeout for it.)
        A node lost before the process group formed leaves ``start_lost`` set, once every other node
        is up: the strategy then starts without it (``start_without``) instead of restarting the job. A worker's
        refusal of the job's configuration (the job's ``refused`` key) ends the wait too, the nodes not up counted
        in ``start_lost``: the front door then stops with the refusal.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                barrier(self.store, self.keys.rdzv(0), self.node, self.nodes, timeout=0.5)
            except BarrierTimeoutError:
                if time.monotonic() > deadline:
                    raise
            else:
                # Past the rendezvous this node waits in the process group's own, which cannot see a
                # loss: say so before looking (a node that sees a loss later also sees this key, and
                # ``start_without`` gives up on a start it cannot finish without us).
                self.store.put(self.keys.start_passed(self.node), "1")
                if not set(self.nodes) & set(self.registry.members().lost):
                    return
                self.store.delete(self.keys.start_passed(self.node))
            members = self.registry.members()
            gone = set(self.nodes) & set(members.lost)
            if gone and set(self.nodes) - gone <= set(members.live):
                self.start_lost = frozenset(gone)
                return
            if self.store.get(self.keys.refused) is not None:
                # a worker refused the job's configuration (before it registered, maybe): the nodes not up are as
                # lost, and the front door stops this one with the refusal's status (``runtime.refusal``)
                self.start_lost = frozenset(set(self.nodes) - set(members.live) - {self.node}) or frozenset(gone)
                return
            if time.monotonic() > deadline:
                raise BarrierTimeoutError(f"the job's nodes {self.nodes} did not all come up within {timeout} s "
                                          f"(lost: {sorted(gone)}, live: {sorted(members.live)})")

    def start_without(self, min_nodes: int) -> tuple[int, int]:
        """After a loss during the start (``start_lost``): form the job's process group of the nodes
        that are up (in the launch order), agreed through the store like a failover; returns
        (rank, world size). Nothing has trained yet, so nothing is lost but the dead nodes' places.
        Fewer than ``min_nodes`` left: ``FatalLoss`` (the job starts again when more are up).
        """
        launched = list(self.nodes)
        passed_prefix = self.keys.start_passed()

        def attempt(suspected: set[str]) -> tuple[int, int, set[str]]:
            lost = self.decide_lost(tuple(suspected), launched)
            order = [n for n in launched if n not in lost]
            passed = {kv.key[len(passed_prefix):] for kv in self.store.get_prefix(passed_prefix).kvs}
            if passed & set(order):
                raise FatalLoss(f"{sorted(lost)} died while the job started, after {sorted(passed & set(order))} had "
                                "passed the start rendezvous; start again with the nodes that are up")
            if self.node not in order:
                raise FatalLoss(f"the others count this node as lost while the job started (lost: {sorted(lost)}); "
                                "it stops, and starts again with the job")
            if len(order) < min_nodes:
                raise FatalLoss(f"{sorted(lost)} died while the job started, leaving {len(order)} of {len(launched)} "
                                f"nodes (at least {min_nodes} needed); start again with the nodes that are up")
            return (*self.reform(order, tag="start-" + "-".join(sorted(lost))), lost)

        rank, world, lost = self.until_agreed(
            attempt, set(self.start_lost), len(launched), (PeerLost, BarrierTimeoutError),
            lambda: FatalLoss(f"the start without lost nodes did not converge after {len(launched)} attempts"))
        log.warning("%s: %s died while the job started; starting with %d nodes", self.node, sorted(lost), world)
        self.start_lost = frozenset()
        return rank, world

    def _watch(self, nodes: list[str]) -> LossDetector:
        peers = [n for n in nodes if n != self.node]
        # A preemption notice is not a loss: the leaver finishes and commits its step, and the others
        # switch at the next step start (``leavers``). Counting it here would abort a step whose commit
        # the leaver is about to complete, and the nodes would disagree on whether it committed.
        return LossDetector(self.store, self.job, peers, poll=0.2, notice_counts=False).start()

    def learn_reachable(self, nodes: Collection[str] | None = None) -> None:
        """Probe the liveness ports of ``nodes`` (default: this generation's peers) and remember those that answer:
        a refusal or a silence counts only from a port that answered this node before (``probe_peers``). Run on a
        thread of its own when a generation forms (``open``, ``reform``)."""
        peers = set(self.nodes if nodes is None else nodes) - {self.node}
        try:
            addresses = self._liveness_addresses(peers, self.registry.members())
        except StoreError as err:
            log.debug("%s: liveness ports not read: %s", self.node, err)
            return
        found = liveness.probe(addresses)
        self._reachable |= {addresses[n] for n in found.answered}

    def _learn_reachable_soon(self) -> None:
        if self.alive:  # a session without a liveness port of its own (tests of the protocol) probes nobody
            threading.Thread(target=self.learn_reachable, args=(list(self.nodes),), name="bamboo-learn-reachable",
                             daemon=True).start()

    @staticmethod
    def _liveness_addresses(peers: Collection[str], members: Membership) -> dict[str, str]:
        """The liveness address each live node of ``peers`` published (those that published one)."""
        addresses = {n: str(members.nodes[n].meta.get(liveness.META_KEY, "")) for n in peers if n in members.live}
        return {n: a for n, a in addresses.items() if a}

    def probe_peers(self, nodes: Collection[str] | None = None, *, unreachable: bool = False) -> set[str]:
        """Probe the liveness ports of ``nodes`` (default: this generation's peers) and declare lost every one whose
        process is gone (its port refused: ``membership.liveness``); returns those declared. Called on a
        communication error and while a rendezvous waits, so that a dead node is lost at once, not a lease later,
        and every node of a machine killed together is lost in the same decision.

        ``unreachable`` (a step stalled): a peer whose machine answered neither of two connections is declared lost
        too, as its lease would be once its TTL ran out, when it is a minority of the peers probed and more of them
        answered than did not (a node cut off itself finds most of its peers silent, and declares nobody). Its lease
        is revoked, so that it is fenced at once: the store refuses its writes, and it can only come back as a new
        standby node.

        Only a port that answered this node before counts (``learn_reachable``): a firewall between the machines
        that rejects or drops connections to it says nothing about the process behind it."""
        peers = set(self.nodes if nodes is None else nodes) - {self.node}
        if not peers:
            return set()
        try:
            members = self.registry.members()
        except StoreError as err:
            log.debug("%s: no probe, the store did not answer: %s", self.node, err)
            return set()
        addresses = self._liveness_addresses(peers, members)
        found = liveness.probe(addresses)
        self._reachable |= {addresses[n] for n in found.answered}
        known = {n for n in addresses if addresses[n] in self._reachable}
        refused = set(found.refused & known)
        if refused:
            refused |= self._dying_with(refused, found.answered & known, addresses)
        silent: frozenset[str] = frozenset()
        if unreachable and found.unreachable and len(found.answered) > len(found.unreachable):
            silent = found.unreachable & known
        declared = set()
        for node in sorted(refused | silent):
            why = (f"its liveness port {addresses[node]} refused a connection: its process is gone"
                   if node in refused else
                   f"its machine answered no connection to {addresses[node]} within {liveness.PROBE_SECONDS:g} s")
            info = members.nodes[node]
            try:
                self.registry.announce_loss(node, why, incarnation=info.incarnation)
                if node in silent and info.lease:
                    self.store.revoke_lease(info.lease)  # announced as a member: its lease ends now
            except (StoreError, BambooError) as err:  # fenced, or the store is away: the lease decides
                log.debug("%s: could not declare %s lost: %s", self.node, node, err)
                continue
            declared.add(node)
        if declared:
            log.warning("%s: %s lost (%s)", self.node, sorted(declared),
                        "; ".join(f"{n}: {'refused' if n in refused else 'unreachable'}" for n in sorted(declared)))
        return declared

    def _dying_with(self, refused: Collection[str], answered: Collection[str], addresses: dict[str, str]) -> set[str]:
        """Those of ``answered`` on the machines of ``refused`` (``machine_of``: the launcher's machine, the failure
        domain the runtime places replicas by) whose ports refuse too within ``liveness.SIBLING_SECONDS``: the processes of a machine that dies close their ports one after
        another (each once the kernel has torn down its memory), and the survivors must agree on all of them in
        one decision, not act on the first (releasing nodes a larger set then counts as lost)."""
        machines = {machine_of(n) for n in refused}
        siblings = {n: addresses[n] for n in answered if machine_of(n) in machines}
        dying: set[str] = set()
        deadline = time.monotonic() + liveness.SIBLING_SECONDS
        while siblings and time.monotonic() < deadline:
            time.sleep(liveness.SIBLING_POLL_SECONDS)
            gone = liveness.probe(siblings).refused
            dying |= gone
            siblings = {n: a for n, a in siblings.items() if n not in gone}
        return dying

    def lost_peers(self) -> tuple[str, ...]:
        """The peers the membership watch saw lost, sorted."""
        return tuple(sorted(self.detector.lost))

    # ------------------------------------------------------------------ commits
    def commit(self, step: int) -> None:
        """Say our part of ``step`` is ready and wait (bounded, abortable) until everyone's is.

        Raises ``PeerLost`` naming the lost peers when one is lost first, ``BambooError`` after the
        rendezvous timeout (naming the nodes that did not commit), ``Fenced`` if this node may be lost.
        """
        prefix = self.keys.commit(self.generation, step)
        joiners_key = self.keys.joiners(self.generation, step)
        if self.admitting and self.nodes[0] == self.node:
            # Put before our commit key: whoever sees the step commit sees the same standby list.
            if standby := self.standby():
                self.store.put(joiners_key, json.dumps(standby))
        if not self.leaving and self.leave_requested():
            # Announce before our commit key: whoever sees the step commit also sees that we leave,
            # so the neighbours switch at the next step boundary and no work is lost.
            self.registry.announce_leaving(grace=self.detection_timeout)
            self.leaving = True
        self.store.put(prefix + self.node, "1")
        deadline = time.monotonic() + self.rendezvous_timeout
        revision = 0
        while True:
            snap = self.store.get_prefix(prefix)
            if {kv.key[len(prefix):] for kv in snap.kvs} >= set(self.nodes):
                leaving = self.store.get_prefix(self.keys.leaving())
                if leaving.kvs:  # rare: read the membership then, whose notices count only on their node's lease
                    self.leavers = set(self.registry.members().leaving) & set(self.nodes) - {self.node}
                else:
                    self.leavers = set()
                if self.admitting:
                    kv = self.store.get(joiners_key)
                    self.joiners = json.loads(kv.value) if kv is not None else []
                return
            if self.detector.event.is_set():
                raise PeerLost(f"lost {sorted(self.detector.lost)} before step {step} committed", self.detector.lost)
            if time.monotonic() > deadline:
                missing = sorted(set(self.nodes) - {kv.key[len(prefix):] for kv in snap.kvs})
                live = set(self.registry.members().live)
                raise BambooError(
                    f"step {step} did not commit within {self.rendezvous_timeout} s ({prefix}): no commit from "
                    f"{missing} ({', '.join(f'{n} live' if n in live else f'{n} not registered' for n in missing)}); "
                    "a live node that does not commit is stuck: its log says where"
                )
            # an etcd restart is ridden out here: the commit's own deadline bounds the wait
            change = wait_riding_out(self.store, prefix, max(revision, snap.revision), 0.2, deadline)
            revision = change.revision

    def committed(self, step: int) -> bool:
        prefix = self.keys.commit(self.generation, step)
        return {kv.key[len(prefix):] for kv in self.store.get_prefix(prefix).kvs} >= set(self.nodes)

    # ------------------------------------------------------------------ standby nodes and admission
    def standing_by(self) -> set[str]:
        """Every node that stands by now (its standby key is in the store), whether it can come or not."""
        return {kv.key.rsplit("/", 1)[1] for kv in self.store.get_prefix(self.keys.standby()).kvs}

    def standby(self) -> list[str]:
        """Live nodes waiting to join (registered as standby, not in the pipeline) that can come now, sorted.

        Called at every commit on the first node: the membership is read only when a standby key exists. A standby
        node refreshes its key while it waits (``wait_admission``); one whose key has not changed for
        ``STANDBY_FRESH_SECONDS`` of this node's clock (cut off, frozen: its lease may not have run out yet), or
        whose machine lost a node, until it is seen alive after that loss (``_alive_after_loss``), is not offered:
        an admission of it would be a reconfiguration with a node that cannot come.
        """
        now = time.monotonic()
        waiting = []
        snap = self.store.get_prefix(self.keys.standby())
        looked, self._standby_looked = self._standby_looked, (snap.revision, now)
        # a key put since this node's last look (a moment ago) answers as a key seen changing between two looks does
        since = looked[0] if looked is not None and now - looked[1] <= STANDBY_FRESH_SECONDS else None
        for kv in snap.kvs:
            node = kv.key.rsplit("/", 1)[1]
            if node in self.nodes:
                continue
            seen = self._standby_seen.get(node)
            if seen is None or seen[0] != kv.mod_revision:  # first seen: not known to answer yet, unless it was put
                # since the last look, or the failover that formed this generation released it a moment ago
                answered = seen is not None or node in self._released_now or (
                    since is not None and kv.mod_revision > since)
                self._standby_seen[node] = (kv.mod_revision, now if answered else None, seen[0] if seen else 0)
            changed = self._standby_seen[node][1]
            if changed is not None and now - changed <= STANDBY_FRESH_SECONDS and self._alive_after_loss(node):
                waiting.append(node)
        if not waiting:
            self._gathering.clear()
            return []
        members = self.registry.members()
        live = set(members.live)
        return self._gathered(sorted(n for n in waiting if n in live), members, now)

    def _gathered(self, ready: list[str], members: Membership, now: float) -> list[str]:
        """``ready`` less the workers of a machine whose other workers (as many as its registrations say its
        supervisor starts) are neither in the layout nor among ``ready`` yet, for at most ``MACHINE_GATHER_SECONDS``
        from when that machine was first held back: a machine's workers start together, and one reconfiguration
        admitting them all saves the job a second one a step later."""
        machines: dict[str, list[str]] = {}
        for node in ready:
            machines.setdefault(machine_of(node), []).append(node)
        for machine in set(self._gathering) - set(machines):
            del self._gathering[machine]  # its workers were admitted, or stopped waiting
        offered = []
        for machine, workers in machines.items():
            expected = max((_workers_of(info.meta) for name, info in members.nodes.items()
                            if machine_of(name) == machine), default=1)
            present = len(workers) + sum(1 for n in self.nodes if machine_of(n) == machine)
            if present < expected:
                since = self._gathering.setdefault(machine, now)
                if now - since < MACHINE_GATHER_SECONDS:
                    continue
                log.info("%s: machine %s has %d of its %d workers standing by after %.1f s; offering %s", self.node,
                         machine, present, expected, now - since, workers)
            self._gathering.pop(machine, None)
            offered += workers
        return sorted(offered)

    def offer_released(self, released: Collection[str], step: int) -> list[str]:
        """After the failover of ``step`` formed this generation: offer the nodes it ``released`` (their pipeline was
        dropped) for admission now, before the step is trained, instead of at the next commit. Every survivor
        proposes those of them that stand by already (their standby key is in the store, so an admission record put
        from now on is one they wait for) and whose machine lost no node lately (``standby``'s rule); the first
        proposal put wins, so every node's ``joiners`` are the same list. Returns it (empty when not ``admitting``)."""
        if not self.admitting or not released:
            return []
        standing = self.standing_by()
        proposal = sorted(n for n in set(released) & standing if self._alive_after_loss(n))
        _, kv = self.store.put_if_absent(self.keys.agreement("released-standby", self.generation, step),
                                         json.dumps(proposal))
        self.joiners = [n for n in json.loads(kv.value) if n not in self.nodes]
        return self.joiners

    def lost_machine(self, nodes: Collection[str]) -> None:
        """``nodes`` were lost: their machines' standby nodes are not offered until each is seen alive after it (see
        ``_alive_after_loss``)."""
        if nodes:
            revision = self.store.get_prefix(self.keys.standby()).revision  # the loss is decided by now
            for node in nodes:
                self._machine_lost[machine_of(node)] = revision

    def _alive_after_loss(self, node: str) -> bool:
        """Whether standby ``node`` lost no mate on its machine (``lost_machine``), or two of its refreshes have landed
        in the store since that loss was decided: the failure that took the mate (a machine killed, cut off, frozen)
        may have taken it too, and one refresh may have been sent before it; a second is sent only once the first
        was answered. It refreshes every ``STANDBY_BEAT_SECONDS``, so a live one is offered a moment after the loss,
        and one the failure took never is."""
        lost = self._machine_lost.get(machine_of(node))
        if lost is None:
            return True
        seen = self._standby_seen.get(node)
        return seen is not None and seen[2] > lost  # the refresh before the latest one came after the loss

    def admit(self, record: Reconfiguration) -> None:
        """Publish a reconfiguration (generation, order, parts...) so that the standby nodes in it join."""
        self.store.put(self.keys.admit(record.generation), record.to_json())

    def wait_admission(self, poll: float = 1.0, beat: float = STANDBY_BEAT_SECONDS) -> Reconfiguration | None:
        """Standby until a reconfiguration names this node (its record) or the job finishes (None).

        A standby node is live (its lease is kept) and costs nothing; it waits as long as the job runs.
        A job abandoned after a fatal loss (``lease.abandon_job``) ends the wait with ``FatalLoss``, as it
        ends the survivors' ``fit()``: the process may then serve the restarted job (``offer_process``). So does a
        job none of whose nodes has been live for a detection timeout (its nodes failed or were lost, and nobody
        will finish it): a standby node never outlives its job.

        The admissions are read whenever they change and every ``poll`` seconds (with whether the job finished or
        still runs); the standby key is put every ``beat`` seconds, so that the running nodes see it answer soon.
        """
        prefix = self.keys.admit()
        revision = 0
        alive, beats, looked, changed = _JobAlive(self), 0, None, False
        while True:
            now = time.monotonic()
            if changed or looked is None or now - looked >= poll:
                looked = now
                snap = self.store.get_prefix(prefix)
                records = sorted((json.loads(kv.value) for kv in snap.kvs if kv.mod_revision > self._standing_since),
                                 key=lambda r: r["generation"])
                mine = [r for r in records if self.node in r["order"]]
                if mine:
                    return Reconfiguration.from_json(mine[-1])
                abandoned = [r["abandoned"] for r in records if r.get("abandoned")]
                if abandoned:
                    raise FatalLoss(f"the job this standby node waited to join ended before admitting it: "
                                    f"{abandoned[0]}")
                if self.store.get(self.keys.finished) is not None:
                    return None
                alive.check()
                revision = max(revision, snap.revision)
            beats += 1  # this node still answers (the running nodes offer only standby nodes that do)
            try:
                self.store.put(self.keys.standby(self.node), str(beats))
            except Fenced as err:  # a standby holds nothing of the job's: it may register again (a loaded machine)
                self._register_again(err)
            change = self.store.wait_for_change(prefix, revision, timeout=beat)
            changed = bool(change.events) or change.compacted  # (compacted: what changed is not known)
            revision = max(revision, change.revision)

    def stand_by(self) -> None:
        """This node left the layout (released: ``release`` said so first, or its admission failed) and stands by in
        its process, under the same registration: no pipeline, nothing watched, its standby key put again (an
        admission of it from now on is one made for the node that waits now)."""
        self.detector.watch([])
        self.nodes, self.joining = [], True
        self.leaving, self.leavers, self.joiners = False, set(), []
        self._standing_since = self.store.put(self.keys.standby(self.node), "1")

    def _register_again(self, why: Fenced) -> None:
        """A standby node whose lease may have lapsed (its keep-alives starved: a loaded machine, a slow store)
        registers again instead of stopping: it held no stage, so nobody failed anything over for it."""
        log.warning("%s: %s; as a standby node it registers again", self.node, why)
        self.registry.leave(timeout=self.detection_timeout)  # its old lease and keys go now (if they have not)
        deadline = time.monotonic() + 3 * self.registry.ttl
        while True:
            try:
                self.registry.join()
                break
            except NodeIdInUseError:  # the store still holds the old incarnation's key: its lease ends by itself
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # bounded (a few leases) poll of the store's key
        self._standing_since = self.store.put(self.keys.standby(self.node), "1")

    def enter(self, record: Reconfiguration) -> tuple[int, int]:
        """Join the process group of an admission record (as a standby node); returns (rank, world size)."""
        self.generation = record.generation - 1
        rank, world = self.reform(list(record.order), tag=record.tag)
        self.store.delete(self.keys.standby(self.node))
        return rank, world

    def finish(self) -> None:
        """The job is over: standby nodes that were never admitted stop waiting. The value names the
        pipeline's nodes at the end (the launcher holds each of them to exit 0; a node the job lost or
        released before it finished is not one of them)."""
        self.store.put(self.keys.finished, json.dumps(list(self.nodes)))

    def record_reconfiguration(self, record: Reconfiguration) -> None:
        """The sender (the first node of the new order that ran before it; a joining node at rank 0 does not
        call this) keeps the record in the store, for reports (``reconfigurations/<generation>``)."""
        if record.sender == self.node:
            self.store.put(self.keys.reconfigurations(self.generation), record.to_json())

    # ------------------------------------------------------------------ collectives between steps
    def gather(self, value: str) -> list[str]:
        """One collective of the pipeline's nodes through the store: every node's ``value``, in rank order.

        Lightning's collectives between steps (barriers, broadcasts, reductions, checkpoint saves)
        go here, not through gloo: a loss fails the same collective on every survivor (see
        ``membership.collectives.gather``), so after the failover they all retry the same operation.
        Collectives are numbered per generation; the numbering restarts with each new process group.
        """
        generation, nodes = self.generation, list(self.nodes)
        seq = self._collectives.get(generation, 0)
        self._collectives[generation] = seq + 1
        try:
            # a peer that announced at the last commit that it leaves is gone by now: waiting for its part
            # would last until its lease ends (the failover that serves it comes at once instead)
            parts = gather(self.store, self.keys.coll(generation, seq), self.node, nodes, value,
                           self.rendezvous_timeout, lambda: self.detector.lost | self.leavers)
        except GatherFailed as err:
            raise PeerLost(str(err), set(err.lost) | self.detector.lost | self.leavers) from err
        if nodes[0] == self.node:  # everyone has put this one, so everyone is done with the ones before
            if seq:
                self.store.delete_prefix(self.keys.coll(generation, seq - 1) + "/")
            for old in range(self._collectives_dropped, generation):
                self.store.delete_prefix(self.keys.coll(old))
            self._collectives_dropped = generation
        return parts

    # ------------------------------------------------------------------ failover
    def until_agreed(self, attempt: Callable[[set[str]], T], suspected: set[str], attempts: int,
                     retry_on: tuple[type[BaseException], ...], exhausted: Callable[[], BaseException],
                     during: str = "") -> T:
        """Recovery's loop, one for every recovery (a failover, a restart after a fatal loss, a start without the
        lost): ``attempt(suspected)`` agrees on the lost set (``decide_lost``), re-forms and returns; a loss it meets
        (``retry_on``, naming the nodes it lost) joins ``suspected`` with every node the detector has seen lost, and
        the survivors agree again on the larger set. Each retry loses one more node, so at most ``attempts`` (the
        nodes) tries; then ``exhausted()`` is raised. ``during`` names the recovery in the log of a retry (empty:
        none logged)."""
        for _attempt in range(attempts):
            try:
                return attempt(suspected)
            except retry_on as again:
                suspected |= set(getattr(again, "lost", ())) | self.detector.lost
                if during:
                    log.warning("%s: another loss %s (%s); trying again with %s", self.node, during, again,
                                sorted(suspected))
        raise exhausted()

    def decide_lost(self, suspected: tuple[str, ...], nodes: list[str]) -> set[str]:
        """The lost nodes for the next generation: a set in the store that only grows, so all agree.

        Each survivor adds what it knows (its suspicions, the detector, dead leases) with a
        compare-and-swap; a loss seen later by anyone makes everyone retry with the larger set. A node in it that
        stands by (released by an earlier attempt of the failover) lost no machine (``lost_machine``).
        """
        lost = self._decide_lost(suspected, nodes)
        self.lost_machine(lost - self.standing_by() - self.released(self.generation + 1))
        return lost

    def _decide_lost(self, suspected: tuple[str, ...], nodes: list[str]) -> set[str]:
        key = self.keys.decision(self.generation + 1)
        members = self.registry.members()
        mine = (set(suspected) | self.detector.lost | (set(nodes) - set(members.live))) & set(nodes)
        mine.discard(self.node)
        while True:
            kv = self.store.get(key)
            current = set(json.loads(kv.value)) if kv else set()
            merged = current | mine
            if self.node in current:  # declared lost itself: it follows the decision, never adds to it
                return current
            if kv is not None and merged == current:
                return current
            swapped, _ = self.store.compare_and_put(key, json.dumps(sorted(merged)), expected_revision=kv.mod_revision if kv else 0)
            if swapped:
                return merged

    def reform(self, order: list[str], tag: str = "") -> tuple[int, int]:
        """Join the process group of ``order`` for the next generation; returns (rank, world size).

        The rendezvous waits in short slices and gives up at once (``PeerLost``) when a node it
        waits for is lost, so a failover never waits on a dead node; or when one left this generation's layout
        released (it acted on a smaller lost set than the one this node formed its order from: it stands by, and
        will not come), which then counts as lost for the order.
        """
        generation = self.generation + 1
        prefix = self.keys.rdzv(generation, tag)
        if set(order) - set(self.nodes) - {self.node}:
            self.detector.watch([n for n in order if n != self.node])  # newcomers too: none may be waited on dead
        deadline = time.monotonic() + self.rendezvous_timeout
        while True:
            gone = self.detector.lost & set(order)
            if gone:
                raise PeerLost(f"{sorted(gone)} lost while re-forming the pipeline", gone)
            away = self.released(generation) & set(order) - {self.node}
            if away:
                raise PeerLost(f"{sorted(away)} released from the layout while re-forming the pipeline", away)
            try:
                barrier(self.store, prefix, self.node, order, timeout=0.25)
                break
            except BarrierTimeoutError:
                if time.monotonic() > deadline:
                    raise
                # a node of a machine killed with the one this failover is for keeps its lease until its TTL
                # runs out: its refused port says it is gone now, and the survivors agree again without it
                base = prefix.rstrip("/") + "/"
                arrived = {kv.key[len(base):] for kv in self.store.get_prefix(base).kvs}
                dead = self.probe_peers(set(order) - arrived)
                if dead:
                    raise PeerLost(f"{sorted(dead)} gone while re-forming the pipeline", dead) from None
        rank, world = self.groups.reform(self.store, self.job, generation, order, self.node,
                                         timeout=self.rendezvous_timeout, tag=tag,
                                         gone=lambda: self.detector.lost & set(order))
        self.generation = generation
        self.nodes = list(order)
        self.leavers &= set(order)  # a leaver the new layout does not hold is served (or the job restarted without it)
        self.joiners = []  # the standby nodes of the last generation's commits: the new one's first commit says again
        self.detector.stop(wait=False)  # (its thread may be inside a store watch: the new one starts now)
        self.detector = self._watch(self.nodes)
        if self.admitting and self.nodes[0] == self.node:
            # the nodes the failover that formed this generation released stand by now, in their processes: they
            # are offered at the first commit that sees them standing by, not the second
            self._released_now = self.released()
            self.standby()
        self._learn_reachable_soon()
        return rank, world

    def confirm_member(self, what: str) -> None:
        """Raise ``Fenced`` unless the store still counts this node as a member (a guarded write to
        ``confirmed/<node>``): asked before an act the store does not see, a checkpoint commit.

        Once the session has stopped (the job is over, nobody fails this node over any more) it
        answers from how it stopped: refused if its lease may have ended by then."""
        if not self.active:
            self.check_member(what)
            return
        self.store.confirm(self.keys.confirmed(self.node), what)

    def check_member(self, what: str) -> None:
        """Raise ``Fenced`` if this node may have been declared lost, without a round trip to the store: while the
        session runs, once its lease may have ended (``FencedStore.check``); once it stopped (the job is over: a save
        after it, say), only if its lease may have ended by then, as ``confirm_member`` answers."""
        if not self.active:
            if self.ended_fenced:
                raise Fenced(f"{self.node} refuses to {what}: its membership ended while its lease may have "
                             "lapsed, so its peers may have declared it lost")
            return
        self.store.check(what)

    def release(self, left_out: bool = False) -> None:
        """Say that this node leaves the layout of the next generation released, not lost (see ``released``).

        ``left_out``: a survivor that a restart's shape has no place for (``runtime.restart``). Every survivor
        computes that shape from the agreed lost set alone, so such a mark must not change the count it is computed
        from (``released(..., left_out=False)`` skips it); the rendezvous still counts it as away, so a retry whose
        shape has room for it again (another node lost inside the restart) agrees on a set without it at once
        instead of waiting for it the whole rendezvous timeout."""
        self.store.put(self.keys.released(self.generation + 1, self.node), LEFT_OUT if left_out else "1")

    def released(self, generation: int | None = None, left_out: bool = True) -> set[str]:
        """The nodes released from the layout of ``generation`` (default: the current one, read after the failover
        that formed it; ``generation + 1`` while a failover or a restart forms the next); without those a restart
        left out where ``left_out`` is False."""
        prefix = self.keys.released(self.generation if generation is None else generation)
        return {kv.key[len(prefix):] for kv in self.store.get_prefix(prefix).kvs if left_out or kv.value != LEFT_OUT}

    def record_failover(self, record: Failover | Restart) -> None:
        """Keep ``record``; the layout's first node also puts it in the store (``failovers/<generation>``)."""
        self.failovers.append(record)
        if self.nodes and self.nodes[0] == self.node:
            self.store.put(self.keys.failovers(self.generation), record.to_json())

    def depart(self) -> None:
        """Leave the job now (after our last step committed): the others serve our stage from its replica.

        The generation's communication is aborted (nothing of this node may still be in flight with
        them) and the process exits with status 0 through ``SystemExit``: the framework's teardown
        finds every collective ended at once instead of waiting on the others."""
        log.warning("%s: leaving after a preemption notice", self.node)
        self.stop()
        self.groups.abort()
        raise SystemExit(0)

    def stop(self) -> None:
        """Stop watching, stop the heartbeat (the lease ends a TTL later) and close the store. Idempotent."""
        if self.active:  # the first stop says how it ended
            self.ended_fenced = bool(self.store.fenced)
        self.active = False
        try:
            if hasattr(self, "detector"):
                self.detector.stop()
            self.registry.stop_heartbeat()
            self.store.close()
        except Exception as err:  # noqa: BLE001 - best effort at exit
            log.debug("membership stop: %s", err)


class _JobAlive:
    """A standby node's view of whether the job it waits for still runs: ``check`` raises ``FatalLoss`` once no node
    of the job (a live member that is not standing by) has been live for the detection timeout, having been seen
    live before or the job having formed before this node came (a standby machine may come up before the job
    forms)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.seen = False
        self.gone_since: float | None = None

    def check(self) -> None:
        s = self.session
        running = set(s.registry.members().live) - s.standing_by() - {s.node, "launcher"}
        if running:
            self.seen, self.gone_since = True, None
            return
        if not self.seen:
            # the job formed before this node came (its nodes passed the start), and has nobody running now: it
            # may have ended while this node came up, and then nobody would ever admit it or finish the job
            if not s.store.get_prefix(s.keys.start_passed()).kvs:
                return  # (a standby machine may come up before the job forms)
            self.seen = True
        now = time.monotonic()
        self.gone_since = self.gone_since if self.gone_since is not None else now
        if now - self.gone_since > s.detection_timeout:
            raise FatalLoss(f"the job {s.job!r} that {s.node} waited to join ended without finishing: none of its "
                            f"nodes has been live for {s.detection_timeout:g} s")
