"""Run by tests/test_forks.py as a job's node forked by a ForkServer (``python -m tests.scripts.release_probe``): the
first incarnation prints what it is and is released (``rejoin_as_standby``) with a thread still blocked; the standby
incarnation prints what it is, then waits for SIGUSR1 and ends with status 7 (or as its argument says)."""

import json
import os
import signal
import sys
import threading

preloaded = "tests.helpers" in sys.modules  # before this script imports anything: a fork of the preloaded server

from lightning_bamboo.membership import node, standby  # noqa: E402

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # taken by sigwait below, before the test sends it
report = {"pid": os.getpid(), "ppid": os.getppid(), "join": os.environ.get(node.JOIN_ENV),
          "node": os.environ.get(node.NODE_ENV), "preloaded": preloaded, "argv": sys.argv[1:],
          "zygote": standby.zygote.pid if standby.zygote else None,
          "threads": threading.active_count(), "idle": os.sched_getscheduler(0) == getattr(os, "SCHED_IDLE", -1)}
print(json.dumps(report), flush=True)
if sys.argv[1] == "end":
    sys.exit(0)
if os.environ.get(node.JOIN_ENV) != "1":
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # blocked for good, as on a dead group
    node.rejoin_as_standby()
signal.sigwait({signal.SIGUSR1})
sys.exit(7)
