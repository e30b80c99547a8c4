"""Tests of prepare_data.py: the offline GPT-2 tokenizer, the .bin shard format and the pipeline."""

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import ROOT, ctrl_c_reaches
from gpt2_ddp import tokenizer
from gpt2_ddp.configurator import UserError
from gpt2_ddp.shards import (HEADER_INTS, MAX_SHARD_TOKENS, SHARD_MAGIC, SHARD_VERSION, split_paths,
                             write_shard)
import prepare_data
from prepare_data import EOT_TOKEN, TINYSHAKESPEARE_PATH, gpt2_encoding, main


def read_shard(path):
    """The tokens of a .bin shard, after checking its header."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    assert header[0] == SHARD_MAGIC
    assert header[1] == SHARD_VERSION
    assert not header[3:].any()
    tokens = np.fromfile(path, dtype="<u2", offset=HEADER_INTS * 4)
    assert len(tokens) == header[2]
    return tokens


def names(out_dir):
    """The shards and anything else in out_dir but the manifest of what they were made from."""
    return sorted(p.name for p in out_dir.iterdir() if not p.name.endswith("_manifest.json"))


def split_stream(out_dir, split):
    """All tokens of one split, its shards concatenated in index order."""
    paths = sorted(out_dir.glob(f"*_{split}_*.bin"))
    return np.concatenate([read_shard(p) for p in paths]) if paths else np.array([], dtype=np.uint16)


def run(*args):
    main([str(a) for a in args])


def check_manifest(out_dir, name):
    """Checks that {name}_manifest.json lists every shard of `name` in out_dir, in file-name order,
    with the size, mtime, token count and largest token id of the file read back; returns the manifest."""
    manifest = json.loads((out_dir / f"{name}_manifest.json").read_text())
    shards = []
    for path in sorted([*out_dir.glob(f"{name}_val_*.bin"), *out_dir.glob(f"{name}_train_*.bin")]):
        tokens = read_shard(path)
        shards.append({"file": path.name, "bytes": path.stat().st_size,
                       "mtime_ns": path.stat().st_mtime_ns, "tokens": len(tokens),
                       "max_token_id": int(tokens.max())})
    assert manifest["shards"] == shards
    assert manifest["max_token_id"] == max(shard["max_token_id"] for shard in shards)
    return manifest


def doc_tokens(*texts):
    """The expected token stream: each document preceded by <|endoftext|>."""
    enc = gpt2_encoding()
    return [t for text in texts for t in [EOT_TOKEN] + enc.encode_ordinary(text)]


# ---------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text, ids", [
    ("Hello, I'm a language model,", [15496, 11, 314, 1101, 257, 3303, 2746, 11]),
    ("Hello world", [15496, 995]),
    (" the", [262]),
])
def test_known_gpt2_token_ids(text, ids):
    assert gpt2_encoding().encode_ordinary(text) == ids


def test_encoding_vocab_and_decode_round_trip():
    enc = gpt2_encoding()
    assert enc.n_vocab == 50257
    assert enc.eot_token == EOT_TOKEN == 50256
    text = "First Citizen:\nBefore we proceed any further, hear me speak. Ünïcödé ✓ 日本語  \n\n"
    assert enc.decode(enc.encode_ordinary(text)) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert gpt2_encoding() is enc  # cached


def test_tampered_tokenizer_file_is_refused(tmp_path, monkeypatch):
    data = bytearray(tokenizer.GPT2_MERGES_PATH.read_bytes())
    data[100] ^= 1
    tampered = tmp_path / "vocab.bpe"
    tampered.write_bytes(data)
    monkeypatch.setattr(tokenizer, "GPT2_MERGES_PATH", tampered)
    gpt2_encoding.cache_clear()
    try:
        with pytest.raises(UserError) as exc:
            gpt2_encoding()
        tampered.unlink()
        with pytest.raises(UserError, match=f"^cannot read {tampered}, GPT-2's tokenizer: No such file"):
            gpt2_encoding()
    finally:
        gpt2_encoding.cache_clear()
    message = str(exc.value)
    assert str(tampered) in message
    assert tokenizer.GPT2_MERGES_SHA256 in message
    assert "git checkout -- assets/vocab.bpe" in message


# ---------------------------------------------------------------------------- shard format


def test_write_shard_round_trip(tmp_path):
    path = tmp_path / "x.bin"
    tokens = [0, 1, 50256, 65535, 262]
    write_shard(path, tokens)
    assert names(tmp_path) == ["x.bin"]  # no temp file left behind
    assert path.stat().st_size == HEADER_INTS * 4 + 2 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    assert header[:3].tolist() == [20240520, 1, len(tokens)]
    assert read_shard(path).tolist() == tokens


@pytest.mark.parametrize("umask", [0o027, 0o002], ids=oct)
def test_shards_get_the_mode_of_a_new_file(tmp_path, umask):
    """As open() gives it, 0o666 less the umask (atomic_write), not a temp file's 0o600: on a
    shared machine others read the data where the umask lets them."""
    old = os.umask(umask)
    try:
        write_shard(tmp_path / "x.bin", [1, 2, 3])
    finally:
        os.umask(old)
    assert (tmp_path / "x.bin").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("tokens", [[1, -1], [65536], [0, 65536], [0.5], [[1, 2]], 5])
def test_write_shard_rejects_bad_tokens(tmp_path, tokens):
    with pytest.raises(ValueError):
        write_shard(tmp_path / "x.bin", tokens)
    assert names(tmp_path) == []


def test_a_shard_holds_max_shard_tokens_tokens_and_no_more(tmp_path, monkeypatch):
    """The header's int32 count caps a shard; the cap is lowered here so that the shards stay tiny."""
    from gpt2_ddp import shards
    monkeypatch.setattr(shards, "MAX_SHARD_TOKENS", 3)
    write_shard(tmp_path / "x.bin", [1, 2, 3])
    assert read_shard(tmp_path / "x.bin").tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="at most 3 tokens, got 4"):
        write_shard(tmp_path / "y.bin", [1, 2, 3, 4])
    assert names(tmp_path) == ["x.bin"]


