"""The store's key layout: everything about a job lives under ``/bamboo/<job>/``; the names allowed in it."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_bamboo.errors import BambooConfigError

#: Root of every key this module writes: ``/bamboo/<job>/...``.
ROOT = "/bamboo"


def check_name(kind: str, name: str) -> str:
    if not name or "/" in name or not name.isprintable() or name.strip() != name:
        raise BambooConfigError(
            f"a {kind} must be a non-empty printable name without '/' or surrounding spaces (got {name!r}); "
            "e.g. 'node3' or 'gpt-demo'"
        )
    return name


#: under a job's prefix: set by the node that ends the job (``Session.finish``); standby nodes and the
#: launcher read it. Its value: the JSON list of the pipeline's nodes at the end (``"1"`` from older writers)
FINISHED_KEY = "finished"
#: under a job's prefix: put by whoever restarts a job that ended with a fatal loss (``lease.abandon_job``), as
#: an admission record that names no node (``{"generation": -1, "order": [], "abandoned": reason}``), so that
#: standby nodes, which watch ``admit/``, stop waiting at once and may offer their process to the next job
ABANDONED_KEY = "admit/abandoned"


def job_prefix(job: str) -> str:
    """The key prefix that holds everything about ``job``."""
    return f"{ROOT}/{check_name('job name', job)}/"


@dataclass(frozen=True)
class JobKeys:
    """Every key of one job's store, in one place: ``JobKeys(job).commit(generation, step)`` and so on.

    A method given every part returns a key; one whose last part is left out (None) returns the
    prefix that holds all of them, ending in ``/``, for ``get_prefix`` and ``wait_for_change``.
    The values are JSON (records) or ``"1"`` (flags); ``docs/membership.md`` says who writes each.
    """

    job: str

    def __post_init__(self) -> None:
        check_name("job name", self.job)

    @property
    def base(self) -> str:
        """``/bamboo/<job>/``: the prefix of everything below."""
        return job_prefix(self.job)

    def _under(self, kind: str, *parts: object) -> str:
        if parts and parts[-1] is None:
            return self.base + "/".join([kind, *(str(p) for p in parts[:-1])]) + "/"
        return self.base + "/".join([kind, *(str(p) for p in parts)])

    # -- the nodes (registry)
    def node(self, node: str | None = None) -> str:
        """``nodes/<id>``: a node's registration (NodeInfo JSON, on its lease)."""
        return self._under("nodes", node)

    def leaving(self, node: str | None = None) -> str:
        """``leaving/<id>``: a preemption notice (on the node's lease)."""
        return self._under("leaving", node)

    def lost(self, node: str | None = None) -> str:
        """``lost/<id>``: a loss notice (no lease; cleared by the reconfiguration)."""
        return self._under("lost", node)

    def confirmed(self, node: str) -> str:
        """``confirmed/<id>``: the guarded write a node makes before a checkpoint commit (``confirm_member``)."""
        return self._under("confirmed", node)

    # -- steps and generations (session)
    def rdzv(self, generation: int, tag: str = "") -> str:
        """``rdzv/<generation>/<tag>``: the barrier before a generation's process group forms (0: the start)."""
        return self._under("rdzv", generation, tag)

    def start_passed(self, node: str | None = None) -> str:
        """``rdzv/0-passed/<id>``: a node past the start rendezvous (``start_without`` cannot drop it then)."""
        return self._under("rdzv", "0-passed", node)

    def process_group(self, generation: int, tag: str = "") -> str:
        """``pg/<generation>/<tag>``: where the new rank 0 hosts the process group's TCPStore (JSON host, port)."""
        return self._under("pg", generation, tag)

    def commit(self, generation: int, step: int, node: str | None = None) -> str:
        """``commit/<generation>/<step>/<id>``: a node's part of ``step`` is in; the step commits when all are."""
        return self._under("commit", generation, step, node)

    def decision(self, generation: int) -> str:
        """``decision/<generation>``: the lost set the generation is formed without (JSON list, grown by CAS)."""
        return self._under("decision", generation)

    def released(self, generation: int, node: str | None = None) -> str:
        """``released/<generation>/<id>``: a node that leaves that generation's layout released, not lost."""
        return self._under("released", generation, node)

    def coll(self, generation: int, seq: int | None = None) -> str:
        """``coll/<generation>/<n>``: the n-th collective between steps of a generation (``gather``); with no
        ``seq`` the generation's prefix."""
        return self._under("coll", generation) + "/" if seq is None else self._under("coll", generation, seq)

    # -- standby nodes and admission
    def standby(self, node: str | None = None) -> str:
        """``standby/<id>``: a node waiting to join."""
        return self._under("standby", node)

    def joiners(self, generation: int, step: int) -> str:
        """``joiners/<generation>/<step>``: the standby list the first node saw at that commit (JSON list)."""
        return self._under("joiners", generation, step)

    def admit(self, generation: int | None = None) -> str:
        """``admit/<generation>``: the reconfiguration that admits standby nodes (JSON record)."""
        return self._under("admit", generation)

    @property
    def abandoned(self) -> str:
        """``admit/abandoned`` (``ABANDONED_KEY``): a job ended by a fatal loss, as an admission naming no node."""
        return self.base + ABANDONED_KEY

    @property
    def finished(self) -> str:
        """``finished`` (``FINISHED_KEY``): the job is over; the JSON list of its nodes at the end."""
        return self.base + FINISHED_KEY

    # -- records for reports, and topics of the runner
    def failovers(self, generation: int | None = None) -> str:
        """``failovers/<generation>``: the failover record that formed the generation (JSON, by its first node)."""
        return self._under("failovers", generation)

    def reconfigurations(self, generation: int | None = None) -> str:
        """``reconfigurations/<generation>``: the reconfiguration record (JSON, by its sender)."""
        return self._under("reconfigurations", generation)

    def topic(self, topic: str, node: str | None = None) -> str:
        """``<topic>/<id>``: a node's entry of a published topic (``PipelineRunner.publish``)."""
        return self._under(check_name("topic", topic), node)

    def progress(self, node: str | None = None) -> str:
        """``progress/<id>``: the step a node reached (the demo's controller reads it)."""
        return self.topic("progress", node)

    def agreement(self, topic: str, generation: int, step: int) -> str:
        """``<topic>/<generation>/<step>``: one value every node agrees on (``PipelineRunner.agree``)."""
        return self._under(check_name("topic", topic), generation, step)

    # -- the launcher
    @property
    def master(self) -> str:
        """``master``: the initial process group's address, for per-node supervisors."""
        return self.base + "master"

    @property
    def refused(self) -> str:
        """``refused``: the first worker's refusal of the job's configuration."""
        return self.base + "refused"

    def reached(self, node: str | None = None) -> str:
        """``reached/<node>``: the node's script got past its checks to the job's start rendezvous (the launcher
        starts a machine's other workers once its first one has)."""
        return self._under("reached", node)

    def offer(self, process: str | None = None) -> str:
        """``offer/<process>``: a process that offers itself to a job (``membership.offers.offer_process``)."""
        return self._under("offer", process)

    def assign(self, process: str) -> str:
        """``assign/<process>``: what the launcher gives an offered process (JSON: name, environment, arguments)."""
        return self._under("assign", process)
