"""data_order=shuffled: rows that start at a document, a new order each epoch drawn from (seed,
epoch), the same micro-batches at any world size, micro_batch_size or sharding mode, resumed bit
for bit."""

import os
import shutil
import signal
import subprocess

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY, compare, markov_tokens, read_log, run_training, train_here
from gpt2_ddp import runs
from gpt2_ddp.configurator import UserError
from gpt2_ddp.shards import write_shard
from gpt2_ddp.tokenizer import EOT_TOKEN
from test_faults import children, wait_for_step
import train_gpt2
from train_gpt2 import DataLoader, load_config

T = 16
STEPS = 16
# the documents' tokens stay below TINY's 512, <|endoftext|> needs GPT-2's vocabulary
RUN = [*TINY, "--vocab_size=50304", "--data_order=shuffled", "--total_batch_size=128",
       f"--max_steps={STEPS}", "--eval_interval=8", "--checkpoint_interval=4", "--dropout=0.1",
       "--exact_reduction=true"]


def write_documents(data_dir, n_docs=300, seed=0, train_shards=2):
    """Val and train shards of documents of 1 to 40 tokens, each after an <|endoftext|>; returns the
    train stream."""
    rng = np.random.default_rng(seed)
    stream = np.concatenate([np.concatenate([[EOT_TOKEN], markov_tokens(rng, rng.integers(1, 41), 512)])
                             for _ in range(n_docs)])
    os.makedirs(data_dir, exist_ok=True)
    write_shard(data_dir / "docs_val_000000.bin", stream[:1000])
    for i, part in enumerate(np.array_split(stream[1000:], train_shards)):
        write_shard(data_dir / f"docs_train_{i + 1:06d}.bin", part)
    return stream[1000:]


def shuffled(data_dir, B=1, rank=0, world_size=1, seed=0):
    return DataLoader(data_dir, "train", B, T, rank, world_size, torch.device("cpu"), order="shuffled",
                      seed=seed)


def rows(loader, n):
    """The first n micro-batches' x rows of `loader`, as tuples."""
    return [tuple(row) for _ in range(n) for row in loader.next_batch()[0].tolist()]


def test_a_micro_batch_across_an_epochs_end_holds_the_rows_of_both_epochs(tmp_path):
    """A micro-batch whose rows run past an epoch's end: its last rows of one epoch and first of the
    next, as B rows read one at a time give them."""
    write_documents(tmp_path)
    loader = shuffled(tmp_path, B=8)
    n = len(loader.rows)
    together = loader.rows.starts(n - 3, 8)
    alone = [loader.rows.starts(n - 3 + k, 1)[0] for k in range(8)]
    assert together.tolist() == alone


def test_each_epoch_is_a_new_order_of_the_same_rows_that_start_at_a_document(tmp_path):
    stream = write_documents(tmp_path)
    loader = shuffled(tmp_path)
    n = len(loader.rows)  # with B=1 an epoch is n micro-batches
    starts = sorted(loader.rows.starts(0, n))
    assert all(stream[s] == EOT_TOKEN for s in starts)
    for first, end in zip(loader.starts[:-1], loader.starts[1:]):  # rows do not cross shards
        fit = [d for d in np.flatnonzero(stream == EOT_TOKEN) if first <= d and d + T + 1 <= end]
        mine = [s for s in starts if first <= s < end]
        assert mine[0] == fit[0] and mine[-1] + T + 1 <= end
        for a, b in zip(mine, mine[1:]):  # the first document start that the row before leaves
            assert b == next(d for d in fit if d >= a + T)
    for g in range(2 * n):  # every row: T + 1 tokens of the stream from a document's start
        x, y = loader.next_batch()
        s = loader.rows.starts(g, 1)[0]
        assert x[0].tolist() == stream[s:s + T].tolist() and y[0].tolist() == stream[s + 1:s + T + 1].tolist()
        assert x[0, 0] == EOT_TOKEN
    loader.batch_index = 0
    first, second = rows(loader, n), rows(loader, n)
    assert first != second and sorted(first) == sorted(second)
    assert rows(shuffled(tmp_path), 2 * n) == first + second  # the same seed: the same order
    assert rows(shuffled(tmp_path, seed=1), n) != first


