"""``lightning-bamboo prepare``: tokenize local text files into the flat token files ``TokenCorpus`` reads.

    lightning-bamboo prepare notes/ book.txt --out data/corpus [--tokenizer bytes | hf:NAME] [--val-fraction 0.05]

writes ``train.bin`` and ``val.bin`` (``uint16`` ids, ``uint32`` for a vocabulary over 65536: nanoGPT's format) and
``meta.json`` (the vocabulary size, the dtype, the tokenizer, the files and their token counts), each written to a
temporary name and renamed, so a file is whole or absent. Directories are searched for ``--glob`` (default
``*.txt`` and ``*.md``). Documents are joined with the tokenizer's end-of-text id (``bytes``: a blank line).

Tokenizers: ``bytes`` (UTF-8 bytes, a vocabulary of 256, nothing to install) or ``hf:NAME`` (a Hugging Face
tokenizer by name or local path, through ``transformers``: ``pip install "lightning-bamboo[tokenizers]"``). A path
or a name in the Hugging Face cache is read without network; any other name is downloaded from the Hub only if it
answers within ``HUB_PROBE_SECONDS``, else the command stops at once with what to do. The validation share is the
corpus's last tokens (no sample straddles the two files).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
        tokenizer = _hugging_face_tokenizer(name)
        eos = tokenizer.eos_token_id
        return ((lambda text: list(tokenizer.encode(text, add_special_tokens=False))),
                [eos] if eos is not None else [], len(tokenizer))
    raise BambooConfigError(f"unknown tokenizer {name!r}: bytes, or hf:NAME_OR_PATH (a Hugging Face tokenizer)")


#: seconds the Hugging Face Hub gets to answer before a tokenizer that is not on this machine is refused
HUB_PROBE_SECONDS = 2.0


def _hugging_face_tokenizer(name: str) -> Any:
    """The tokenizer of ``hf:NAME_OR_PATH``: from a local directory or the Hugging Face cache first (no network); only
    then from the Hub, once it answered a probe within ``HUB_PROBE_SECONDS``. Whatever fails is one line that says
    what to do (transformers' own retries took a minute, then printed a traceback of 85 lines). Where the name is
    not in the cache, the probe comes before transformers is imported (seconds of a core)."""
    import importlib.util

    needs = (f"--tokenizer {name} needs transformers: pip install transformers (or "
             "\"lightning-bamboo[tokenizers]\"), or use --tokenizer bytes")
    if importlib.util.find_spec("transformers") is None:
        raise BambooConfigError(needs)
    from huggingface_hub import constants
    from huggingface_hub.utils import validate_repo_id

    ref = name[3:]
    fix = (f"download it once where there is network (AutoTokenizer.from_pretrained({ref!r}).save_pretrained(DIR)) "
           "and pass --tokenizer hf:DIR, or use --tokenizer bytes")
    if Path(ref).exists():
        try:
            return _auto_tokenizer(needs).from_pretrained(ref, local_files_only=True)
        except (OSError, ValueError) as err:
            raise BambooConfigError(f"--tokenizer {name}: no tokenizer loads from the directory {ref} "
                                    f"({_first_line(err)}); write one there with save_pretrained") from None
    try:
        validate_repo_id(ref)
    except ValueError as err:
        raise BambooConfigError(f"--tokenizer {name}: neither a directory nor a Hugging Face name ({_first_line(err)})"
                                "; pass hf:NAME (e.g. hf:gpt2) or hf:DIR, or use --tokenizer bytes") from None
    if _cached(ref, constants.HF_HUB_CACHE):
        try:
            return _auto_tokenizer(needs).from_pretrained(ref, local_files_only=True)  # no network needed
        except (OSError, ValueError):
            pass  # only some of its files: the Hub has the rest
    where = f"not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise BambooConfigError(f"--tokenizer {name}: {where}, and HF_HUB_OFFLINE is set; {fix}")
    if (why := _unreachable(constants.ENDPOINT, HUB_PROBE_SECONDS)) is not None:
        raise BambooConfigError(f"--tokenizer {name}: {where}, and the Hugging Face Hub at {constants.ENDPOINT} does "
                                f"not answer ({why}); {fix}")
    try:
        return _auto_tokenizer(needs).from_pretrained(ref)
    except (OSError, ValueError) as err:
        raise BambooConfigError(f"--tokenizer {name}: {where}, and the Hugging Face Hub at {constants.ENDPOINT} did "
                                f"not give it ({_first_line(err)}); {fix}") from None


def _auto_tokenizer(needs: str) -> Any:
    try:
        from transformers import AutoTokenizer  # type: ignore[import-not-found]
    except ImportError:
        raise BambooConfigError(needs) from None
    return AutoTokenizer


def _cached(ref: str, hub_cache: str) -> bool:
    """Whether the Hugging Face cache holds anything of model ``ref``: its folder ``models--OWNER--NAME`` (the cache's
    documented layout; transformers 4 may keep it in ``TRANSFORMERS_CACHE``)."""
    folder = "--".join(["models", *ref.split("/")])
    return any(Path(cache, folder).is_dir() for cache in (hub_cache, os.environ.get("TRANSFORMERS_CACHE")) if cache)


def _unreachable(url: str, timeout: float) -> str | None:
    """None once ``url`` answers anything (any HTTP status) within ``timeout`` seconds, else why not. The request runs
    on a thread of its own: a name lookup on a machine without network waits on its resolver, past any socket
    timeout (the thread ends when the lookup gives up)."""
    import threading
    import urllib.error
    import urllib.request

    outcome: list[str | None] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # it answered
        except (OSError, ValueError) as err:
            outcome.append(f"{type(err).__name__}: {_first_line(getattr(err, 'reason', None) or err)}")

    thread = threading.Thread(target=probe, name="bamboo-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def _first_line(err: object) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
