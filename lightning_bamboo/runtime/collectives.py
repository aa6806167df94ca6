"""Values through the membership store, and reductions of gathered tensors in rank order.

What travels through the store is JSON: ``None``, booleans, numbers, strings, lists and dicts as themselves; a
tuple, a dict with other keys than strings, a path, bytes and a tensor as a one-key object (``{"$tuple": [...]}``,
``{"$tensor": {"dtype": "float32", "shape": [2, 3], "data": BASE64}}``: the tensor's raw bytes). Nothing read from
the store is unpickled: a value that is not in this form is refused (``StoreValueError``) and nothing in it runs. A
value that cannot travel this way is refused when it is sent (``UnsendableValueError``), naming its type and the fix.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from pathlib import Path, PurePath
from typing import Any

import torch

from lightning_bamboo.errors import BambooConfigError, BambooError

REDUCE_KINDS = ("sum", "avg", "max", "min", "product")

#: the one-key objects that carry what JSON has no form of
_TAGS = ("$tensor", "$tuple", "$dict", "$path", "$bytes")
#: a collective's part from a node whose value could not be sent (``gather_values``)
_REFUSED = "$refused"
#: what a tensor may be made of (``torch.<name>``): every plain numeric dtype
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_SENDABLE = "str, int, float, bool, None, lists, tuples, dicts, pathlib paths, bytes or dense tensors"


class UnsendableValueError(BambooConfigError, TypeError):
    """A value given to a collective through the store is not one that travels as JSON and raw tensors."""


class StoreValueError(BambooError, ValueError):
    """A value read from the store is not in the form ``encode`` writes: refused, and nothing in it runs."""


def encode(obj: Any) -> str:
    """``obj`` as the text of a store value (JSON; tensors as raw bytes with dtype and shape; never a pickle)."""
    return json.dumps(_to_json(obj, "the value"), separators=(",", ":"))


def decode(text: str) -> Any:
    """What :func:`encode` made of a value, from a store value's text; ``StoreValueError`` for any other text."""
    try:
        return _from_json(json.loads(text), "the value")
    except StoreValueError:
        raise
    except (ValueError, TypeError, RecursionError) as err:
        raise _refused(f"it is not JSON ({type(err).__name__}: {str(err)[:120]})") from None


def _unsendable(obj: Any, where: str, why: str = "") -> UnsendableValueError:
    kind = type(obj)
    return UnsendableValueError(
        f"strategy='bamboo' sends values between steps through the membership store as JSON and raw tensors, never "
        f"as pickles: {where} is a {kind.__module__}.{kind.__qualname__}{why}, which cannot travel that way; send "
        f"{_SENDABLE} instead (e.g. str(x), x.tolist(), dataclasses.asdict(x) or x.state_dict())"
    )