def test_world_size_and_micro_batch_size_do_not_change_what_a_step_reads(tmp_path):
    write_documents(tmp_path)
    one = rows(shuffled(tmp_path, B=2), 60)  # 60 micro-batches: more than an epoch
    ranks = [shuffled(tmp_path, B=2, rank=r, world_size=2) for r in (0, 1)]
    assert [row for _ in range(30) for loader in ranks for row in rows(loader, 1)] == one
    assert rows(shuffled(tmp_path, B=4), 30) == one
    resumed = shuffled(tmp_path, B=4)  # at another micro_batch_size, from a checkpoint's state
    before = shuffled(tmp_path, B=2)
    rows(before, 37)
    state = before.state_dict()
    assert (state["epoch"], state["row"]) == divmod(74, len(before.rows))
    resumed.load_state_dict({**state, "tokens": 76 * T})
    assert rows(resumed, 1) == one[76:80]


def test_a_runs_train_order_is_drawn_from_its_seed_and_its_val_split_read_in_order(tmp_path, capsys):
    """make_loaders as a run calls it: the train rows of --seed's order, the val split sequential,
    and val_batches lowered, with a line, only when above what the val split holds."""
    write_documents(tmp_path)
    args = [*RUN, f"--data_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}", "--seed=7"]
    config, train, val = train_gpt2.make_loaders(load_config([*args, "--val_batches=100000"]), 0, 1,
                                                 torch.device("cpu"))
    n = len(train.rows)
    assert train.rows.starts(0, n).tolist() == shuffled(tmp_path, seed=7).rows.starts(0, n).tolist()
    assert val.order == "sequential" and val.rows is None
    assert config.val_batches == val.batches_per_epoch
    assert "is more than the val split holds" in capsys.readouterr().out
    fits = load_config([*args, f"--val_batches={val.batches_per_epoch}"])
    assert train_gpt2.make_loaders(fits, 0, 1, torch.device("cpu"))[0] == fits
    assert "is more than the val split holds" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def doc_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("doc_data")
    write_documents(path, n_docs=600)
    return path


@pytest.fixture(scope="module")
def doc_runs(doc_data, tmp_path_factory):
    """The RUN config trained at world sizes 1 and 2."""
    out = tmp_path_factory.mktemp("doc_runs")
    return compare([*RUN, f"--data_dir={doc_data}"], [1, 2], out), out


def test_exact_mode_is_bitwise_the_same_run_at_world_sizes_1_and_2(doc_runs):
    by_world_size, _ = doc_runs
    assert by_world_size[2]["loss"] == by_world_size[1]["loss"]
    assert by_world_size[2]["val_loss"] == by_world_size[1]["val_loss"]
    assert by_world_size[2]["max_param_diff"] == 0.0


