"""The store's key layout: everything about a job lives under ``/bamboo/<job>/``; the names allowed in it."""

from __future__ import annotations

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
#: under a job's prefix: put by whoever restarts a job that ended with a fatal loss (``registry.abandon_job``), as
#: an admission record that names no node (``{"generation": -1, "order": [], "abandoned": reason}``), so that
#: standby nodes, which watch ``admit/``, stop waiting at once and may offer their process to the next job
ABANDONED_KEY = "admit/abandoned"


def job_prefix(job: str) -> str:
    """The key prefix that holds everything about ``job``."""
    return f"{ROOT}/{check_name('job name', job)}/"
