"""A tokenized corpus on disk, read through a memory map: the training data of a real language model.

The file is a flat array of token ids, ``uint16`` (vocabularies up to 65536, GPT-2's included) or ``uint32``: the
``train.bin``/``val.bin`` format of nanoGPT and similar recipes, which any tokenizer can write
(``write_tokens(path, ids)``). Nothing is read until a sample is asked for, so a corpus of hundreds of GB costs
no memory up front, and every node (each draws the same global batch) maps the same file.

Sample ``i`` is the ``block_size + 1`` tokens from ``i * stride``: inputs are the first ``block_size``, targets the
last ``block_size`` (the next token of each), as int64 tensors. ``stride`` defaults to ``block_size``
(non-overlapping samples).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from lightning_bamboo.errors import BambooConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenCorpus(torch.utils.data.Dataset):
    """``(inputs, targets)`` samples of ``block_size`` tokens from a flat token file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], block_size: int, dtype: str = "uint16",
                 stride: int | None = None) -> None:
        if dtype not in DTYPES:
            raise BambooConfigError(f"a corpus holds uint16 or uint32 token ids (dtype: {dtype!r})")
        if block_size < 1 or (stride is not None and stride < 1):
            raise BambooConfigError(f"block_size and stride must be >= 1 (block_size: {block_size}, stride: {stride})")
        self.path, self.block_size, self.stride = Path(path), block_size, stride or block_size
        if not self.path.is_file():
            raise BambooConfigError(f"no corpus file at {self.path}; write one with lightning_bamboo.models.corpus."
                                    "write_tokens(path, token_ids)")
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        size = self.path.stat().st_size
        if size % itemsize:
            raise BambooConfigError(f"{self.path} is {size} bytes, not a whole number of {dtype} tokens: is it "
                                    f"{'uint32' if dtype == 'uint16' else 'uint16'}?")
        self.tokens = np.memmap(self.path, dtype=DTYPES[dtype], mode="r")
        if len(self.tokens) < block_size + 1:
            raise BambooConfigError(f"{self.path} holds {len(self.tokens)} tokens, fewer than one sample of "
                                    f"block_size + 1 = {block_size + 1}")

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of a corpus of {len(self)}")
        start = index * self.stride
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def write_tokens(path: str | os.PathLike[str], token_ids: Iterable[int] | np.ndarray | torch.Tensor,
                 dtype: str = "uint16") -> Path:
    """Write ``token_ids`` as a corpus file (to a temporary name, then renamed: never half-written)."""
    if dtype not in DTYPES:
        raise BambooConfigError(f"a corpus holds uint16 or uint32 token ids (dtype: {dtype!r})")
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids.numpy()
    else:
        ids = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(list(token_ids))
    limit = 65535 if dtype == "uint16" else 4294967295
    if ids.size and (ids.min() < 0 or ids.max() > limit):
        raise BambooConfigError(f"token ids must lie in 0..{limit} for {dtype} (got {ids.min()}..{ids.max()}); "
                                "use dtype='uint32' for a larger vocabulary")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    ids.astype(DTYPES[dtype]).tofile(tmp)
    os.replace(tmp, path)
    return path
