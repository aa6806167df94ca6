"""The embedded store's requests: one JSON object a line, checked against its operation's signature (and the shared
token, where the server has one) before anything runs; whatever else arrives is answered with an error.

A request is ``{"op": NAME, ARGUMENT: VALUE, ..., "guard": [KEY, LEASE]?, "token": TOKEN?}``; ``OPS`` lists every
operation's arguments and their types. A line longer than ``MAX_REQUEST_BYTES`` is refused unread (etcd's own
limit is 1.5 MiB a request by default: nothing larger would work on etcd either).
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Any

#: the longest request line the server reads; a longer one is answered with an error and its connection closed
MAX_REQUEST_BYTES = 8 << 20

#: every operation: its arguments, each with its type and whether it may be left out
OPS: dict[str, dict[str, tuple[type, bool]]] = {
    "put": {"key": (str, True), "value": (str, True), "lease": (int, False)},
    "get": {"key": (str, True)},
    "get_prefix": {"prefix": (str, True)},
    "delete": {"key": (str, True)},
    "delete_prefix": {"prefix": (str, True)},
    "cas": {"key": (str, True), "value": (str, True), "expected_revision": (int, True), "lease": (int, False)},
    "grant": {"ttl": (float, True)},
    "keep_alive": {"lease": (int, True)},
    "revoke": {"lease": (int, True)},
    "wait": {"prefix": (str, True), "after_revision": (int, True), "timeout": (float, True)},
}
#: the operations that write, and so may carry a guard
GUARDED = frozenset({"put", "delete", "delete_prefix", "cas"})


class BadRequest(ValueError):
    """A request that is not one of ``OPS`` as specified; the message says what is wrong with it."""


class Unauthorized(BadRequest):
    """A request without the server's shared token, or with another one."""


def parse_request(line: bytes, token: str | None) -> tuple[str, dict[str, Any], tuple[str, int] | None]:
    """``(op, arguments, guard)`` of one request line; ``BadRequest`` (``Unauthorized``) for anything else."""
    try:
        req = json.loads(line)
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"a request is one JSON object a line ({type(err).__name__})") from None
    if not isinstance(req, dict):
        raise BadRequest(f"a request is a JSON object, not a {type(req).__name__}")
    given = req.pop("token", None)
    if token is not None and not (isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())):
        raise Unauthorized("this store needs its shared token in every request" + (
            "; the one given differs" if given is not None else ""))
    op = req.pop("op", None)
    if not isinstance(op, str) or op not in OPS:
        raise BadRequest(f"unknown op {str(op)[:40]!r}: one of {', '.join(OPS)}")
    guard = req.pop("guard", None)
    if guard is not None:
        if op not in GUARDED or not (isinstance(guard, list) and len(guard) == 2 and isinstance(guard[0], str)
                                     and _int(guard[1]) and guard[1] >= 0):
            raise BadRequest(f"a guard is [KEY, LEASE] on one of {', '.join(sorted(GUARDED))} (op {op!r})")
        guard = (guard[0], guard[1])
    spec = OPS[op]
    unknown = sorted(set(req) - set(spec))
    missing = sorted(name for name, (_, required) in spec.items() if required and name not in req)
    if unknown or missing:
        raise BadRequest(f"{op!r} takes {', '.join(spec)} (unknown: {[u[:40] for u in unknown[:5]]}, "
                         f"missing: {missing})")
    for name, value in req.items():
        kind = spec[name][0]
        if kind is int and not (_int(value) and value >= 0):
            raise BadRequest(f"{op!r}'s {name} is a whole number >= 0, not {str(value)[:40]!r}")
        if kind is float and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and math.isfinite(value) and value >= 0):
            raise BadRequest(f"{op!r}'s {name} is a finite number of seconds >= 0, not {str(value)[:40]!r}")
        if kind is str and not isinstance(value, str):
            raise BadRequest(f"{op!r}'s {name} is a string, not a {type(value).__name__}")
    return op, req, guard


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