def _to_json(obj: Any, where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj  # bool before int; subclasses (an IntEnum, a numpy float) travel as their plain value
    if isinstance(obj, torch.Tensor):
        return {"$tensor": _tensor_to_json(obj, where)}
    if isinstance(obj, list):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if type(obj) is tuple:  # a named tuple would come back as a plain one: refused below, as any other class
        return {"$tuple": [_to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(type(k) is str for k in obj) and not (len(obj) == 1 and next(iter(obj)).startswith("$")):
            return {k: _to_json(v, f"{where}[{k!r}]") for k, v in obj.items()}
        for k in obj:
            if not (k is None or isinstance(k, (bool, int, float, str, PurePath)) or type(k) is tuple):
                raise _unsendable(k, f"a key of {where}")
        return {"$dict": [[_to_json(k, f"a key of {where}"), _to_json(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    if isinstance(obj, PurePath):
        return {"$path": str(obj)}
    if isinstance(obj, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii")}
    raise _unsendable(obj, where)


def _tensor_to_json(tensor: torch.Tensor, where: str) -> dict[str, Any]:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES or tensor.layout != torch.strided:
        raise _unsendable(tensor, where, f" of {tensor.dtype} ({tensor.layout})")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": name, "shape": list(tensor.shape), "data": base64.b64encode(data).decode("ascii")}


def _refused(why: str) -> StoreValueError:
    return StoreValueError(
        f"a value read from the membership store is not one this job writes ({why}): refused, and nothing in it "
        "is unpickled or run. Something other than the job's own processes wrote under its prefix; fence the "
        "prefix with an etcd role (docs/security.md)"
    )


def _from_json(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_from_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        raise _refused(f"{where} is a {type(value).__name__}")
    if len(value) == 1 and next(iter(value)).startswith("$"):
        tag, body = next(iter(value.items()))
        if tag not in _TAGS:
            raise _refused(f"{where} is tagged {tag[:40]!r}, not one of {', '.join(_TAGS)}")
        return _tagged(tag, body, where)
    return {k: _from_json(v, f"{where}[{k[:40]!r}]") for k, v in value.items()}


def _tagged(tag: str, body: Any, where: str) -> Any:
    if tag == "$tensor":
        return _tensor_from_json(body, where)
    if tag == "$path":
        return Path(_expect(body, str, where))
    if tag == "$bytes":
        return _b64(_expect(body, str, where), where)
    items = [_from_json(v, f"{where}[{i}]") for i, v in enumerate(_expect(body, list, where))]
    if tag == "$tuple":
        return tuple(items)
    pairs = {}
    for item in items:
        if not (isinstance(item, list) and len(item) == 2) or _unhashable(item[0]):
            raise _refused(f"{where} holds an entry that is not a [key, value] pair with a plain key")
        pairs[item[0]] = item[1]
    return pairs


def _unhashable(key: Any) -> bool:
    if isinstance(key, tuple):
        return any(_unhashable(k) for k in key)
    return not (key is None or isinstance(key, (bool, int, float, str, PurePath)))


def _expect(body: Any, kind: type, where: str) -> Any:
    if not isinstance(body, kind):
        raise _refused(f"{where}'s body is a {type(body).__name__}, not a {kind.__name__}")
    return body


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(f"{where}'s data is not base64") from None


def _tensor_from_json(body: Any, where: str) -> torch.Tensor:
    body = _expect(body, dict, where)
    dtype, shape, data = body.get("dtype"), body.get("shape"), body.get("data")
    if set(body) != {"dtype", "shape", "data"} or not isinstance(dtype, str) or dtype not in _DTYPES:
        raise _refused(f"{where} is a tensor of dtype {str(dtype)[:40]!r}, not one of {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise _refused(f"{where} is a tensor of shape {str(shape)[:80]}, not a list of sizes")
    raw = _b64(_expect(data, str, where), where)
    dt = _DTYPES[dtype]
    if len(raw) != math.prod(shape) * dt.itemsize:
        raise _refused(f"{where} is a {dtype} tensor of shape {shape} with {len(raw)} bytes of data")
    if not raw:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)


def gather_values(session: Any, obj: Any, send: bool = True) -> list[Any]:
    """Every node's ``obj`` (None for a node that does not ``send``), in rank order, through the ``session``'s
    store (``session.gather``): encoded here before anything is written, read back without unpickling.

    A value that cannot travel is refused here, on the node that sends it; that node still puts its part, a
    refusal, so the others stop at the same collective with the same error instead of waiting for it."""
    try:
        text = encode(obj) if send else ""
    except UnsendableValueError as err:
        session.gather(json.dumps({_REFUSED: str(err)}))
        raise
    nodes = list(getattr(session, "nodes", ()))
    parts = session.gather(text)
    for rank, part in enumerate(parts):
        if part.startswith('{"' + _REFUSED):
            sender = nodes[rank] if rank < len(nodes) else f"rank {rank}"
            raise UnsendableValueError(f"{sender} could not send its part of a collective through the store: "
                                       f"{str(_refusal_message(part))[:2000]}")
    return [None if not part else decode(part) for part in parts]


def _refusal_message(part: str) -> str:
    """The message of a refusal part (``gather_values``); a part that only claims to be one is refused."""
    try:
        message = json.loads(part)[_REFUSED]
    except (ValueError, TypeError, KeyError):
        raise _refused("a refusal part is not JSON with a message") from None
    return str(message)


def reduce_kind(reduce_op: Any) -> str:
    """Lightning's ``reduce_op`` (None for a sum, a name, or a ``ReduceOp``) as one of ``REDUCE_KINDS``."""
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        kind = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        if kind in REDUCE_KINDS:
            return kind
    else:
        from torch.distributed import ReduceOp

        for kind in REDUCE_KINDS:
            if reduce_op == getattr(ReduceOp, kind.upper()):
                return kind
    raise BambooConfigError(
        f"strategy='bamboo' reduces with one of {', '.join(REDUCE_KINDS)} (also 'mean' or a ReduceOp of those); "
        f"got reduce_op={reduce_op!r}"
    )


def reduced(parts: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Every rank's tensor reduced in rank order (the same result on every rank)."""
    stacked = torch.stack(parts)
    if kind == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if kind == "avg":  # as Lightning on gloo: the sum divided by the world size, in the tensor's dtype
        return (stacked.sum(0, dtype=stacked.dtype) / len(parts)).to(stacked.dtype)
    if kind == "product":
        return stacked.prod(0, dtype=stacked.dtype)
    return stacked.amax(0) if kind == "max" else stacked.amin(0)
