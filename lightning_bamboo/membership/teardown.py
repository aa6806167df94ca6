"""How a forked helper process ends when it ran none of a worker's code, without the interpreter's teardown."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave_without_teardown(flush: bool) -> NoReturn:
    """End a forked helper that ran none of a worker's code (the communication zygote, a communication process) with status 0 and without the interpreter's teardown: that teardown writes every page
    of the preloaded heap the helper shares with its worker (0.8 s of a core per process here, at every job's end)
    and makes torch's C++ complain about its process groups' threads. Nobody reads such a helper's status.

    ``flush``: the helper's own output first. Only a helper that printed may: one that printed nothing would write
    the buffer it inherited from the worker at the fork a second time. The package's only
    process exit that skips the teardown (``tests/test_architecture.py`` lists its callers)."""
    if flush:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)
