"""``lightning-bamboo prepare``: tokenize local text files into the flat token files ``TokenCorpus`` reads.

    lightning-bamboo prepare notes/ book.txt --out data/corpus [--tokenizer bytes | hf:NAME] [--val-fraction 0.05]

writes ``train.bin`` and ``val.bin`` (``uint16`` ids, ``uint32`` for a vocabulary over 65536: nanoGPT's format) and
``meta.json`` (the vocabulary size, the dtype, the tokenizer, the files and their token counts), each written to a
temporary name and renamed, so a file is whole or absent. Directories are searched for ``--glob`` (default
``*.txt`` and ``*.md``). Documents are joined with the tokenizer's end-of-text id (``bytes``: a blank line).

Tokenizers: ``bytes`` (UTF-8 bytes, a vocabulary of 256, nothing to install) or ``hf:NAME`` (a Hugging Face
tokenizer by name or local path, through ``transformers``: ``pip install "lightning-bamboo[tokenizers]"``). The
validation share is the corpus's last tokens (no sample straddles the two files).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.models.corpus import write_tokens

META = "meta.json"
DEFAULT_GLOBS = ("*.txt", "*.md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="text files, or directories searched for --glob")
    parser.add_argument("--out", required=True, help="directory for train.bin, val.bin and meta.json")
    parser.add_argument("--tokenizer", default="bytes", help="bytes (default) or hf:NAME_OR_PATH (needs transformers)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of the tokens in val.bin (0 to 0.5)")
    parser.add_argument("--glob", action="append", default=None,
                        help=f"pattern for files in a directory, repeatable (default: {' '.join(DEFAULT_GLOBS)})")


def run(args: argparse.Namespace) -> int:
    meta = prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, tuple(args.glob or DEFAULT_GLOBS))
    print(f"{len(meta['files'])} file(s), {meta['tokens']['train'] + meta['tokens']['val']} tokens, vocabulary "
          f"{meta['vocab_size']} ({meta['tokenizer']}, {meta['dtype']}): {meta['tokens']['train']} in "
          f"{Path(args.out) / 'train.bin'}, {meta['tokens']['val']} in {Path(args.out) / 'val.bin'}")
    return 0


def prepare(inputs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], tokenizer: str = "bytes",
            val_fraction: float = 0.05, globs: Sequence[str] = DEFAULT_GLOBS) -> dict:
    """Tokenize ``inputs`` into ``out``/train.bin, val.bin and meta.json (see the module docstring); the meta."""
    if not 0.0 <= val_fraction <= 0.5:
        raise BambooConfigError(f"--val-fraction must lie in 0..0.5 (got {val_fraction}): the share of the tokens "
                                "kept for validation")
    files = _files(inputs, globs)
    encode, separator, vocab_size = _tokenizer(tokenizer)
    ids: list[int] = []
    counts: dict[str, int] = {}
    for path in files:
        tokens = encode(path.read_text(encoding="utf-8", errors="replace"))
        counts[str(path)] = len(tokens)
        ids.extend([*separator, *tokens] if ids else tokens)
    val = int(len(ids) * val_fraction)
    if len(ids) - val < 2:
        raise BambooConfigError(f"{len(files)} file(s) hold {len(ids)} tokens: too few to train on")
    dtype = "uint16" if vocab_size <= 65536 else "uint32"
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    write_tokens(target / "train.bin", ids[: len(ids) - val], dtype)
    write_tokens(target / "val.bin", ids[len(ids) - val :], dtype)
    meta = {"vocab_size": vocab_size, "dtype": dtype, "tokenizer": tokenizer,
            "tokens": {"train": len(ids) - val, "val": val}, "files": counts}
    tmp = target / f".{META}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, target / META)
    return meta


def read_meta(directory: str | os.PathLike[str]) -> dict:
    """The ``meta.json`` that ``prepare`` wrote in ``directory``."""
    path = Path(directory) / META
    if not path.is_file():
        raise BambooConfigError(f"no {META} in {directory}: write the corpus with lightning-bamboo prepare TEXT... "
                                f"--out {directory}")
    return json.loads(path.read_text())


def _files(inputs: Sequence[str | os.PathLike[str]], globs: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted({f for pattern in globs for f in path.rglob(pattern) if f.is_file()})
            if not found:
                raise BambooConfigError(f"no file matching {' or '.join(globs)} under {path} (pass --glob PATTERN)")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise BambooConfigError(f"no file or directory at {path}")
    return files


def _tokenizer(name: str) -> tuple[Callable[[str], list[int]], list[int], int]:
    """``(encode, separator ids, vocabulary size)`` of tokenizer ``name``."""
    if name == "bytes":
        return (lambda text: list(text.encode("utf-8"))), list(b"\n\n"), 256
    if name.startswith("hf:"):
        try:
            from transformers import AutoTokenizer  # type: ignore[import-not-found]
        except ImportError:
            raise BambooConfigError(f"--tokenizer {name} needs transformers: pip install transformers (or "
                                    "\"lightning-bamboo[tokenizers]\"), or use --tokenizer bytes") from None
        tokenizer = AutoTokenizer.from_pretrained(name[3:])
        eos = tokenizer.eos_token_id
        return ((lambda text: list(tokenizer.encode(text, add_special_tokens=False))),
                [eos] if eos is not None else [], len(tokenizer))
    raise BambooConfigError(f"unknown tokenizer {name!r}: bytes, or hf:NAME_OR_PATH (a Hugging Face tokenizer)")
