"""Shards that cannot be trained on are refused in one line before step 0, naming the file and what
is wrong with it: gpt2_ddp/shards.py's checks, which train_gpt2.py runs as it builds its loaders."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import train_gpt2
from conftest import ROOT, TINY, make_shards
from gpt2_ddp.configurator import UserError
from gpt2_ddp.shards import write_shard


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
