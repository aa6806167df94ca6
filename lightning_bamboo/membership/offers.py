"""A process offered to the next job: a worker whose job ended (a fatal loss, an abandoned standby) waits here for an
assignment instead of exiting, and runs again without a new interpreter (no imports: seconds saved per node).

The launcher's ``Cluster.reuse`` and the demo's pool assign offered processes (``keys.offer``/``keys.assign``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from lightning_bamboo.membership.node import JOB_ENV, JOIN_ENV, NODE_ENV, STORE_ENV, leave_idle_priority


def offer_process(timeout: float = 60.0) -> dict[str, Any] | None:
    """Offer this worker's process to the job that follows its failed one; wait for an assignment.

    Called by a worker whose job ended with a fatal loss (a standby node's too, once its job was
    abandoned), after releasing what the job held (``lightning_bamboo.strategy.bamboo.release_for_restart``).
    Returns ``{"env": ..., "args": ..., "log": ...}``: set the environment, write to the log file if one is
    named, and run the worker again with the arguments (a restart from the last checkpoint without a new interpreter: no imports, seconds saved
    per node), or None when no assignment came within ``timeout`` seconds (exit then; the launcher
    starts a fresh process)."""
    from lightning_bamboo.membership import connect
    from lightning_bamboo.membership.keys import JobKeys
    from lightning_bamboo.membership.watch import wait_for_key

    keys, node = JobKeys(os.environ[JOB_ENV]), os.environ[NODE_ENV]
    store = connect(os.environ[STORE_ENV])
    try:
        store.put(keys.offer(node), "1")
        kv = wait_for_key(store, keys.assign(node), timeout)
        if kv is None:
            return None
        assignment = dict(json.loads(kv.value))
        if JOIN_ENV not in assignment["env"]:
            # it serves the job now (a standby node or a pooled process waited at idle priority); as a standby
            # node again it waits at the priority it has until admitted
            leave_idle_priority()
            os.environ.pop(JOIN_ENV, None)  # it ran as a standby node, and runs in the pipeline now
        return assignment
    finally:
        store.close()