# ---------------------------------------------------------------------------- the embedded corpus


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The embedded corpus's shards, made without `datasets` (GPU machines without a package index
    lack it, and .ci/gpu makes its data there)."""
    out_dir = tmp_path_factory.mktemp("tinyshakespeare")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
        run("--output_dir", out_dir, "--workers", 1)
    return out_dir


def test_default_run_on_embedded_corpus(default_run):
    assert names(default_run) == ["tinyshakespeare_train_000001.bin", "tinyshakespeare_val_000000.bin"]
    val, train = split_stream(default_run, "val"), split_stream(default_run, "train")
    # a document a paragraph (a speech), as --sample_by=paragraph reads it
    paragraphs = TINYSHAKESPEARE_PATH.read_text(encoding="utf-8").split("\n\n")
    expected = doc_tokens(*[p for p in paragraphs if p])
    assert 300_000 < len(expected) < 400_000 and len(paragraphs) > 7000
    assert len(val) == int(0.1 * len(expected))
    assert val[0] == EOT_TOKEN
    assert np.concatenate([val, train]).tolist() == expected


def test_manifest_lists_every_shard(default_run):
    manifest = check_manifest(default_run, "tinyshakespeare")
    assert [shard["file"] for shard in manifest["shards"]] == names(default_run)
    # every speech starts with <|endoftext|>, the largest id of both shards
    assert [shard["max_token_id"] for shard in manifest["shards"]] == [EOT_TOKEN, EOT_TOKEN]
    assert manifest["max_token_id"] == EOT_TOKEN
    assert set(manifest) == {"inputs", "options", "shards", "max_token_id"}
    # the defaults the help names, as the manifest records them
    assert manifest["options"] == {"name": None, "text_field": "text", "sample_by": "paragraph",
                                   "shard_size": int(1e8), "val_tokens": None, "val_fraction": 0.1,
                                   "skip_bad_files": False}


def test_same_input_gives_identical_bytes(default_run, tmp_path):
    run("--output_dir", tmp_path, "--workers", 2)
    assert names(tmp_path) == names(default_run)
    for name in names(tmp_path):
        assert (tmp_path / name).read_bytes() == (default_run / name).read_bytes()


def test_long_documents_are_tokenized_in_parts_with_the_same_tokens(monkeypatch):
    """A long document is cut into parts of at most PART_CHARS characters before a space, tab or
    newline that follows another character, so that progress moves within it and tiktoken's memory
    is bounded; the parts' tokens are the whole document's, whatever the characters around a cut
    (Python's whitespace and tiktoken's differ: \x1c is one only to Python)."""
    monkeypatch.setattr(prepare_data, "PART_CHARS", 100)
    shakespeare = TINYSHAKESPEARE_PATH.read_text(encoding="utf-8")
    mixed = "".join(f"Line {i}: Ça va? Привет 你好 ½ 🤖 x²\n\n  \t{i}\n'tis\n" for i in range(300))
    rng = np.random.default_rng(0)
    pieces = ["\x1c", "\u3000", "\xa0", "'s", "'", "é", "e\u0301", "x", "Ab", "7", "½", "!", "?!", "—",
              "你", "🤖", "_", "\x85"]
    fuzz = "".join(rng.choice(pieces, 5)) + "".join(rng.choice(pieces + [" ", "  ", "\n", "\t", "\r\n"], 20_000))
    for text in (shakespeare[:100_000], mixed, fuzz):
        sources = [("mem", lambda: iter([("doc", {"text": text}), ("doc2", {"text": "a short one"})]))]
        parts = list(prepare_data._parts(sources, "text"))
        assert len(parts) > 100 and max(len(part) for part, _ in parts) <= 100
        batches = list(prepare_data._tokenized(iter(parts), 1))
        assert len(batches) > 10
        tokens = np.concatenate([t for t, _ in batches]).tolist()
        assert tokens == doc_tokens(text, "a short one")
        assert sum(n for _, n in batches) == len(text.encode("utf-8")) + len("a short one")
    whole = "x" * 100  # exactly PART_CHARS characters: one part, though it has nowhere to cut
    sources = [("mem", lambda: iter([("doc", {"text": whole})]))]
    assert list(prepare_data._parts(sources, "text")) == [(whole, True)]


# ---------------------------------------------------------------------------- local inputs


def test_txt_files_are_one_document_each(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world")
    (tmp_path / "b.txt").write_text(" the")
    out_dir = tmp_path / "out"
    run("--input", tmp_path / "*.txt", "--output_dir", out_dir, "--val_tokens", 1, "--workers", 1)
    # the default name is the stem of the first file
    assert names(out_dir) == ["a_train_000001.bin", "a_val_000000.bin"]
    assert split_stream(out_dir, "val").tolist() == [EOT_TOKEN]
    assert split_stream(out_dir, "train").tolist() == [15496, 995, EOT_TOKEN, 262]


def test_txt_files_are_read_as_datasets_text_builder_reads_them_without_it(tmp_path, monkeypatch):
    """.txt input is read without `datasets`, and as its text builder with sample_by=document or
    paragraph reads it (the reference): UTF-8, universal newlines. json input is read without it
    too, and parquet input without it is one line."""
    from datasets import load_dataset
    path = tmp_path / "crlf.txt"
    path.write_bytes("Hello\r\nworld\r\n\rÇa va 🤖\n\n\nend".encode())
    reference = {by: [row["text"] for row in load_dataset("text", data_files=str(path), split="train",
                                                          sample_by=by, streaming=True)]
                 for by in ("document", "paragraph")}
    monkeypatch.setitem(sys.modules, "datasets", None)
    for by, texts in reference.items():
        args = prepare_data._parse_args(["--input", str(path), f"--sample_by={by}"])
        [(where, rows)] = prepare_data._sources(args, [str(path)], "text")
        assert [row["text"] for _, row in rows()] == texts
    assert reference["paragraph"] == ["Hello\nworld", "Ça va 🤖", "\nend"]
    (tmp_path / "a.jsonl").write_text('{"text": "hi there"}\n' * 10)
    run("--input", tmp_path / "a.jsonl", "--output_dir", tmp_path / "out", "--workers", 1)
    assert split_stream(tmp_path / "out", "train").tolist() == doc_tokens(*["hi there"] * 10)[3:]
    (tmp_path / "a.parquet").write_bytes(b"")
    with pytest.raises(UserError, match=r"^parquet input needs the datasets package: "
                                        r"pip install datasets$"):
        run("--input", tmp_path / "a.parquet", "--output_dir", tmp_path / "out2")
    with pytest.raises(UserError, match=r"^--sample_by=paragraph splits \.txt files, not .*a\.jsonl; leave it out$"):
        run("--input", tmp_path / "a.jsonl", "--output_dir", tmp_path / "out3", "--sample_by", "paragraph")


def write_rows(path, rows):
    if path.suffix == ".jsonl" or path.name.endswith(".lines.json"):  # a .json may hold JSON lines too
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":  # the other form datasets' json builder reads: one array
        path.write_text(json.dumps(rows, indent=1))
    else:
        pd.DataFrame(rows).to_parquet(path)


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".lines.json", ".parquet"])
def test_rows_are_documents_with_text_field(tmp_path, ext):
    texts = [f"Row number {i} says hello, world." for i in range(50)] + ["", "last one"]
    write_rows(tmp_path / f"rows{ext}", [{"id": i, "content": t} for i, t in enumerate(texts)])
    out_dir = tmp_path / "out"
    run("--input", tmp_path / f"rows{ext}", "--text_field", "content", "--name", "mine",
        "--output_dir", out_dir, "--workers", 2)
    expected = doc_tokens(*[t for t in texts if t])  # empty documents are dropped
    val, train = split_stream(out_dir, "val"), split_stream(out_dir, "train")
    assert names(out_dir) == ["mine_train_000001.bin", "mine_val_000000.bin"]
    assert len(val) == int(0.1 * len(expected))
    assert np.concatenate([val, train]).tolist() == expected


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet"])
def test_missing_text_field_is_an_error(tmp_path, ext, monkeypatch):
    path = tmp_path / f"rows{ext}"
    write_rows(path, [{"body": "hello", "id": 1}])
    # a first row without the text is refused before the counting pass reads the whole input
    monkeypatch.setattr(prepare_data, "_tokenized", lambda *a: pytest.fail("tokenized first"))
    with pytest.raises(UserError) as exc:
        run("--input", path, "--output_dir", tmp_path / "out", "--workers", 1)
    message = str(exc.value)
    assert "'text'" in message and str(path) in message and "body" in message and "id" in message
    assert not (tmp_path / "out").exists()


def test_the_workers_keep_a_window_of_tasks_and_yield_every_batch_in_order():
    """Two workers keep at most 2 * 2 + 1 tasks in flight, so memory stays flat: the first result
    comes before the sixth document is read. Ten tasks of one document each come back all ten, in
    input order, as one process gives them."""
    parts, read = [(f"document {i}" * (i + 1), True) for i in range(10)], []

    def reading():
        for part in parts:
            read.append(part)
            yield part
    tokenized = prepare_data._tokenized(reading(), 2, docs_per_task=1)
    first = next(tokenized)
    assert len(read) == 5
    two = [first, *tokenized]
    one = list(prepare_data._tokenized(iter(parts), 1, docs_per_task=1))
    assert len(one) == len(two) == 10
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(one, two))
    assert [a[1] for a in one] == [len(text) for text, _ in parts]


def test_small_shards_and_multiple_workers_are_deterministic(tmp_path):
    text = TINYSHAKESPEARE_PATH.read_text(encoding="utf-8")[:20_000]
    paragraphs = text.split("\n\n")
    write_rows(tmp_path / "p.jsonl", [{"text": p} for p in paragraphs])
    expected = doc_tokens(*paragraphs)
    dirs = []
    for workers in (1, 2):
        out_dir = tmp_path / f"out{workers}"
        run("--input", tmp_path / "p.jsonl", "--output_dir", out_dir, "--shard_size", "1e3",
            "--val_tokens", 1500, "--workers", workers)
        dirs.append(out_dir)
    n_train = -(-(len(expected) - 1500) // 1000)
    in_order = ["p_val_000000.bin", "p_val_000001.bin"]
    in_order += [f"p_train_{i:06d}.bin" for i in range(2, 2 + n_train)]
    assert names(dirs[0]) == sorted(in_order)
    lengths = [len(read_shard(dirs[0] / n)) for n in in_order]
    assert lengths[:2] == [1000, 500]
    assert all(n == 1000 for n in lengths[2:-1]) and 0 < lengths[-1] <= 1000
    assert split_stream(dirs[0], "val").tolist() == expected[:1500]
    assert split_stream(dirs[0], "train").tolist() == expected[1500:]
    for name in names(dirs[0]):
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes()
    assert len(check_manifest(dirs[0], "p")["shards"]) == len(in_order)


def test_hub_dataset_shares_the_local_pipeline(tmp_path, monkeypatch):
    """No network here: stand a local jsonl in for the hub and check the --dataset specifics."""
    import datasets

    real_load_dataset = datasets.load_dataset
    texts = [f"document {i} of the fake hub dataset" for i in range(40)]
    write_rows(tmp_path / "hub.jsonl", [{"text": t} for t in texts])
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return real_load_dataset("json", data_files=str(tmp_path / "hub.jsonl"), split="train",
                                 streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out_dir = tmp_path / "out"
    run("--dataset", "HuggingFaceFW/FineWeb-Edu", "--dataset_config", "sample-10BT", "--split", "train",
        "--shard_size", 100, "--output_dir", out_dir, "--workers", 1)
    assert calls == [("HuggingFaceFW/FineWeb-Edu", "sample-10BT", {"split": "train", "streaming": True})]
    expected = doc_tokens(*texts)
    # no counting pass for a hub dataset: the first shard is val
    n_train = -(-(len(expected) - 100) // 100)
    assert names(out_dir) == sorted(["fineweb-edu_val_000000.bin"] +
                                    [f"fineweb-edu_train_{i:06d}.bin" for i in range(1, 1 + n_train)])
    assert split_stream(out_dir, "val").tolist() == expected[:100]
    assert split_stream(out_dir, "train").tolist() == expected[100:]


@pytest.mark.parametrize("value, message", [
    ("1.5", "argument --shard_size: expected a whole number of tokens, got '1.5'"),
    ("abc", "argument --shard_size: not a number: 'abc'"),
    ("-5", f"--shard_size must be in [1, {MAX_SHARD_TOKENS}], got -5"),
    ("0", f"--shard_size must be in [1, {MAX_SHARD_TOKENS}], got 0"),
    ("3e9", f"--shard_size must be in [1, {MAX_SHARD_TOKENS}], got 3000000000"),
])
def test_bad_shard_size_is_rejected(tmp_path, capsys, value, message):
    """Refused by the parser, in one line that states the allowed range and names the value, before any
    shard is written (a size of 0 would never end)."""
    with pytest.raises(SystemExit):
        prepare_data._parse_args(["--shard_size", value, "--output_dir", str(tmp_path)])
    assert capsys.readouterr().err.endswith(f" error: {message}\n")
    with pytest.raises(SystemExit):
        run("--shard_size", value, "--output_dir", tmp_path)
    assert names(tmp_path) == []


# ---------------------------------------------------------------------------- safety and errors


def test_existing_output_dir_needs_overwrite(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world.")
    out_dir = tmp_path / "out"
    common = ["--input", tmp_path / "a.txt", "--output_dir", out_dir, "--workers", 1, "--val_tokens", 2]
    run(*common, "--shard_size", 2)
    assert len(names(out_dir)) > 3
    with pytest.raises(UserError) as exc:
        run(*common)
    assert str(exc.value) == (f"{out_dir} already has shards of a, made from other input or options; pass "
                              f"--overwrite to replace its a_*.bin shards, or pick another --output_dir or "
                              f"--name")
    (out_dir / ".partial").mkdir()
    (out_dir / ".partial" / "a_train_000009.bin").write_bytes(b"left by a killed run")
    run(*common, "--overwrite")
    assert names(out_dir) == ["a_train_000001.bin", "a_val_000000.bin"]
    assert not (out_dir / ".partial").exists()


def test_overwrite_removes_the_earlier_shards_and_nothing_else(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world.")
    out_dir = tmp_path / "out"
    common = ["--input", tmp_path / "a.txt", "--output_dir", out_dir, "--workers", 1, "--val_tokens", 2,
              "--overwrite"]
    run(*common, "--shard_size", 2)
    earlier = [shard["file"] for shard in check_manifest(out_dir, "a")["shards"]]
    assert len(earlier) > 3
    # other datasets' shards (one whose name starts with "a_" too) and other files stay
    foreign = ["a_b_train_000001.bin", "a_notes.bin", "notes.txt", "other_train_000001.bin"]
    for f in foreign:
        (out_dir / f).write_bytes(b"not a shard of a")
    run(*common, "--shard_size", 1000)
    assert names(out_dir) == sorted(["a_train_000001.bin", "a_val_000000.bin", *foreign])
    check_manifest(out_dir, "a")

    # a shard the manifest lists is removed even if its name is not the usual one; a listed
    # name outside out_dir is not
    manifest_path = out_dir / "a_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"] += [{"file": "a_renamed.bin"}, {"file": "../outside.bin"}]
    manifest_path.write_text(json.dumps(manifest))
    (out_dir / "a_renamed.bin").write_bytes(b"listed")
    (tmp_path / "outside.bin").write_bytes(b"listed, outside out_dir")
    run(*common, "--shard_size", 2)
    assert names(out_dir) == sorted(earlier + foreign)
    assert (tmp_path / "outside.bin").exists()

    # a manifest of an older version lists no shards: those named as its shards are removed, and
    # so are a's shards in llm.c's names without an index, which the loader would read with them
    manifest = json.loads(manifest_path.read_text())
    del manifest["shards"], manifest["max_token_id"]
    manifest_path.write_text(json.dumps(manifest))
    write_shard(out_dir / "a_train.bin", [1, 2, 3])
    write_shard(out_dir / "a_val.bin", [1, 2, 3])
    run(*common, "--shard_size", 1000)
    assert names(out_dir) == sorted(["a_train_000001.bin", "a_val_000000.bin", *foreign])
    check_manifest(out_dir, "a")


class Killed(BaseException):
    """Stands in for a SIGKILL: nothing catches it."""


def test_a_run_killed_as_it_moves_its_shards_in_leaves_the_old_or_the_new_dataset(tmp_path, monkeypatch,
                                                                                   capsys):
    """--overwrite's shards and manifest move in from a commit dir once all are made. Killed at any
    move, a run leaves the old dataset (before the commit dir is there) or one that training refuses
    and the next prepare_data run on the dir finishes, with the new manifest: never a mix."""
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world.")
    out_dir, commit = tmp_path / "out", tmp_path / "out" / ".a.commit"
    common = ["--input", tmp_path / "a.txt", "--output_dir", out_dir, "--workers", 1, "--val_tokens", 2]

    def shards():  # each shard's bytes, once the manifest lists them all
        check_manifest(out_dir, "a")
        return {name: (out_dir / name).read_bytes() for name in names(out_dir)}

    datasets = []
    for shard_size in (2, 3):  # 5 shards, then 4 of the same names, two of them holding other tokens
        run(*common, "--shard_size", shard_size, "--overwrite")
        datasets.append(shards())
    old, new = datasets
    assert len(old) == 5 and len(new) == 4 and old.keys() > new.keys()
    real_replace = os.replace
    for kill_at in range(6):  # the commit dir's rename, then 4 shards and the manifest moving out of it
        run(*common, "--shard_size", 2, "--overwrite")
        moves = []

        def killed(src, dst):
            if os.path.dirname(dst) == str(out_dir):
                moves.append(dst)
                if len(moves) == kill_at + 1:
                    raise Killed
            real_replace(src, dst)

        monkeypatch.setattr(prepare_data.os, "replace", killed)
        with pytest.raises(Killed):
            run(*common, "--shard_size", 3, "--overwrite")
        monkeypatch.undo()
        if kill_at == 0:
            shutil.rmtree(out_dir / ".partial")  # what the next run removes first
            assert shards() == old
            assert len(split_paths(out_dir, "train")) == 4
            continue
        with pytest.raises(UserError, match=f"^{commit} holds shards that a stopped prepare_data.py run "
                                            f"was moving into {out_dir}; rerun that prepare_data.py"):
            split_paths(out_dir, "train")
        capsys.readouterr()
        run(*common, "--shard_size", 3)  # finishes the move, and then has nothing to do
        assert capsys.readouterr().out.endswith("nothing to do\n") and shards() == new
    commit.mkdir()  # killed after the manifest moved in, before the commit dir was removed
    run(*common, "--shard_size", 3)
    assert shards() == new and not commit.exists()


def test_rerun_with_the_same_input_has_nothing_to_do(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world.")
    out_dir = tmp_path / "out"
    common = ["--input", tmp_path / "a.txt", "--output_dir", out_dir, "--workers", 1]
    run(*common)  # its pass that counts tokens shows progress against the input's size
    err = capsys.readouterr().err
    assert "counting tokens: 100%" in err and "writing shards: 100%" in err
    before = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}
    assert "a_manifest.json" in before
    run(*common)  # as the README's quickstart line, run twice
    assert capsys.readouterr().out == f"{out_dir} already holds the shards of this input and these " \
                                      f"options: nothing to do\n"
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == before
    for option in (["--val_tokens", 3], ["--val_fraction", 0.5], ["--shard_size", 7],
                   ["--sample_by", "paragraph"]):  # each would make other shards
        with pytest.raises(UserError, match="made from other input or options; pass --overwrite"):
            run(*common, *option)
    (tmp_path / "a.txt").write_text("Other text.")
    with pytest.raises(UserError, match="made from other input or options"):
        run(*common)


def test_datasets_of_other_names_share_an_output_dir(tmp_path, capsys):
    """Each name's shards and manifest decide alone whether a run is a rerun or a conflict, so one
    dir holds several datasets, which training picks with --dataset."""
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world.")
    (tmp_path / "b.txt").write_text("Other text, other text, and more of it.")
    out_dir = tmp_path / "out"
    first = ["--input", tmp_path / "a.txt", "--output_dir", out_dir, "--workers", 1, "--val_tokens", 2]
    run(*first)
    run("--input", tmp_path / "b.txt", "--name", "other", "--output_dir", out_dir, "--workers", 1,
        "--val_tokens", 3, "--shard_size", 4)
    check_manifest(out_dir, "a")
    check_manifest(out_dir, "other")
    a = ["a_train_000001.bin", "a_val_000000.bin"]
    other = [f"other_{split}_{i:06d}.bin" for split, i in [("train", 1), ("train", 2), ("train", 3),
                                                          ("val", 0)]]
    assert names(out_dir) == a + other
    for dataset, files in [("a", a), ("other", other)]:
        for split in ("train", "val"):
            assert split_paths(out_dir, split, dataset) == \
                   [out_dir / f for f in files if f"_{split}_" in f]
    with pytest.raises(UserError, match="holds the shards of 2 datasets \\(a, other\\): pass --dataset=NAME"):
        split_paths(out_dir, "train")
    capsys.readouterr()
    run(*first)
    assert capsys.readouterr().out.endswith("nothing to do\n")
    with pytest.raises(UserError) as exc:
        run(*first, "--shard_size", 2)
    assert str(exc.value) == (f"{out_dir} already has shards of a, made from other input or options; pass "
                              f"--overwrite to replace its a_*.bin shards, or pick another --output_dir or "
                              f"--name")
    assert names(out_dir) == a + other


@pytest.mark.parametrize("content, message", [
    ('{"text": "fine"}\n{"text": "cut\n{"text": "ok"}\n',
     "bad.jsonl line 2 is not valid JSON \\(.*\\); fix or remove that line"),
    ('{"text": 5}\n{"text": 6}\n', "bad.jsonl line 1's 'text' is the number 5, not a string; fix "
                                   "that row, or choose the text with --text_field$"),
    # a blank line is no row, but it counts as a line
    ('{"text": "a", "id": 1}\n\n{"body": "b", "id": 2}\n{"text": "c"}\n',
     "bad.jsonl line 3 has no field 'text'; its fields are body, id; choose the text with "
     "--text_field$"),
    ('{"text": "a"}\n{"text": null, "id": 2}\n', "bad.jsonl line 2's 'text' is null, not a string"),
    ('{"text": "a"}\n{"text": true}\n', "bad.jsonl line 2's 'text' is the boolean true, not a string"),
    ('{"text": "a"}\n{}\n', "bad.jsonl line 2 has no field 'text'; it has no fields;"),
    ('{"text": "a"}\n\n[{"text": "b"}]\n',
     "bad.jsonl line 3 is an array, not an object with a 'text' string; fix or remove it$"),
    ('{"text": "a"}\nnull\n', "bad.jsonl line 2 is null, not an object with a 'text' string"),
    ('{"text": "a"}\n"b"\n', "bad.jsonl line 2 is the string 'b', not an object with a 'text'"),
    (b'{"text": "a"}\n{"text": "\xff"}\n',
     "bad.jsonl line 2 is not valid UTF-8 \\(first bad byte at offset 10\\); fix or remove that line"),
    # a surrogate pair is one character; a lone surrogate is no text to tokenize
    ('{"text": "\\ud83d\\ude00"}\n{"text": "a\\ud800b"}\n',
     "bad.jsonl line 2 holds a lone surrogate escape \\(\\\\ud800\\), which is no Unicode text; "
     "fix or remove that line$"),
])
def test_bad_rows_are_named_by_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=message):
        run("--input", tmp_path / "bad.jsonl", "--output_dir", tmp_path / "out", "--workers", 1)
    assert not (tmp_path / "out").exists()  # a failed run leaves no empty output directory


def test_parquet_row_without_text_is_named_by_row(tmp_path):
    write_rows(tmp_path / "rows.parquet", [{"text": "a", "id": 1}, {"id": 2}])
    with pytest.raises(UserError, match="rows.parquet row 2's 'text' is null, not a string;"):
        run("--input", tmp_path / "rows.parquet", "--output_dir", tmp_path / "out", "--workers", 1)
    write_rows(tmp_path / "rows.parquet", [{"text": b"a"}])  # a type JSON lacks, named with its value
    with pytest.raises(UserError, match="rows.parquet row 1's 'text' is a bytes \\(\"b'a'\"\\), not a "
                                        "string;"):
        run("--input", tmp_path / "rows.parquet", "--output_dir", tmp_path / "out", "--workers", 1)


def test_a_parquet_file_that_does_not_parse_is_named_in_one_line(tmp_path):
    """datasets' own log of the failure, on stderr, would repeat the error's line before it."""
    import datasets
    datasets.logging.set_verbosity_warning()  # its default, which an earlier run in this process changed
    logged, handler = [], logging.Handler()
    handler.emit = logged.append
    datasets.logging.get_logger().addHandler(handler)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    try:
        with pytest.raises(UserError, match=f"^cannot read {tmp_path / 'bad.parquet'}: "):
            run("--input", tmp_path / "bad.parquet", "--output_dir", tmp_path / "out", "--workers", 1)
    finally:
        datasets.logging.get_logger().removeHandler(handler)
    assert [record.getMessage() for record in logged] == []


def test_row_without_text_ends_the_command_in_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    proc = subprocess.run([sys.executable, prepare_data.__file__, "--input", tmp_path / "bad.jsonl",
                           "--output_dir", tmp_path / "out", "--workers", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    # what comes before the error is the progress bar, drawn on one line
    assert proc.stderr.splitlines()[-1] == (
        f"prepare_data.py: error: {tmp_path / 'bad.jsonl'} line 2 has no field 'text'; its fields "
        f"are body; choose the text with --text_field")
    assert not (tmp_path / "out").exists()


def test_unwritable_output_dir_fails_before_tokenizing(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("Hello world")
    blocker = tmp_path / "file"  # a file where the output dir's parent should be (root ignores chmod)
    blocker.write_text("not a directory")
    monkeypatch.setattr(prepare_data, "_tokenized", lambda *a: pytest.fail("tokenized first"))
    with pytest.raises(UserError, match=f"cannot write to {blocker}/out: Not a directory; pick a "
                                         f"writable --output_dir"):
        run("--input", tmp_path / "a.txt", "--output_dir", blocker / "out")


def test_empty_input_is_an_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    for path, extra in [("empty.txt", []), ("blank.jsonl", []), ("blank.jsonl", ["--val_tokens", 1])]:
        with pytest.raises(UserError) as exc:
            run("--input", tmp_path / path, "--output_dir", tmp_path / "out", "--workers", 1, *extra)
        assert "empty input" in str(exc.value)
        assert not (tmp_path / "out").exists()


def test_a_failed_run_keeps_an_empty_output_dir_it_did_not_make(tmp_path):
    """Guards that a failed run removes only an output dir it made: an empty --output_dir that
    existed before stays, whether the run fails before writing (a row without text) or while
    writing its shards (empty input), and one the run made is removed."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"body": "b"}\n')
    for path in ("bad.jsonl", "empty.txt"):
        mine, made = tmp_path / f"mine_{path}", tmp_path / f"made_{path}"
        mine.mkdir()
        for out in (mine, made):
            with pytest.raises(UserError):
                run("--input", tmp_path / path, "--output_dir", out, "--workers", 1)
        assert mine.is_dir() and not any(mine.iterdir())  # the user's dir, kept as it was
        assert not made.exists()


