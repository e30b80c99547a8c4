"""Shards that cannot be trained on are refused in one line before step 0, naming the file and what
is wrong with it: gpt2_ddp/shards.py's checks, which train_gpt2.py runs as it builds its loaders."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

import train_gpt2
from conftest import ROOT, TINY, make_shards
from gpt2_ddp.configurator import UserError
from gpt2_ddp.shards import (DocumentRows, check_token_ids, document_starts, max_token_ids, read_tokens,
                             split_paths, write_shard)
import prepare_data


def refused(data_dir, out_dir):
    """The UserError message of train_gpt2.py's main on data_dir, which must stop before step 0,
    so before the log of out_dir is written."""
    with pytest.raises(UserError) as info:
        train_gpt2.main([*TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--max_steps=1"])
    assert not (out_dir / "log.jsonl").exists()
    return str(info.value)


def test_a_shard_without_tokens_is_one_line_before_step_0(tmp_path):
    """An empty split made the loader's batches_per_epoch -1: an IndexError at step 1."""
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "tiny_val_000000.bin", np.arange(100))
    write_shard(data / "tiny_train_000001.bin", [])
    proc = subprocess.run([sys.executable, "train_gpt2.py", *TINY, f"--data_dir={data}",
                           f"--out_dir={tmp_path}/out"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and not re.search(r"^step", proc.stdout, re.M)
    assert proc.stderr == (f"train_gpt2.py: error: shard {data}/tiny_train_000001.bin holds no tokens "
                           f"(its header says 0): remove it, or remake the shards with `python "
                           f"prepare_data.py --overwrite` (see README)\n")


def test_a_shard_rewritten_under_an_old_or_stale_manifest_is_read_again(tmp_path):
    """A manifest's max_token_id counts only while the shard's size and mtime are those it lists: a
    shard rewritten with ids beyond vocab_size, to the same size, is read and refused."""
    data = tmp_path / "data"
    make_shards(data)
    bad = data / "tiny_train_000002.bin"
    entries = [{"file": p.name, "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns,
                "tokens": 2000, "max_token_id": 63} for p in sorted(data.glob("*.bin"))]
    (data / "tiny_manifest.json").write_text(json.dumps({"shards": entries}))
    old = bad.stat()
    write_shard(bad, np.full(2000, 600))
    assert bad.stat().st_size == old.st_size
    message = f"shard {bad} holds token id 600, beyond vocab_size=512"
    assert refused(data, tmp_path / "stale").startswith(message)
    # a manifest made before mtimes were listed: a same-size shard with its old mtime is read too
    os.utime(bad, ns=(old.st_atime_ns, old.st_mtime_ns))
    for entry in entries:
        del entry["mtime_ns"]
    (data / "tiny_manifest.json").write_text(json.dumps({"shards": entries}))
    assert refused(data, tmp_path / "old").startswith(message)


def test_a_val_shard_with_a_token_id_beyond_vocab_size_is_refused_before_step_0(tmp_path):
    """Evaluations read the val split too: its shards are checked with the train split's."""
    data = tmp_path / "data"
    make_shards(data)
    write_shard(data / "tiny_val_000000.bin", np.full(1000, 600))
    assert refused(data, tmp_path / "out").startswith(f"shard {data / 'tiny_val_000000.bin'} holds token "
                                                      f"id 600, beyond vocab_size=512")


def odd_sized(path):
    with open(path, "ab") as f:
        f.write(b"x")


def sized_over_header(path):
    with open(path, "ab") as f:
        f.write(b"xy")


def directory(path):
    path.unlink()
    path.mkdir()


def dangling_link(path):
    path.unlink()
    path.symlink_to(path.parent / "moved_away.bin")


def pipe(path):
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("damage, message", [
    (odd_sized, "shard {path} is 5025 bytes, not the 5024 of its header's 2000 tokens, and not a "
                "whole number of 2-byte tokens: corrupt; remake the shards"),
    (sized_over_header, "shard {path} holds 2001 tokens but its header says 2000 (5026 bytes, not "
                        "5024): truncated or corrupt"),
    (directory, "{path} is a directory, named like a shard: a shard is a file; move or rename it"),
    (dangling_link, "{path} is a dangling link (to {path.parent}/moved_away.bin: No such file or "
                    "directory), named like a shard; point it at a shard or remove it"),
    (pipe, "{path} is not a regular file (a pipe, socket or device), named like a shard"),
])
def test_a_path_named_like_a_shard_that_is_not_one_is_named_in_one_line(tmp_path, damage, message):
    data = tmp_path / "data"
    make_shards(data)
    path = data / "tiny_train_000001.bin"
    damage(path)
    assert re.match(re.escape(message.format(path=path)), refused(data, tmp_path / "out"))


def test_a_data_dir_that_is_a_file_is_named(tmp_path):
    """A shard passed as --data_dir was read as a directory holding no shards."""
    make_shards(tmp_path / "data")
    shard = tmp_path / "data" / "tiny_train_000001.bin"
    assert refused(shard, tmp_path / "out") == (f"data_dir {shard} is a file, not a directory of "
                                                f"shards; pass the directory that holds the shards")


def test_training_reads_only_the_shards_that_the_manifest_lists_at_their_sizes(tmp_path):
    """Where prepare_data.py's manifest is, a shard it does not list, or one it lists that is
    missing or of another size in bytes, longer or shorter, is refused before any training (not one
    of another mtime: cp gives a copy a new one). Shards without a manifest, as llm.c makes them, are read."""
    (tmp_path / "a.txt").write_text("Hello world, hello world, hello world. " * 20)
    data = tmp_path / "data"
    prepare_data.main(["--input", str(tmp_path / "a.txt"), "--output_dir", str(data), "--workers", "1",
                       "--shard_size", "50", "--val_tokens", "50"])
    train = split_paths(data, "train")
    assert len(train) == 3
    shutil.copy(train[0], tmp_path / "copy.bin")
    shutil.copy(tmp_path / "copy.bin", train[0])  # the same bytes, a new mtime
    assert split_paths(data, "train", "a") == train
    stray = data / "a_train_000009.bin"
    write_shard(stray, np.arange(50))
    assert refused(data, tmp_path / "out") == (
        f"{stray} is named like a shard of a but a_manifest.json does not list it, so training would read "
        f"it with them; move it out, or pass prepare_data.py --overwrite to remove it and make the "
        f"shards again")
    stray.unlink()
    rerun = ", so these are not the shards prepare_data.py made; rerun its command to make them again"
    train[1].rename(tmp_path / "moved.bin")
    with pytest.raises(UserError, match=f"^{re.escape(f'{train[1]}, which a_manifest.json lists, is missing{rerun}')}$"):
        split_paths(data, "val")
    (tmp_path / "moved.bin").rename(train[1])
    listed = train[1].read_bytes()
    sized_over_header(train[1])
    with pytest.raises(UserError, match=f"^{train[1]} is 1126 bytes, not the 1124 a_manifest.json lists{rerun}$"):
        split_paths(data, "train")
    shorter = f"{train[1]} is 1122 bytes, not the 1124 a_manifest.json lists{rerun}"
    # cut short in place, then rewritten shorter with a header that agrees, which only the manifest tells
    for cut in (lambda: os.truncate(train[1], 1122),
                lambda: write_shard(train[1], np.frombuffer(listed[1024:-2], dtype="<u2"))):
        train[1].write_bytes(listed)
        cut()
        with pytest.raises(UserError, match=f"^{re.escape(shorter)}$"):
            split_paths(data, "train")
    (data / "a_manifest.json").unlink()
    assert split_paths(data, "train") == train


def test_a_dataset_that_data_dir_lacks_is_named_with_those_it_holds(tmp_path):
    for name in ("tinyshakespeare", "books"):
        write_shard(tmp_path / f"{name}_val_000000.bin", np.arange(10))
    with pytest.raises(UserError, match=re.escape(
            f"no train shards (nomatch_train_NNNNNN.bin or llm.c's nomatch_train.bin) in {tmp_path}, which "
            f"holds the shards of books, tinyshakespeare: pass --dataset= one of them")):
        split_paths(tmp_path, "train", "nomatch")


def test_the_advice_for_missing_shards_makes_them_where_data_dir_points_from_any_cwd(tmp_path, monkeypatch):
    """data_dir is relative to the cwd, prepare_data.py's default output dir to the script: from
    another cwd, the advice names the script by its path and data_dir as its --output_dir."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=re.escape(
            f"make them with `python {ROOT}/prepare_data.py --input FILES --name books --output_dir "
            f"d/books`, then rerun `python {shlex.join(sys.argv)}`; or try the small CPU config: cd {ROOT} && "
            f"python prepare_data.py && python train_gpt2.py configs/shakespeare_cpu.toml")):
        split_paths("d/books", "train")
    with pytest.raises(UserError) as info:
        split_paths("data/tinyshakespeare", "train")
    advice = re.search("make them with `python ([^`]*)`", str(info.value))[1]
    assert advice == f"{ROOT}/prepare_data.py --output_dir data/tinyshakespeare"
    subprocess.run([sys.executable, *advice.split(), "--workers", "2"], check=True, capture_output=True)
    assert [p.name for p in split_paths("data/tinyshakespeare", "train")] == [
        "tinyshakespeare_train_000001.bin"]


def test_advice_to_rerun_is_in_the_form_the_user_launched(monkeypatch):
    """python for one process; torchrun, with --standalone on one node, for torchrun's workers."""
    for env, command in [({}, "python"),
                         ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, "torchrun --standalone --nproc_per_node=2"),
                         ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16"}, "torchrun --nnodes=2 --nproc_per_node=8")]:
        for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(UserError, match=re.escape(f"then rerun `{command} {shlex.join(sys.argv)}`; or try "
                                                      f"the small CPU config: python prepare_data.py && {command} "
                                                      f"train_gpt2.py configs/shakespeare_cpu.toml")):
            split_paths(ROOT / "data" / "fineweb-edu-missing", "train")


def test_a_token_id_equal_to_vocab_size_is_refused(tmp_path):
    """The embedding's rows are 0 .. vocab_size - 1: a shard whose largest id is vocab_size itself
    is refused, one whose largest is vocab_size - 1 is not, down to a shard of 0s and vocab_size 1."""
    shard = tmp_path / "t_train.bin"
    write_shard(shard, [1, 2, 600])
    with pytest.raises(UserError, match="holds token id 600, beyond vocab_size=600"):
        check_token_ids([shard], 600, tmp_path / "a.json", 0, 1, lambda values: values)
    check_token_ids([shard], 601, tmp_path / "b.json", 0, 1, lambda values: values)
    zeros = tmp_path / "z_train.bin"
    write_shard(zeros, [0, 0])
    check_token_ids([zeros], 1, tmp_path / "c.json", 0, 1, lambda values: values)


def test_a_shard_longer_than_one_read_is_scanned_to_its_end(tmp_path):
    """The token-id check and the document index read a shard 2**24 tokens at a time: the largest id
    in the first read, and a document start in the second, count as in a shard read at once."""
    tokens = np.zeros((1 << 24) + 8, dtype=np.uint16)
    tokens[5] = 600
    tokens[[3, (1 << 24) + 4]] = 9  # the documents' start token here
    shard = tmp_path / "t_train.bin"
    write_shard(shard, tokens)
    assert max_token_ids([shard], tmp_path / "ids.json", 0, 1, lambda values: values) == [600]
    assert document_starts(shard, 9).tolist() == [3, (1 << 24) + 4]


def test_a_token_id_cache_that_cannot_be_written_or_read_is_skipped(tmp_path):
    """The cache only saves the next run a scan: a read-only or full out_dir, a directory in its
    place or a file that is not its JSON object leaves this run's check as it was."""
    shard = tmp_path / "t_train.bin"
    write_shard(shard, [3, 9, 4])
    (tmp_path / "ids.json").mkdir()
    assert max_token_ids([shard], tmp_path / "ids.json", 0, 1, lambda values: values) == [9]
    (tmp_path / "ids.json").rmdir()
    (tmp_path / "ids.json").write_text("[]")  # JSON, but not the cache's object: read the shard
    assert max_token_ids([shard], tmp_path / "ids.json", 0, 1, lambda values: values) == [9]


def test_a_cached_largest_token_id_of_0_is_read_from_the_cache(tmp_path, monkeypatch):
    """A largest id of 0 (a shard of the token "!") is one like any other, not the mark of a shard
    left unscanned: the next run takes it from the cache and reads no shard."""
    from gpt2_ddp import shards
    shard = tmp_path / "t_train.bin"
    write_shard(shard, [0, 0, 0])
    assert max_token_ids([shard], tmp_path / "ids.json", 0, 1, lambda values: values) == [0]
    monkeypatch.setattr(shards, "read_tokens", lambda path: pytest.fail(f"{path} scanned again"))
    assert max_token_ids([shard], tmp_path / "ids.json", 0, 1, lambda values: values) == [0]


def test_a_scan_shorter_than_a_second_shows_no_bar(tmp_path, capsys):
    """The token-id check's and the document index's progress bars show once a scan has taken a
    second (tqdm's delay): a run over small shards prints its own lines alone."""
    shard = tmp_path / "t_train.bin"
    write_shard(shard, [3, 9, 4, 9])
    assert max_token_ids([shard], tmp_path / "ids.json", 0, 1, lambda values: values) == [9]
    assert len(DocumentRows([shard], [4], 2, 9, 0, "train split")) == 2
    assert capsys.readouterr().err == ""


def test_each_rank_scans_its_own_shards_for_token_ids(tmp_path, monkeypatch):
    """max_token_ids at world size 2: shard i is scanned by rank i % 2 alone (-1 on the other), and
    the element-wise maximum of the two ranks' lists is every shard's largest token id. Rank 0
    alone may show the scan's progress bar, as one bar per rank would interleave, and alone writes
    the cache, as the ranks share out_dir."""
    from gpt2_ddp import shards
    make_shards(tmp_path, train_shards=3)
    paths = sorted(tmp_path.glob("*.bin"))
    shown, bar = [], shards.tqdm

    def recorded_bar(*args, **kwargs):
        shown.append(not kwargs["disable"])
        return bar(*args, **kwargs)

    monkeypatch.setattr(shards, "tqdm", recorded_bar)
    sent = {}
    for rank in (1, 0):
        max_token_ids(paths, tmp_path / f"cache{rank}.json", rank, 2,
                      lambda values, rank=rank: sent.setdefault(rank, values))
    assert [[i for i, v in enumerate(sent[r]) if v >= 0] for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [max(a, b) for a, b in zip(sent[0], sent[1])] == [int(read_tokens(p).max()) for p in paths]
    assert shown == [False, True]  # ranks 1, then 0
    assert [(tmp_path / f"cache{rank}.json").exists() for rank in (0, 1)] == [True, False]
