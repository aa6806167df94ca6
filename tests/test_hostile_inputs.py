"""Hostile input: what someone other than the job's own processes could put in front of it, and what it does then.

- a store value made to run code when it is unpickled is refused, and runs nothing;
- the embedded store answers malformed, oversized and unknown requests with errors, and keeps serving the job;
  beyond loopback, every request without its shared token is refused;
- forged membership records (a node that never joined, a registration on another node's lease, a record that is
  not one) are ignored, each with a log line.

Real servers and sessions in this process; the attacker is a plain socket or a store client of its own.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch

from lightning_bamboo.runtime.collectives import StoreValueError, decode, encode
from tests.test_session_protocol import job, on_threads, server  # noqa: F401 - ``server`` is a fixture

pytestmark = [pytest.mark.timeout(60)]


class Payload:
    """Unpickled, it opens (creates) ``path``: the smallest thing a pickle can be made to do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        return open, (str(self.path), "w")


def pickled(obj: object) -> str:
    """``obj`` as the store values were once written: a torch.save pickle, in base64."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_a_store_value_made_to_run_code_when_unpickled_is_refused_and_runs_nothing(server, tmp_path):  # noqa: F811
    """Someone who can write under the job's prefix puts n1's part of the next collective before n1 does: n0 reads
    it in the real collective and refuses it; the file the pickle would create does not exist."""
    marker = tmp_path / "ran"
    with job(server, "hostile", ["n0", "n1"]) as s:
        attacker = s["n1"].store
        attacker.put(s["n0"].keys.coll(0, 0) + "/n/n1", pickled({"x": Payload(marker)}))
        parts = s["n0"].gather(encode({"x": 1}))  # the collective itself: n1's part is the attacker's
        assert decode(parts[0]) == {"x": 1}
        with pytest.raises(StoreValueError, match="it is not JSON") as err:
            decode(parts[1])
    assert not marker.exists(), "unpickling the store value ran its code"
    assert "nothing in it is unpickled or run" in str(err.value)