def test_unmatched_glob_and_bad_extensions_are_errors(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.jsonl").write_text('{"text": "b"}\n')
    (tmp_path / "c.csv").write_text("text\nc\n")
    for inputs, message in [([tmp_path / "nope*.txt"], f"no files match '{tmp_path}/nope*.txt'"),
                            ([tmp_path / "a.txt", tmp_path / "b.jsonl"],
                             "all --input files must have one extension, got .jsonl, .txt"),
                            ([tmp_path / "c.csv"],
                             "unsupported file extension .csv; supported: .txt, .jsonl, .json, .parquet")]:
        with pytest.raises(UserError) as exc:
            run("--input", *inputs, "--output_dir", tmp_path / "out")
        assert str(exc.value) == message


def test_non_utf8_txt_is_an_error_or_skipped(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"Hello \xff world")
    (tmp_path / "good.txt").write_text("Hello world")
    out_dir = tmp_path / "out"
    with pytest.raises(UserError) as exc:
        run("--input", tmp_path / "*.txt", "--output_dir", out_dir, "--workers", 1)
    problem = f"{tmp_path / 'bad.txt'} is not valid UTF-8 (first bad byte at offset 6)"
    assert str(exc.value) == f"{problem}; fix it, or pass --skip_bad_files to skip it"
    assert not out_dir.exists()

    run("--input", tmp_path / "*.txt", "--output_dir", out_dir, "--workers", 1, "--val_tokens", 1,
        "--skip_bad_files")
    assert capsys.readouterr().err.startswith(f"prepare_data.py: warning: skipping {problem}\n")
    assert names(out_dir) == ["bad_train_000001.bin", "bad_val_000000.bin"]
    assert split_stream(out_dir, "train").tolist() == [15496, 995]


def test_a_json_array_item_that_is_not_a_document_is_named_by_item(tmp_path):
    (tmp_path / "a.json").write_text('[{"text": "a"}, 5]')
    (tmp_path / "b.json").write_text('[{"text": "a"},\n {"text": "b"]')
    for path, message in [("a.json", "a.json item 2 is the number 5, not an object with a 'text' string"),
                          ("b.json", "b.json is not valid JSON \\(.*line 2 column 14.*\\); fix it$")]:
        with pytest.raises(UserError, match=message):
            run("--input", tmp_path / path, "--output_dir", tmp_path / "out", "--workers", 1)


def test_a_name_that_is_not_a_plain_file_name_is_refused_and_nothing_is_written(tmp_path):
    """Every file is written as {output_dir}/{name}_*: a name with a path in it would escape."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("Hello world, hello world, hello world.")
    out_dir = tmp_path / "x" / "y" / "out"
    proc = subprocess.run([sys.executable, prepare_data.__file__, "--input", tmp_path / "in" / "a.txt",
                           "--name", "../../escaped", "--output_dir", out_dir],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == ("prepare_data.py: error: --name '../../escaped' is not a plain file name (it is "
                           "empty, '.' or '..', or holds a path separator); pass --name with a plain "
                           "name, such as books\n")
    for name in ["a/b", "", ".", ".."]:
        with pytest.raises(UserError, match=f"^--name '{re.escape(name)}' is not a plain file name"):
            run("--input", tmp_path / "in" / "a.txt", "--name", name, "--output_dir", out_dir)
    # the default name of a hub dataset is its last path component, checked before any download
    with pytest.raises(UserError, match="^the name taken from dataset a/.. '..' is not a plain"):
        run("--dataset", "a/..")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.txt", "in"]

    # a link where the staging dir goes is replaced, not followed
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("not prepare_data's")
    out_dir.mkdir(parents=True)
    (out_dir / ".partial").symlink_to(tmp_path / "elsewhere")
    run("--input", tmp_path / "in" / "a.txt", "--output_dir", out_dir, "--workers", 1)
    assert names(out_dir) == ["a_train_000001.bin", "a_val_000000.bin"]
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["keep.txt"]


def test_a_rerun_makes_missing_or_resized_shards_again(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world.")
    out_dir = tmp_path / "out"
    common = ["--input", tmp_path / "a.txt", "--output_dir", out_dir, "--workers", 1, "--val_tokens", 2,
              "--shard_size", 3]
    run(*common)
    made = {name: (out_dir / name).read_bytes() for name in names(out_dir)}
    assert len(made) == 4
    (out_dir / "a_train_000002.bin").unlink()
    with open(out_dir / "a_train_000003.bin", "ab") as f:
        f.write(b"xy")
    capsys.readouterr()
    run(*common)
    assert capsys.readouterr().out == (f"{out_dir}/a_train_000002.bin, which a_manifest.json lists, is "
                                       f"missing: making the shards of this input again\n"
                                       f"wrote 4 shard(s) to {out_dir}\n"
                                       f"  val  :    1 shard(s)               2 tokens\n"
                                       f"  train:    3 shard(s)               8 tokens\n")
    assert {name: (out_dir / name).read_bytes() for name in names(out_dir)} == made
    check_manifest(out_dir, "a")
    with open(out_dir / "a_train_000003.bin", "ab") as f:
        f.write(b"xy")
    run(*common)
    assert capsys.readouterr().out.startswith(f"{out_dir}/a_train_000003.bin is 1030 bytes, not the "
                                              f"1028 a_manifest.json lists: making the shards")
    assert {name: (out_dir / name).read_bytes() for name in names(out_dir)} == made
    # a file named like a shard that the manifest does not list is not removed without --overwrite
    write_shard(out_dir / "a_train.bin", [1, 2, 3])
    with pytest.raises(UserError, match=f"^{out_dir}/a_train.bin is named like a shard of a but "
                                        f"a_manifest.json does not list it, so training would read it"):
        run(*common)


@pytest.mark.parametrize("option", [["--split", "validation"], ["--dataset_config", "sample-10BT"]])
def test_a_hub_option_without_dataset_is_refused(tmp_path, capsys, option):
    """--split and --dataset_config choose what to stream from the hub; on local input they would be
    ignored, and the user would get other shards than asked for."""
    (tmp_path / "a.txt").write_text("Hello world.")
    with pytest.raises(SystemExit):
        run("--input", tmp_path / "a.txt", "--output_dir", tmp_path / "out", *option)
    assert "error: --dataset_config and --split only apply to --dataset" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_input_without_a_val_split_is_refused(tmp_path, capsys):
    """train_gpt2.py evaluates on the val split and refuses data without one."""
    (tmp_path / "a.txt").write_text("Hello world.")
    for option, rule in [(["--val_fraction", 0], "--val_fraction must be in (0, 1)"),
                         (["--val_tokens", 0], "--val_tokens must be >= 1, got 0"),
                         (["--val_tokens", -2], "--val_tokens must be >= 1, got -2")]:
        with pytest.raises(SystemExit):
            run("--input", tmp_path / "a.txt", "--output_dir", tmp_path / "out", *option)
        assert capsys.readouterr().err.endswith(f"error: {rule}: training needs a val split\n")
    with pytest.raises(UserError, match=r"^--val_fraction 0.1 of the input's 4 tokens is 0 tokens, and "
                                        r"training needs a val split; raise --val_fraction or pass "
                                        r"--val_tokens N$"):
        run("--input", tmp_path / "a.txt", "--output_dir", tmp_path / "out", "--workers", 1)
    with pytest.raises(UserError, match=r"^the input has only 4 tokens, all of them went to val \(--val_tokens "
                                        r"10\); no train shard was written$"):
        run("--input", tmp_path / "a.txt", "--output_dir", tmp_path / "out", "--workers", 1,
            "--val_tokens", 10)
    assert not (tmp_path / "out").exists()


def test_fewer_than_one_worker_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run("--workers", 0, "--output_dir", tmp_path / "out")
    assert capsys.readouterr().err.endswith("error: --workers must be >= 1\n")
    assert not (tmp_path / "out").exists()


def test_a_sample_by_other_than_document_or_paragraph_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run("--sample_by", "line", "--output_dir", tmp_path / "out")
    err = capsys.readouterr().err  # argparse quotes the choices on some Python versions, not others
    assert re.search(r"error: argument --sample_by: invalid choice: 'line' \(choose from "
                     r"'?document'?, '?paragraph'?\)\n$", err)
    assert not (tmp_path / "out").exists()


def test_an_input_that_is_not_a_file_or_is_matched_twice_is_named(tmp_path):
    (tmp_path / "books.txt").mkdir()
    (tmp_path / "gone.txt").symlink_to(tmp_path / "moved.txt")
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world.")
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")
    for inputs, message in [
            (["books.txt"], f"input {tmp_path}/books.txt is a directory, not a file; pass the files in "
                            f"it, e.g. --input '{tmp_path}/books.txt/\\*.txt'"),
            (["gone.txt"], f"input {tmp_path}/gone.txt is a dangling link \\(to {tmp_path}/moved.txt: "
                           f"No such file or directory\\)"),
            (["a.txt", "a*.txt"], f"input {tmp_path}/a.txt is matched more than once, so its documents "
                                  f"would be in the data twice; pass each file once$"),
            (["a.txt", "link.txt"], f"input {tmp_path}/link.txt is matched more than once \\(also as "
                                    f"{tmp_path}/a.txt\\)")]:
        with pytest.raises(UserError, match=f"^{message}"):
            run("--input", *[tmp_path / i for i in inputs], "--output_dir", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_input_that_cannot_be_opened_is_named_before_anything_is_read(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')

    def refuse(path, *args, **kwargs):  # as open() of a file without read permission (root ignores chmod)
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(prepare_data, "open", refuse, raising=False)
    with pytest.raises(UserError, match=f"^cannot read input {tmp_path}/a.jsonl: Permission denied$"):
        run("--input", tmp_path / "a.jsonl", "--output_dir", tmp_path / "out", "--workers", 1)
    assert not (tmp_path / "out").exists()


def test_a_hub_dataset_out_of_reach_is_one_line(tmp_path):
    """What an offline machine gets from scripts/prepare_fineweb_edu.sh (HF_HUB_OFFLINE makes the
    hub's refusal immediate instead of after its retries)."""
    proc = subprocess.run([sys.executable, "prepare_data.py", "--dataset", "HuggingFaceFW/fineweb-edu",
                           "--dataset_config", "sample-10BT", "--output_dir", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    assert re.fullmatch(r"prepare_data.py: error: cannot read HuggingFaceFW/fineweb-edu: Couldn't reach "
                        r"'HuggingFaceFW/fineweb-edu' on the Hub \(\w+\)\n", proc.stderr), proc.stderr


def test_an_unreachable_hub_is_one_line_after_its_retries(tmp_path):
    """A hub that refuses connections (HF_ENDPOINT on a closed port), its retries' back-off sleeps
    skipped: prepare_data says what it opens, then fails in one line, no retry warnings."""
    code = ("import runpy, sys, time; time.sleep = lambda seconds: None; "
            f"sys.argv = ['prepare_data.py', '--dataset', 'HuggingFaceFW/fineweb-edu', '--output_dir', "
            f"{str(tmp_path / 'out')!r}]; "
            "runpy.run_path('prepare_data.py', run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout a pipe, buffered
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=dict(env, HF_ENDPOINT="http://127.0.0.1:9"))
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    # one pipe for both, as a log is: the "opening" line is out before the retries, not at exit
    assert re.fullmatch(r"opening HuggingFaceFW/fineweb-edu on the Hugging Face hub\n"
                        r"prepare_data.py: error: cannot read HuggingFaceFW/fineweb-edu: [^\n]+\n",
                        proc.stdout), proc.stdout


# ---------------------------------------------------------------------------- runs stopped or at once


def prepare(*args, **popen):
    """The prepare_data.py command, started: its stdout and stderr are pipes of text."""
    return subprocess.Popen([sys.executable, "prepare_data.py", *map(str, args)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def test_two_runs_at_once_on_one_output_dir_take_turns(tmp_path):
    """Nodes sharing a filesystem each prepare the same data into one dir: the second run waits,
    saying for whom, and then has nothing to do. No run removes the other's staging or shards."""
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world.")
    out_dir, lock = tmp_path / "out", tmp_path / "out" / ".prepare_data.lock"
    command = ["--input", tmp_path / "a.txt", "--output_dir", out_dir, "--workers", 1]
    first = prepare(*command)
    while first.poll() is None and not (lock.exists() and lock.read_text().startswith("pid")):
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # holding the lock, until the second run says it waits
    try:
        assert lock.read_text() == f"pid {first.pid} on {socket.gethostname()}\n"
        second = prepare(*command)
        assert second.stdout.readline() == (f"waiting for the other prepare_data run on {out_dir} "
                                            f"(pid {first.pid} on {socket.gethostname()}) to end\n")
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.communicate(timeout=60)[0].startswith(f"wrote 2 shard(s) to {out_dir}\n")
    assert second.communicate(timeout=60)[0] == (f"{out_dir} already holds the shards of this input "
                                                 f"and these options: nothing to do\n")
    assert first.returncode == second.returncode == 0
    assert names(out_dir) == ["a_train_000001.bin", "a_val_000000.bin"]
    check_manifest(out_dir, "a")


def started_with_workers(tmp_path, **popen):
    """prepare_data.py on many short documents that keep 2 tokenizer workers busy for seconds, once
    both have started; and their pids."""
    lines = TINYSHAKESPEARE_PATH.read_text(encoding="utf-8").splitlines() * 2
    write_rows(tmp_path / "big.jsonl", [{"text": line} for line in lines])
    proc = prepare("--input", tmp_path / "big.jsonl", "--output_dir", tmp_path / "out", "--workers", 2, **popen)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    while proc.poll() is None and len(children.read_text().split()) < 2:
        time.sleep(0.01)
    assert proc.poll() is None, "prepare_data.py ended before its workers could be found"
    return proc, [int(pid) for pid in children.read_text().split()]


def test_a_killed_tokenizer_worker_ends_the_run_in_one_line(tmp_path):
    """A worker killed by the out-of-memory killer (SIGKILL) hung multiprocessing.Pool forever."""
    proc, workers = started_with_workers(tmp_path)
    os.kill(workers[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in stderr
    assert stderr.splitlines()[-1] == (
        "prepare_data.py: error: a tokenizer worker died (killed, by the out-of-memory killer?); nothing "
        "was written; free memory or lower --workers (now 2), and rerun")
    assert not (tmp_path / "out").exists()


def test_ctrl_c_stops_the_workers_quietly_and_leaves_nothing(tmp_path):
    """Ctrl-C reaches the whole process group. The workers ignore it, so that only the main process
    reports it, in one line (configurator.run), and the staging dir and the lock go."""
    proc, workers = started_with_workers(tmp_path, start_new_session=True, preexec_fn=ctrl_c_reaches)
    shown = ""
    while "tokens]" not in shown:  # the progress bar counts the workers' first tokens
        shown += proc.stderr.read(1) or pytest.fail(f"prepare_data.py ended first: {shown}")
    proc.send_signal(signal.SIGSTOP)  # the workers finish their batches and wait for more
    while any(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S" for pid in workers):
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    stderr = shown + proc.communicate(timeout=60)[1]
    assert proc.returncode == 130 and "Traceback" not in stderr
    assert stderr.splitlines()[-1] == "prepare_data.py: interrupted"
    assert not (tmp_path / "out").exists()


def test_sigterm_ends_the_workers_with_the_main_process(tmp_path):
    """Left alone, the workers would outlive a main process that SIGTERM ends: it kills them, busy or
    not (stopped here, as on a long batch), and then ends by SIGTERM, as before, silently; no shard or
    manifest is in place, only the staging dir and lock that the next run replaces."""

    def alive(pid):  # neither gone nor a zombie
        with contextlib.suppress(FileNotFoundError):
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"

    proc, workers = started_with_workers(tmp_path)
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
        deadline = time.monotonic() + 2
        while left := [pid for pid in workers if alive(pid)]:
            assert time.monotonic() < deadline, f"workers {left} outlived the main process"
            time.sleep(0.01)
    finally:
        proc.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGTERM
    assert "Traceback" not in proc.communicate(timeout=30)[1]
    assert {p.name for p in (tmp_path / "out").iterdir()} <= {".partial", ".prepare_data.lock"}


def test_a_document_with_nowhere_to_cut_is_refused_in_one_line(tmp_path):
    """tiktoken's memory grows with its longest piece of text without whitespace, and its regex
    fails on a long whitespace run: a document with nowhere to cut one off is named instead."""
    blob = "x" * (prepare_data.PART_CHARS + 1)
    write_rows(tmp_path / "a.jsonl", [{"text": "fine"}, {"text": "Hi " + blob}])
    proc = prepare("--input", tmp_path / "a.jsonl", "--output_dir", tmp_path / "out", "--workers", 2)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in stderr
    assert stderr.splitlines()[-1] == (
        f"prepare_data.py: error: {tmp_path / 'a.jsonl'} line 2 has 262,144 characters with no space, tab "
        f"or newline after another; too long to tokenize, split or remove it")
    (tmp_path / "a.txt").write_text("Hi" + "\n" * prepare_data.PART_CHARS)
    with pytest.raises(UserError, match=f"^{tmp_path / 'a.txt'} has 262,144 characters with no space"):
        run("--input", tmp_path / "a.txt", "--output_dir", tmp_path / "out", "--workers", 1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("ext", [".txt", ".jsonl"])
def test_an_input_deleted_between_the_two_passes_is_named(tmp_path, monkeypatch, ext):
    path = tmp_path / f"a{ext}"
    text = "Hello world, hello world, hello world. " * 10
    write_rows(path, [{"text": text}]) if ext == ".jsonl" else path.write_text(text)
    real_tokenized, passes = prepare_data._tokenized, []

    def deleted_before_the_second_pass(parts, workers):
        passes.append(parts)
        if len(passes) == 2:
            path.unlink()
        return real_tokenized(parts, workers)

    monkeypatch.setattr(prepare_data, "_tokenized", deleted_before_the_second_pass)
    with pytest.raises(UserError, match=f"^{path} vanished or changed while prepare_data read it \\(No such "
                                        f"file or directory\\); rerun$"):
        run("--input", path, "--output_dir", tmp_path / "out", "--workers", 1)
    assert len(passes) == 2 and not (tmp_path / "out").exists()


def test_the_quickstart_script_prepares_the_data_whatever_a_killed_run_left(tmp_path):
    """It skipped prepare_data.py where data/tinyshakespeare existed, a killed run's staging dir
    in it included; prepare_data.py itself says in a second that it has nothing to do."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "quickstart_cpu.sh", root / "scripts")
    (root / "prepare_data.py").write_text("open('prepared', 'w').close()\n")
    (root / "data" / "tinyshakespeare" / ".partial").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "bin" / "torchrun").write_text('#!/bin/sh\necho torchrun "$@"\n')
    (tmp_path / "bin" / "torchrun").chmod(0o755)
    proc = subprocess.run(["bash", root / "scripts" / "quickstart_cpu.sh", "--max_steps=1"], capture_output=True,
                          text=True, env=dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}"))
    assert proc.returncode == 0 and (root / "prepared").exists()
    assert proc.stdout == ("torchrun --standalone --nproc_per_node=2 train_gpt2.py configs/shakespeare_cpu.toml "
                           "--max_steps=1\n")


def test_the_counting_bar_ends_at_the_inputs_bytes_with_the_json_around_the_text(tmp_path, capsys):
    rows = "".join(json.dumps({"text": f"row {i} of some text", "id": i}) + "\n" for i in range(50))
    (tmp_path / "rows.jsonl").write_text(rows)
    run("--input", tmp_path / "rows.jsonl", "--output_dir", tmp_path / "out", "--workers", 1)
    shown = re.findall(r"counting tokens: +(\d+)%", capsys.readouterr().err)
    assert shown and shown[-1] == "100"
