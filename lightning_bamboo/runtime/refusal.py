"""A bad configuration is refused once, in a few lines, with exit status :data:`CONFIG_EXIT_CODE`: for both front
doors (``BambooStrategy`` and ``lightning_bamboo.initialize``).

Under the Bamboo launcher every worker runs the user's script, so every worker that starts finds the same mistake
(the launcher starts a machine's other workers only once its first one is past its checks, so most mistakes meet
one process). :func:`refused_quietly` turns a :class:`BambooConfigError` raised inside it into one message, printed
by the first worker to refuse (agreed in the membership store), and that exit status; the launcher then stops the
other workers and exits with it. Outside the launcher, :func:`report_config_errors_briefly` prints an uncaught one
as its rule and the user's line that met it.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_bamboo.errors import CONFIG_EXIT_CODE, BambooConfigError
from lightning_bamboo.membership.node import JOB_ENV, NODE_ENV, STORE_ENV
from lightning_bamboo.membership.session import Session, launched_by_bamboo

__all__ = ["TRACEBACK_ENV", "refused_quietly", "report_config_errors_briefly", "speaks", "stop_if_refused"]


def speaks() -> bool:
    """This worker says what the whole job would say: the first of its workers to refuse (a key in the membership
    store, created once), or any that cannot reach the store."""
    from lightning_bamboo.membership import connect
    from lightning_bamboo.membership.keys import JobKeys

    try:
        store = connect(os.environ[STORE_ENV], timeout=2.0)
        try:
            won, _ = store.put_if_absent(JobKeys(os.environ.get(JOB_ENV, "bamboo")).refused,
                                         os.environ.get(NODE_ENV, ""), timeout=2.0)
            return won
        finally:
            store.close()
    except Exception:  # noqa: BLE001 - better said twice than not at all
        return True


@contextmanager
def refused_quietly() -> Iterator[None]:
    """Under the Bamboo launcher, a ``BambooConfigError`` inside: one message (the first worker's to refuse) and exit status
    ``CONFIG_EXIT_CODE`` everywhere, without a traceback. Elsewhere the error passes as it is."""
    if not launched_by_bamboo():
        yield
        return
    try:
        yield
    except BambooConfigError as err:
        if speaks():
            print(f"lightning_bamboo: the job was refused before it trained: {err}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        raise SystemExit(CONFIG_EXIT_CODE) from None


def stop_if_refused(session: Session | None) -> None:
    """A node of the job was lost before the job trained: if a worker refused the job's configuration (the
    ``refused`` key its :func:`refused_quietly` put; it said why), this one stops too, quietly, with the refusal's
    status, instead of going on without it: a configuration that one worker refuses is the whole job's mistake, and
    every machine's launcher then ends with that status. Nothing else happens when no worker refused."""
    if session is None:
        return
    refused = session.store.get(session.keys.refused)
    if refused is None:
        return
    print(f"lightning_bamboo: {session.node} stops: {refused.value or 'a worker'} refused the job's configuration",
          file=sys.stderr, flush=True)
    session.stop()
    raise SystemExit(CONFIG_EXIT_CODE)


#: set to 1 to see the whole traceback of a refused configuration
TRACEBACK_ENV = "BAMBOO_TRACEBACK"


def report_config_errors_briefly() -> None:
    """From now on a ``BambooConfigError`` that ends the program is printed as its rule and the line of the user's
    code that met it, without Python's traceback (``BAMBOO_TRACEBACK=1`` keeps it); any other exception is
    printed as before. The error itself is raised unchanged, so ``except``/``pytest.raises`` and notebooks see it
    as they would; this changes only what an uncaught one prints (under Lightning's own launcher the options are
    refused in the launching process, through here). Installed once, in front of whatever hook was there."""
    if getattr(sys.excepthook, "_bamboo_brief", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not isinstance(value, BambooConfigError) or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            previous(kind, value, tb)
            return
        print(f"lightning_bamboo: the job was refused before it trained: {value}", file=sys.stderr)
        here = _user_frame(tb)
        if here is not None:
            print(f"  (met at {here.filename}:{here.lineno}: {here.line}; {TRACEBACK_ENV}=1 prints the traceback)",
                  file=sys.stderr)
        sys.stderr.flush()

    hook._bamboo_brief = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback in the user's code: outside this package and outside installed ones."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_tb(tb) if not os.path.abspath(f.filename).startswith(ours + os.sep)
              and "-packages" + os.sep not in f.filename and not f.filename.startswith("<")]
    return frames[-1] if frames else None
