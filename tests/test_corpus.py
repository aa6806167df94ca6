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


#: a bound that transformers' retries (a minute against a closed port) or a hang on a silent one would exceed
HUB_HANG_SECONDS = 30


def _prepare_offline(tmp_path, tokenizer: str, endpoint: str):
    """``lightning-bamboo prepare ... --tokenizer TOKENIZER`` in a process of its own whose Hugging Face Hub is
    ``endpoint`` and whose cache is empty (``HF_ENDPOINT`` is read once, when huggingface_hub is imported)."""
    import os
    import subprocess

    from tests.helpers import REPO

    (tmp_path / "a.txt").write_text("some text to train on")
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                          "TRANSFORMERS_CACHE")}
    env.update(PYTHONPATH=str(REPO), HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"))
    return subprocess.run([sys.executable, "-m", "lightning_bamboo.cli", "prepare", str(tmp_path / "a.txt"),
                           "--out", str(tmp_path / "out"), "--tokenizer", tokenizer],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=HUB_HANG_SECONDS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hub", ["silent", "closed"])
def test_a_hugging_face_tokenizer_neither_here_nor_reachable_is_refused_at_once_in_one_line(tmp_path, hub):
    """``--tokenizer hf:gpt2`` on a machine without network: not a local path, not in the cache, and the Hub's
    endpoint a socket that accepts and never answers (``silent``) or a closed port. One line that says what to do,
    the status of a configuration error and nothing written; not a minute of retries and transformers' traceback."""
    import socket

    pytest.importorskip("transformers")
    with socket.socket() as hub_socket:
        hub_socket.bind(("127.0.0.1", 0))  # bound, so no one else takes the port while the command runs
        if hub == "silent":
            hub_socket.listen(16)  # the kernel accepts connections; nothing ever answers them
        endpoint = f"http://127.0.0.1:{hub_socket.getsockname()[1]}"
        done = _prepare_offline(tmp_path, "hf:gpt2", endpoint)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("lightning-bamboo prepare: error: --tokenizer hf:gpt2"), lines
    assert endpoint in lines[0] and "save_pretrained" in lines[0] and "--tokenizer bytes" in lines[0], lines
    assert done.stdout == "" and not (tmp_path / "out" / "train.bin").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["directory", "cache"])
def test_a_hugging_face_tokenizer_on_this_machine_needs_no_network(tmp_path, where):
    """A tokenizer saved with ``save_pretrained`` (a tiny word-level one, made on the spot) is read from its
    directory, or from the Hugging Face cache by its name (laid out as a download leaves it), while the Hub's
    endpoint is a closed port."""
    import socket

    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lightning_bamboo.models.prepare import read_meta

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "<eos>": 1, "some": 2, "text": 3, "to": 4, "train": 5, "on": 6},
                                       unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    commit = "0123456789abcdef0123456789abcdef01234567"
    saved = tmp_path / "tok" if where == "directory" else tmp_path / "hf/hub/models--bamboo--words/snapshots" / commit
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="<eos>").save_pretrained(saved)
    if where == "cache":  # the branch's commit, and the hub's mark for a file the model does not have
        (tmp_path / "hf/hub/models--bamboo--words/refs").mkdir()
        (tmp_path / "hf/hub/models--bamboo--words/refs/main").write_text(commit)
        (tmp_path / "hf/hub/models--bamboo--words/.no_exist" / commit).mkdir(parents=True)
        (tmp_path / "hf/hub/models--bamboo--words/.no_exist" / commit / "config.json").touch()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        name = f"hf:{saved}" if where == "directory" else "hf:bamboo/words"
        done = _prepare_offline(tmp_path, name, f"http://127.0.0.1:{closed.getsockname()[1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    meta = read_meta(tmp_path / "out")
    assert meta["vocab_size"] == 7 and meta["tokens"] == {"train": 5, "val": 0}
    assert list(np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)) == [2, 3, 4, 5, 6]
