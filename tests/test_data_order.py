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

import bench_data_order

from conftest import ROOT, TINY, compare, markov_tokens, read_log, run_training, train_here
from gpt2_ddp import runs
from gpt2_ddp.configurator import UserError
from gpt2_ddp.shards import write_shard
from gpt2_ddp.tokenizer import EOT_TOKEN
from test_faults import children, rewrite_checkpoint, wait_for_step
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


def packable(stream, bounds):
    """Where a row of T + 1 tokens may start in `stream`, cut into shards at `bounds`: at a document's
    start (or a shard's), or T + 1, 2 (T + 1), ... tokens into it, the row fitting in its shard."""
    out = []
    for first, end in zip(bounds[:-1], bounds[1:]):  # a shard's first token counts as a document start
        docs = [int(first)] + [int(d) for d in np.flatnonzero(stream == EOT_TOKEN) if first < d < end]
        out += [d + k * (T + 1) for d, after in zip(docs, docs[1:] + [end])
                for k in range((after - d - 1) // (T + 1) + 1) if d + k * (T + 1) + T + 1 <= end]
    return out


def test_each_epoch_is_a_new_order_of_the_same_rows_packed_from_the_documents(tmp_path):
    """In each shard the first row starts at its first token, each next one at the last
    packable start (above) at most T + 1 tokens after the row before's (documents of 1 to 40 tokens,
    T = 16: short ones packed in order, long ones cut into pieces)."""
    stream = write_documents(tmp_path)
    loader = shuffled(tmp_path)
    n = len(loader.rows)  # with B=1 an epoch is n micro-batches
    starts = sorted(loader.rows.starts(0, n))
    for first, end in zip(loader.starts[:-1], loader.starts[1:]):  # rows do not cross shards
        allowed = packable(stream, [first, end])
        mine = [s for s in starts if first <= s < end]
        assert mine[0] == allowed[0] and mine[-1] == max(a for a in allowed if a <= mine[-1] + T + 1)
        for a, b in zip(mine, mine[1:]):
            assert b == max(c for c in allowed if c <= a + T + 1)
    for g in range(2 * n):  # every row: T + 1 tokens of the stream from its start
        x, y = loader.next_batch()
        s = loader.rows.starts(g, 1)[0]
        assert x[0].tolist() == stream[s:s + T].tolist() and y[0].tolist() == stream[s + 1:s + T + 1].tolist()
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


def test_a_runs_train_order_is_drawn_from_its_seed_and_its_val_split_read_both_ways(tmp_path, capsys):
    """make_loaders as a run calls it: the train rows of --seed's order; the val split in order
    (val_loss) and, as training reads, in rows (val_loss_rows); val_batches lowered, with a line,
    only when above what either holds; the epochs line counts rows and the share they read."""
    write_documents(tmp_path)
    args = [*RUN, f"--data_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}", "--seed=7"]
    config, train, val = train_gpt2.make_loaders(load_config([*args, "--val_batches=100000"]), 0, 1,
                                                 torch.device("cpu"))
    n, rows = len(train.rows), train.rows
    assert train.rows.starts(0, n).tolist() == shuffled(tmp_path, seed=7).rows.starts(0, n).tolist()
    assert list(val) == ["val_loss", "val_loss_rows"] and val["val_loss"].rows is None
    assert val["val_loss_rows"].rows.rows.tolist() == DataLoader(
        tmp_path, "val", 1, T, 0, 1, torch.device("cpu"), order="shuffled").rows.rows.tolist()
    fits = min(val["val_loss"].batches_per_epoch, len(val["val_loss_rows"].rows) // 2)
    assert config.val_batches == fits
    tokens = int(train.starts[-1])
    assert capsys.readouterr().out.splitlines() == [
        f"val_batches=100000 is more than the val split holds: evaluating on all {fits} micro-batches",
        f"max_steps=16 x 128 tokens a step = 2,048 tokens: {2048 / (n * T):.1f} epochs of {n:,} rows, "
        f"each epoch reading {rows.reads / tokens:.1%} of the {tokens:,} train tokens "
        f"({rows.twice / tokens:.1%} twice)"]
    fits = load_config([*args, f"--val_batches={fits}"])
    assert train_gpt2.make_loaders(fits, 0, 1, torch.device("cpu"))[0] == fits
    assert "is more than the val split holds" not in capsys.readouterr().out
    val_docs = np.full(1000, 7)
    val_docs[::T + 1] = EOT_TOKEN  # 58 rows that never overlap: fewer micro-batches than in order
    write_shard(tmp_path / "docs_val_000000.bin", val_docs)
    assert train_gpt2.make_loaders(load_config([*args, "--val_batches=100"]), 0, 1,
                                   torch.device("cpu"))[0].val_batches == 58 // 2 < 999 // (2 * T)
    config, train, val = train_gpt2.make_loaders(load_config([*args, "--data_order=sequential"]), 0, 1,
                                                 torch.device("cpu"))
    assert list(val) == ["val_loss"] and train.rows is None
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        f": {2048 / tokens:.1f} epochs of the {tokens:,} train tokens")
    for i in (1, 2):  # a train split of fewer micro-batches than the val split's: those bound nothing
        write_shard(tmp_path / f"docs_train_{i:06d}.bin", val_docs[:100])
    assert train_gpt2.make_loaders(load_config([*args, "--val_batches=100"]), 0, 1,
                                   torch.device("cpu"))[0].val_batches == 58 // 2


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
        rewrite_checkpoint(ckpt, lambda state: state["loader"].pop("packing"))  # an older version's rows
        with pytest.raises(UserError) as refused:
            train_here([*args, f"--max_steps={STEPS + 1}", "--data_order=shuffled"])
        assert str(refused.value) == (
            f"checkpoint {ckpt} read rows packed the way of an older version of this repository, not "
            f"packing 2's: start a new run from its weights with --out_dir=NEW_DIR --init_from={tmp_path}")


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
    assert set(shuffled(tmp_path).rows.starts(0, 50)) <= set(packable(stream, shuffled(tmp_path).starts))
    assert rows(shuffled(tmp_path), 50) != rows(first, 50)
    # the same size, the documents moved: an index that matched by size alone would start rows elsewhere
    path = tmp_path / "docs_train_000001.bin"
    before, moved = path.stat(), np.roll(shards.read_tokens(path), 3)
    with open(path, "r+b") as f:
        f.seek(1024)
        f.write(moved.tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # past the clock's tick
    assert path.stat().st_size == before.st_size
    stream = np.concatenate([shards.read_tokens(p) for p in sorted(tmp_path.glob("docs_train_*.bin"))])
    loader = shuffled(tmp_path)
    assert set(loader.rows.starts(0, len(loader.rows))) <= set(packable(stream, loader.starts))
    (tmp_path / ".docs_train_000001.bin.docs.npy").write_bytes(b"not an index")  # np.load: ValueError
    np.testing.assert_array_equal(shuffled(tmp_path).rows.rows, loader.rows.rows)


def test_a_first_shuffled_run_scans_each_shard_once_for_its_rows_and_its_token_ids(tmp_path, monkeypatch):
    """make_loaders on shards with no manifest, index or token id cache reads each shard once: the
    scan that finds its document starts records its largest token id, which check_token_ids takes,
    also to refuse a token id beyond vocab_size. An index of another format is made again."""
    from gpt2_ddp import shards
    write_documents(tmp_path)
    reads = []
    monkeypatch.setattr(shards, "read_tokens", lambda path, _f=shards.read_tokens: reads.append(path.name)
                        or _f(path))
    args = [*RUN, f"--data_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}"]
    train_gpt2.make_loaders(load_config(args), 0, 1, torch.device("cpu"))
    assert sorted(reads) == sorted(p.name for p in tmp_path.glob("docs_*.bin"))
    reads.clear()
    shard = tmp_path / "docs_train_000001.bin"
    with pytest.raises(UserError, match=f"^shard {shard} holds token id {EOT_TOKEN}, beyond vocab_size=50000"):
        train_gpt2.make_loaders(load_config([*args, "--vocab_size=50000"]), 0, 1, torch.device("cpu"))
    assert reads == []
    st = shard.stat()  # the format before: [bytes, mtime_ns, starts...]
    np.save(tmp_path / f".{shard.name}.docs.npy", np.array([st.st_size, st.st_mtime_ns, 0]))
    train_gpt2.make_loaders(load_config(args), 0, 1, torch.device("cpu"))
    assert reads == [shard.name]


def test_docs_table_of_the_shares_an_epoch_reads_is_what_the_bench_computes(tmp_path):
    """Each line of docs/data.md's table: the rows, share read and share read twice that
    tests.bench_data_order gives for its corpus (made as the table says) and seq_len, at least 95%
    read in every one."""
    import prepare_data
    text = (ROOT / "docs" / "data.md").read_text()
    table = text[text.index("| corpus | seq_len | rows an epoch |"):].split("\n\n")[0].splitlines()[2:]
    corpora = {"tiny": None, "12": (300_000, 25_000), "one": (300_000, 300_000), "lognormal": (10**7, 1000)}
    for name, made in corpora.items():
        (tmp_path / name).mkdir()
        if made is None:
            prepare_data.main(["--output_dir", str(tmp_path / name), "--workers", "1"])
        else:
            bench_data_order.write_documents(tmp_path / name, *made, equal=name != "lognormal")
    assert len(table) == 12
    for line in table:
        corpus, seq_len, *figures = [cell.strip() for cell in line.strip("|").split("|")]
        loader = DataLoader(tmp_path / corpus.split()[0], "train", 8, int(seq_len.split()[0]), 0, 1,
                            torch.device("cpu"), order="shuffled")
        rows, read, twice = bench_data_order.shares(loader)
        assert figures == [f"{rows:,}", f"{read:.1%}", f"{twice:.1%}"] and read >= 0.95, line


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


def test_a_split_of_shards_shorter_than_a_row_names_the_sequential_order(tmp_path, monkeypatch):
    """Shards each shorter than a row (by one token, or T long): the shuffled order has nothing to
    read, says how long the longest shard is, and names the order that does; a shard with no
    <|endoftext|> at all is read from its first token. The scan of the shards has a progress bar
    (shown after a second)."""
    from gpt2_ddp import shards
    bars = []
    monkeypatch.setattr(shards, "tqdm", lambda *args, **kwargs: bars.append((args[1], kwargs["disable"])) or args[0])
    short = np.concatenate([np.arange(T - 1), [EOT_TOKEN]])
    write_shard(tmp_path / "docs_val_000000.bin", short)
    for rank, shard, longest in ((0, short, T), (1, np.full(T - 5, EOT_TOKEN), T - 5)):
        monkeypatch.setenv("RANK", str(rank))
        for name in ("docs_train_000001.bin", "docs_train_000002.bin"):
            write_shard(tmp_path / name, shard)
        with pytest.raises(UserError) as refused:
            shuffled(tmp_path)
        assert str(refused.value) == (
            f"the train split in {tmp_path} holds no row of seq_len+1 = {T + 1} tokens, which must fit in a "
            f"shard (the longest holds {longest} tokens): pass --data_order=sequential, or a lower seq_len")
    assert bars == [("finding document starts", False), ("finding document starts", True)]  # rank 0's alone
    write_shard(tmp_path / "docs_train_000001.bin", np.arange(3 * T + 3))  # no document start at all
    assert shuffled(tmp_path).rows.rows.tolist() == [0, T + 1, 2 * (T + 1)]


def make_loaders_of_train_shards(data_dir, sizes):
    """train_gpt2.make_loaders, as a run of 16 steps of one row calls it, over one val row and train
    shards of `sizes` tokens, each token 7 (no document start: rows begin at each shard's start)."""
    write_shard(data_dir / "docs_val_000000.bin", np.full(T + 1, 7))
    for i, n in enumerate(sizes):
        write_shard(data_dir / f"docs_train_{i + 1:06d}.bin", np.full(n, 7))
    args = [*RUN, f"--data_dir={data_dir}", f"--out_dir={data_dir / 'out'}", "--micro_batch_size=1",
            "--total_batch_size=16", "--eval_interval=0"]
    train_gpt2.make_loaders(load_config(args), 0, 1, torch.device("cpu"))


def test_a_split_whose_rows_leave_most_tokens_unread_is_warned_of_in_one_line(tmp_path, capsys):
    """A shard one row long beside three one token short of a row: an epoch reads 17 of 65 train
    tokens, and the run says so in one line that names the sequential order."""
    make_loaders_of_train_shards(tmp_path, [T + 1, T, T, T])
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "max_steps=16 x 16 tokens a step = 256 tokens: 16.0 epochs of 1 rows, each epoch reading 26.2% of "
        "the 65 train tokens (0.0% twice)",
        "warning: data_order=shuffled leaves most train tokens unread: its rows must each fit in a shard, "
        "and these shards are short for seq_len+1; pass --data_order=sequential"]


@pytest.mark.parametrize("sizes, warned", [([T + 1, T, T], True), ([T + 1, T + 1, T, T, 2], False)])
def test_the_unread_tokens_warning_starts_below_half_of_them(tmp_path, capsys, sizes, warned):
    """An epoch that reads 17 of 49 train tokens is warned of; one that reads exactly half is not."""
    make_loaders_of_train_shards(tmp_path, sizes)
    assert ("warning: data_order=shuffled leaves most" in capsys.readouterr().out) == warned
