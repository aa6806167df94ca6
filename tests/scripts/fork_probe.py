"""Run by tests/test_forks.py as a worker forked by a ForkServer (``python -m tests.scripts.fork_probe``): prints what
it was given and what it inherited as one JSON line, registers an atexit line, then ends as its first argument says."""

import atexit
import json
import os
import random
import signal
import sys
import time

atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({
    "pid": os.getpid(), "argv": sys.argv[1:], "orig_argv": sys.orig_argv, "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_")}, "random": random.random(),
    "main": __name__, "file": os.path.basename(__file__), "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "signals": {name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGPIPE", "SIGXFSZ", "SIGTERM")},
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "log_level": __import__("logging").getLogger("lightning_bamboo").level if "lightning_bamboo.logs" in sys.modules else None,
    "ppid": os.getppid(), "session_leader": os.getsid(0) == os.getpid(), "local_rank": os.environ.get("LOCAL_RANK"),
    "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
    "preloaded": "tests.scripts.fork_probe" in sys.modules and sys.modules["tests.scripts.fork_probe"] is not sys.modules["__main__"],
}), flush=True)
how = sys.argv[1]
if how == "sleep":
    time.sleep(60)
elif how == "raise":
    raise RuntimeError("the probe fails")
sys.exit(int(how))
