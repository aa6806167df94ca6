"""The process a released node's process id lives on in while its standby incarnation runs (``standby.hand_over``).

Run as ``python -I -S proxy.py PID`` (no site packages, nothing of this package imported: milliseconds), where
``PID`` is its child, the standby process. Every signal it can catch goes on to that child; signals sent while the
released process turned into this one were blocked (the mask lives through ``exec``) and arrive now. It reaps what
the released process left (its communication zygote) and ends as the child ends: the same exit status, or killed
by the same signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import NoReturn


def main(child: int) -> NoReturn:
    def forward(number: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, number)

    for number in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD}:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(number, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # nothing left to wait for (the child was reaped elsewhere): its status is unknown
            sys.exit(1)
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed: this process too, by the same signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(int(sys.argv[1]))
