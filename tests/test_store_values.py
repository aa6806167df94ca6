"""What goes through the membership store between steps: JSON and raw tensors, read back without unpickling.

Lightning's collectives between steps (``broadcast``, ``reduce``, ``all_gather``, ``barrier``), the callbacks' and
a checkpoint save's, and the replica audit's digests travel as store values (``runtime.collectives``). Each kind
of value they send comes back equal and of the same type; a value that cannot travel is refused on the node that
sends it, naming its type and the fix, and every other node of the collective stops with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_bamboo.engine import audit
from lightning_bamboo.membership import EmbeddedServer
from lightning_bamboo.runtime.collectives import (
    StoreValueError,
    UnsendableValueError,
    decode,
    encode,
    gather_values,
)
from tests.test_session_protocol import job, on_threads

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as running:
        yield running

#: what travels through ``strategy.broadcast`` and ``reduce``/``all_gather`` between steps, by who sends it
SENT: dict[str, Any] = {
    "ModelCheckpoint / trainer.log_dir: a directory": "/runs/gpt/checkpoints",
    "a directory not set yet": None,
    "checkpoint_hooks: the resolved checkpoint path": str(Path("/runs/gpt/step8.ckpt")),
    "a pathlib path": Path("/runs/gpt/step8.ckpt"),
    "Timer / ModelCheckpoint: a decision": True,
    "LearningRateFinder: its results": {"lr": [1e-5, 3e-4, 1e-2], "loss": [2.5, float("inf"), 1.25]},
    "AsyncCheckpoint: its token": "3f2a9c0d11be",
    "HydrozoaTuner: its message": {"table": {"plans": [None, {"stages": 2, "partition": [0, 4, 8]}], "errors": ["no"]},
                                   "hardware": {"memory_bytes": 2**34, "flops": 1.5e12, "links": (1e9, 2e9)}},
    "a tuple and a dict with other keys than strings": ({1: "a", (2, "b"): [None]}, ("x", 3)),
    "a dict whose only key starts with $": {"$tensor": "not a tensor"},
    "bytes": b"\x00\xffbamboo",
    "reduce_boolean_decision: an int tensor": torch.tensor(1),
    "a metric": torch.tensor(2.5, dtype=torch.float64),
    "PreemptionCallback: rows of a gather": torch.arange(12, dtype=torch.int64).reshape(4, 3),
    "bf16 and empty tensors": [torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.zeros(0, 3)],
    "a bool mask": torch.tensor([True, False, True]),
}


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("value", list(SENT.values()), ids=list(SENT))
def test_what_lightning_and_the_callbacks_send_comes_back_equal_and_of_its_type(value):
    text = encode(value)
    assert "pickle" not in text and "\n" not in text
    assert same(decode(text), value), (value, decode(text))


def test_the_audits_digests_keep_their_integer_layer_keys():
    states = {3: {"weights": {"w": torch.ones(2, 2)}, "optimizer": {"w": {"group": {"lr": 0.1}, "state": {}}}}}
    report = dataclasses.asdict(audit.NodeDigest(node="n0", stage=1, pipeline=0, own=audit.digest(states),
                                                 replica_stage=None, replica={}))
    back = decode(encode(report))
    assert back == report and list(back["own"]) == [3]
    assert audit.NodeDigest(**back) == audit.NodeDigest(**report)


def test_a_gpu_or_grad_tensor_comes_back_as_a_plain_cpu_tensor():
    tensor = torch.ones(3, requires_grad=True) * 2
    back = decode(encode(tensor))
    assert back.device.type == "cpu" and not back.requires_grad and torch.equal(back, tensor.detach())


class Opaque:
    """A class of the user's: it would have travelled as a pickle."""


@pytest.mark.parametrize(("value", "named"), [
    ({"metrics": [Opaque()]}, r"the value\['metrics'\]\[0\] is a tests\.test_store_values\.Opaque"),
    ({1, 2}, "the value is a builtins.set"),
    (torch.zeros(3).to_sparse(), r"torch\.Tensor of torch\.float32 \(torch\.sparse_coo\)"),
    ({Opaque(): 1}, r"a key of the value is a tests\.test_store_values\.Opaque"),
])
def test_a_value_that_cannot_travel_is_refused_when_sent_naming_its_type_and_the_fix(value, named):
    with pytest.raises(UnsendableValueError, match=named) as err:
        encode(value)
    assert "never as pickles" in str(err.value) and "dataclasses.asdict(x)" in str(err.value)


def test_a_refused_value_stops_every_node_at_that_collective(server):
    """n0 broadcasts an object that cannot travel: n0 raises at once; n1, which sends nothing, is not left waiting
    for n0's part: it gets the same refusal, naming n0. The next collective works on both."""
    with job(server, "refused", ["n0", "n1"]) as s:
        results = on_threads({"n0": lambda: gather_values(s["n0"], Opaque()),
                              "n1": lambda: gather_values(s["n1"], None, send=False)})
        assert isinstance(results["n0"], UnsendableValueError), results
        assert isinstance(results["n1"], UnsendableValueError), results
        assert str(results["n1"]).startswith("n0 could not send its part of a collective through the store: ")
        assert "tests.test_store_values.Opaque" in str(results["n1"])
        again = on_threads({n: (lambda x=s[n], n=n: gather_values(x, {"from": n})) for n in ("n0", "n1")})
        assert again == dict.fromkeys(("n0", "n1"), [{"from": "n0"}, {"from": "n1"}])


@pytest.mark.parametrize(("text", "why"), [
    ("gASVKAAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAR0cnVllIWUUpQu", "it is not JSON"),
    ('{"$eval": "print(1)"}', "tagged '\\$eval'"),
    ('{"$tensor": {"dtype": "float32", "shape": [3], "data": "AAAA"}}', "with 3 bytes of data"),
    ('{"$tensor": {"dtype": "object", "shape": [1], "data": "AA=="}}', "dtype 'object'"),
    ('{"$tensor": {"dtype": "uint8", "shape": [-1], "data": ""}}', r"shape \[-1\]"),
    ('{"$dict": [[[1], 2]]}', "not a \\[key, value\\] pair with a plain key"),
    ('{"$bytes": "not base64!"}', "not base64"),
    ("[" * 100_000, "RecursionError"),
])
def test_a_store_value_not_in_the_form_sent_is_refused(text, why):
    with pytest.raises(StoreValueError, match=why) as err:
        decode(text)
    assert "nothing in it is unpickled or run" in str(err.value) and "docs/security.md" in str(err.value)
