"""Values through the membership store (encoded), and reductions of gathered tensors in rank order."""

from __future__ import annotations

import base64
import io
from typing import Any

import torch

from lightning_bamboo.errors import BambooConfigError

REDUCE_KINDS = ("sum", "avg", "max", "min", "product")


def encode(obj: Any) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode(text: str) -> Any:
    return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=False)


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
