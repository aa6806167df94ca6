"""TokenCorpus: a flat token file read through a memory map, as the samples a GPT trains on."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.models.corpus import TokenCorpus, write_tokens


def test_samples_are_next_token_pairs_read_from_the_file(tmp_path):
    ids = np.arange(1000) % 50257  # GPT-2's vocabulary fits uint16
    path = write_tokens(tmp_path / "train.bin", ids)
    assert path.stat().st_size == 2 * len(ids) and not list(tmp_path.glob(".*tmp*"))
    corpus = TokenCorpus(path, block_size=64)
    assert len(corpus) == (1000 - 65) // 64 + 1
    x, y = corpus[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (64,)
    assert torch.equal(x, torch.arange(192, 256)) and torch.equal(y, torch.arange(193, 257))
    last = corpus[len(corpus) - 1]
    assert int(last[1][-1]) <= 999
    with pytest.raises(IndexError):
        corpus[len(corpus)]
    overlapping = TokenCorpus(path, block_size=64, stride=8)
    assert torch.equal(overlapping[1][0], torch.arange(8, 72))


def test_a_dataloader_over_it_batches_samples(tmp_path):
    path = write_tokens(tmp_path / "big.bin", np.arange(70000), dtype="uint32")
    loader = torch.utils.data.DataLoader(TokenCorpus(path, 16, dtype="uint32"), batch_size=4)
    x, y = next(iter(loader))
    assert x.shape == (4, 16) and int(x[1, 0]) == 16 and int(y[0, -1]) == 16


@pytest.mark.parametrize("make, message", [
    (lambda p: TokenCorpus(p / "missing.bin", 8), "no corpus file"),
    (lambda p: TokenCorpus(write_tokens(p / "t.bin", range(5)), 8), "fewer than one sample"),
    (lambda p: TokenCorpus(p / "odd.bin", 8) if (p / "odd.bin").write_bytes(b"\0" * 41) else None,
     "not a whole number of uint16 tokens"),
    (lambda p: write_tokens(p / "v.bin", [70000]), "use dtype='uint32'"),
    (lambda p: TokenCorpus(p / "x.bin", 8, dtype="int8"), "uint16 or uint32"),
])
def test_bad_corpora_are_refused_with_the_fix(tmp_path, make, message):
    with pytest.raises(BambooConfigError, match=message):
        make(tmp_path)


def test_prepare_tokenizes_local_text_files_into_train_and_val(tmp_path):
    from lightning_bamboo.cli import main
    from lightning_bamboo.models.prepare import read_meta

    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "a.md").write_text("héllo spot\n")
    (notes / "sub" / "b.txt").write_text("world " * 40)
    (notes / "skip.bin").write_bytes(b"\0\1")  # not text: not matched by the default patterns
    extra = tmp_path / "c.txt"
    extra.write_text("the end")
    assert main(["prepare", str(notes), str(extra), "--out", str(tmp_path / "out"), "--val-fraction", "0.1"]) == 0
    meta = read_meta(tmp_path / "out")
    expected = b"\n\n".join(p.read_bytes() for p in (notes / "a.md", notes / "sub" / "b.txt", extra))
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16" and meta["tokenizer"] == "bytes"
    assert list(meta["files"]) == [str(notes / "a.md"), str(notes / "sub" / "b.txt"), str(extra)]
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == expected  # every byte, in order, once
    assert len(val) == int(len(expected) * 0.1) == meta["tokens"]["val"] and len(train) == meta["tokens"]["train"]
    assert not list((tmp_path / "out").glob(".*tmp*"))
    corpus = TokenCorpus(tmp_path / "out" / "train.bin", block_size=8)
    assert bytes(corpus[0][0].numpy().astype(np.uint8)) == expected[:8]


@pytest.mark.parametrize("argv, message", [
    (["{d}/missing.txt"], "no file or directory at"),
    (["{d}/empty_dir"], "no file matching"),
    (["{d}/a.txt", "--tokenizer", "wordpiece"], "unknown tokenizer 'wordpiece'"),
    (["{d}/a.txt", "--tokenizer", "hf:gpt2"], "needs transformers: pip install transformers"),
    (["{d}/a.txt", "--val-fraction", "0.9"], r"must lie in 0..0.5 \(got 0.9\)"),
    (["{d}/tiny.txt"], "too few to train on"),
])
def test_prepare_refuses_bad_input_naming_the_fix(tmp_path, capsys, monkeypatch, argv, message):
    from lightning_bamboo.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # as without the [tokenizers] extra, installed or not

    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "a.txt").write_text("some text to train on")
    (tmp_path / "tiny.txt").write_text("x")
    assert main(["prepare", *(a.format(d=tmp_path) for a in argv), "--out", str(tmp_path / "out")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out" / "train.bin").exists()