def test_a_sigkilled_run_resumed_at_another_world_size_and_mode_is_the_same_run(doc_data, doc_runs,
                                                                               tmp_path):
    args = [*RUN, f"--data_dir={doc_data}", f"--out_dir={tmp_path}"]
    proc = subprocess.Popen(runs.command(args, 2), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wait_for_step(tmp_path, 10, proc)
    for pid in children(proc.pid):
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.communicate()
    assert "resumed from" in run_training([*args, "--sharding=zero2"]).stdout
    steps, _ = read_log(tmp_path)
    assert [s["loss"] for s in steps] == doc_runs[0][1]["loss"]


@pytest.mark.parametrize("then, now", [("shuffled", "sequential"), ("sequential", "shuffled")])
def test_a_checkpoint_is_resumed_in_its_own_data_order(doc_data, doc_runs, tmp_path, then, now):
    args = [*RUN, f"--data_dir={doc_data}", f"--out_dir={tmp_path}", "--max_steps=1", "--eval_interval=0"]
    if then == "shuffled":  # the shuffled runs' last checkpoint
        shutil.copy(doc_runs[1] / "world_size_1" / f"ckpt_{STEPS:07d}.pt", tmp_path)
    else:
        run_training([*args, f"--data_order={then}"])
    ckpt = sorted(tmp_path.glob("ckpt_*.pt"))[-1]
    with pytest.raises(UserError) as refused:
        train_here([*args, f"--max_steps={STEPS + 1}", f"--data_order={now}"])
    again = (f"resume with --data_order={then} --seq_len=16, or start a new run from its weights with "
             f"--out_dir=NEW_DIR --init_from={tmp_path}")
    assert str(refused.value) == f"checkpoint {ckpt} read its data in data_order={then} at seq_len=16: {again}"
    if then == "shuffled":  # its rows start at other tokens at another seq_len
        with pytest.raises(UserError) as refused:
            train_here([*args, f"--max_steps={STEPS + 1}", "--data_order=shuffled", "--seq_len=8"])
        assert str(refused.value) == f"checkpoint {ckpt} read its data in data_order={then} at seq_len=16: {again}"



def test_the_document_index_is_made_once_beside_each_shard_and_again_for_a_new_shard(tmp_path,
                                                                                      monkeypatch):
    """The .docs.npy index beside a shard is read instead of the shard while the shard's size and
    mtime are those it records, and made again for new shards, a same-size rewrite in place, or a
    file in its place that is not an index."""
    from gpt2_ddp import shards
    write_documents(tmp_path)
    first = shuffled(tmp_path)
    caches = sorted(p.name for p in tmp_path.glob(".*.docs.npy"))
    assert caches == [".docs_train_000001.bin.docs.npy", ".docs_train_000002.bin.docs.npy"]
    with monkeypatch.context() as patch:  # a start with the index reads no shard
        patch.setattr(shards, "read_tokens", lambda path: pytest.fail(f"{path} scanned again"))
        assert rows(shuffled(tmp_path), 50) == rows(first, 50)
    write_documents(tmp_path, seed=1)  # new shards: their index is made again
    stream = np.concatenate([shards.read_tokens(p) for p in sorted(tmp_path.glob("docs_train_*.bin"))])
    assert all(stream[s] == EOT_TOKEN for s in shuffled(tmp_path).rows.starts(0, 50))
    assert rows(shuffled(tmp_path), 50) != rows(first, 50)
    # the same size, the documents moved: an index that matched by size alone would start rows mid-document
    path = tmp_path / "docs_train_000001.bin"
    before, moved = path.stat(), np.roll(shards.read_tokens(path), 3)
    with open(path, "r+b") as f:
        f.seek(1024)
        f.write(moved.tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # past the clock's tick
    assert path.stat().st_size == before.st_size
    stream = np.concatenate([shards.read_tokens(p) for p in sorted(tmp_path.glob("docs_train_*.bin"))])
    loader = shuffled(tmp_path)
    assert all(stream[s] == EOT_TOKEN for s in loader.rows.starts(0, len(loader.rows)))
    (tmp_path / ".docs_train_000001.bin.docs.npy").write_bytes(b"not an index")  # np.load: ValueError
    np.testing.assert_array_equal(shuffled(tmp_path).rows.rows, loader.rows.rows)


def test_a_row_that_ends_at_its_shards_end_is_read_and_one_past_it_is_not(tmp_path):
    """Documents of T + 1 tokens: every one is a row, the last of each shard ending at its last
    token; a document start T tokens before a shard's end starts none."""
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[EOT_TOKEN], markov_tokens(rng, T, 512)]) for _ in range(11)]
    parts = [np.concatenate(docs[:5]), np.concatenate(docs[5:9]),
             np.concatenate([*docs[9:], [EOT_TOKEN], markov_tokens(rng, T - 1, 512)])]
    write_shard(tmp_path / "docs_val_000000.bin", parts[0])
    for i, part in enumerate(parts):
        write_shard(tmp_path / f"docs_train_{i + 1:06d}.bin", part)
    stream = np.concatenate(parts)
    loader = shuffled(tmp_path)
    assert sorted(loader.rows.starts(0, len(loader.rows))) == list(range(0, 11 * (T + 1), T + 1))
    for g in range(11):
        s = loader.rows.starts(g, 1)[0]
        x, y = loader.next_batch()
        assert x[0].tolist() == stream[s:s + T].tolist() and y[0].tolist() == stream[s + 1:s + T + 1].tolist()


def test_a_split_with_no_row_at_a_document_start_names_the_sequential_order(tmp_path, monkeypatch):
    """A shard whose only document starts fewer than T + 1 tokens before its end, then shards each
    shorter than a row: the shuffled order has nothing to read, says how long the longest shard is,
    and names the order that does. Its scan of the shards has a progress bar (shown after a second)."""
    from gpt2_ddp import shards
    bars = []
    monkeypatch.setattr(shards, "tqdm", lambda *args, **kwargs: bars.append((args[1], kwargs["disable"])) or args[0])
    tail_doc = np.concatenate([np.arange(3 * T), [EOT_TOKEN], np.arange(T - 1)])
    write_shard(tmp_path / "docs_val_000000.bin", tail_doc)
    for rank, shard, longest in ((0, tail_doc, 4 * T), (1, np.full(T, EOT_TOKEN), T)):
        monkeypatch.setenv("RANK", str(rank))
        for name in ("docs_train_000001.bin", "docs_train_000002.bin"):
            write_shard(tmp_path / name, shard)
        with pytest.raises(UserError) as refused:
            shuffled(tmp_path)
        assert str(refused.value) == (
            f"the train split in {tmp_path} holds no row of seq_len+1 = {T + 1} tokens that starts at an "
            f"<|endoftext|> (a document start) and fits in its shard (the longest holds {longest} tokens): "
            f"pass --data_order=sequential")
    assert bars == [("finding document starts", False), ("finding document starts", True)]  # rank 0's alone
