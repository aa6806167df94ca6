"""A machine's supervisor's exit status: the job's outcome as this machine saw it.

Its workers may be gone long before the job ends: a supervisor whose workers all exited 0 (each finished the job,
left after a notice, or was told as a standby that the job finished) reports 0; one some of whose workers were
SIGKILLed (vanished spot nodes) and the rest exited 0 waits for the job to end, and reports that: 0 once a node of
the job marked it finished (``Session.finish``), 1 once no node of the job has been live for a while (nobody will
finish it). A worker that refused the configuration makes it 2, one that failed (any other status)
that status; a worker still in the job when it finished must have exited 0.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_bamboo.errors import CONFIG_EXIT_CODE

#: seconds without a live node of the job (and without its end marked) after which a supervisor reports it failed
JOB_GONE_SECONDS = 30.0


def worker_status(codes: Mapping[str, int], workers: Sequence[str]) -> int | None:
    """The status the workers' own exit codes decide (2: one refused; another failure's code), or None when each
    exited 0 or was SIGKILLed: then the job's end decides (``machine_status``)."""
    mine = [codes[w] for w in workers if w in codes]
    if CONFIG_EXIT_CODE in mine:  # a refusal: the others here were stopped for it (killed), not failed
        return CONFIG_EXIT_CODE
    failed = [c for c in mine if c not in (0, -signal.SIGKILL)]
    return failed[0] if failed else None


def machine_status(cluster: Any, workers: Sequence[str], poll: float = 1.0, gone_after: float = JOB_GONE_SECONDS) -> int:
    """This machine's exit status, once its ``workers`` (of ``cluster``, a ``launcher.cluster.Cluster``) ended."""
    from lightning_bamboo.membership.watch import read_membership

    decided = worker_status(cluster.codes, workers)
    if decided is not None:
        return decided
    if not any(cluster.codes.get(w) == -signal.SIGKILL for w in workers):
        return 0  # every worker here ended cleanly (finished, left after a notice, or told the job finished)
    said, gone_since = False, None
    while True:
        finished = cluster.finished_nodes()
        if finished is not None:
            failed = sorted(w for w in workers if w in finished and cluster.codes.get(w) != 0)
            if failed:
                print(f"[launcher] {', '.join(failed)} still in the job when it finished but did not exit 0",
                      file=sys.stderr, flush=True)
            return 1 if failed else 0
        try:
            live = read_membership(cluster.store, cluster.job).live
        except Exception:  # noqa: BLE001 - a store that does not answer (this machine cut off): as if none were live
            live = ()
        now = time.monotonic()
        gone_since = None if live else (gone_since or now)
        if gone_since is not None and now - gone_since > gone_after:
            print(f"[launcher] the job {cluster.job!r} ended without finishing: none of its nodes has been live for "
                  f"{gone_after:g} s", file=sys.stderr, flush=True)
            return 1
        if not said:
            said = True
            print("[launcher] this machine's workers have ended; waiting for the job's end to report it",
                  file=sys.stderr, flush=True)
        time.sleep(poll)  # a bounded poll of the store: the job's end is a key another machine writes
