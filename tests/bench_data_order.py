"""
The shuffled data order beside the sequential one on a data dir (docs/perf.md, docs/data.md): the
one-time index of document starts, a loader's start-up, the memory its rows hold, the rows of an
epoch and the shares of the train tokens it reads and reads twice, and the time per micro-batch.
--tokens first writes that many tokens of synthetic documents there (lognormal lengths of mean
--mean_document, or all of that length with --equal_documents, each after an <|endoftext|>), once.
--parts prints instead where a micro-batch's time goes in either order (parts()).

    python -m tests.bench_data_order --data_dir /tmp/synthetic --tokens 1e9
    python -m tests.bench_data_order --data_dir /tmp/books --tokens 3e5 --mean_document 25000 --equal_documents
    python -m tests.bench_data_order --data_dir data/tinyshakespeare --micro_batch_size 8 --seq_len 64
    python -m tests.bench_data_order --data_dir /tmp/synthetic --parts
"""

import os
import time
from pathlib import Path

import numpy as np
import torch

from gpt2_ddp.configurator import ArgumentParser, run
from gpt2_ddp.device import keep_freed_cpu_memory
from gpt2_ddp.shards import HEADER_INTS, write_shard
from gpt2_ddp.tokenizer import EOT_TOKEN
from train_gpt2 import DataLoader

SHARD_TOKENS = 100_000_000  # FineWeb-Edu's shards, as prepare_data.py writes them


def write_documents(data_dir, tokens, mean_document, equal=False):
    """Writes a val shard of a tenth of `tokens` (at most 1M) and train shards of SHARD_TOKENS (or
    fewer, to `tokens`), where missing."""
    rng = np.random.default_rng(0)
    sizes = [min(SHARD_TOKENS, tokens - start) for start in range(0, tokens, SHARD_TOKENS)]
    for i, n in enumerate([min(1_000_000, tokens // 10)] + sizes):
        path = Path(data_dir) / f"synthetic_{'val' if i == 0 else 'train'}_{i:06d}.bin"
        if not path.exists():
            shard = rng.integers(0, EOT_TOKEN, n, dtype=np.uint16)
            count = n // mean_document + 1 if equal else 4 * n // mean_document + 16
            lengths = np.full(count, mean_document) if equal else rng.lognormal(
                np.log(mean_document) - 0.5, 1.0, count)
            starts = np.cumsum(np.maximum(lengths, 1).astype(np.int64))
            shard[np.concatenate([[0], starts[starts < n]])] = EOT_TOKEN
            write_shard(path, shard)


def shares(loader):
    """(rows an epoch, the share of the train tokens they hold, the share two of them hold) of a
    shuffled DataLoader."""
    tokens = int(loader.starts[-1])
    return len(loader.rows), loader.rows.reads / tokens, loader.rows.twice / tokens


def seconds(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def parts(data_dir, B, T, micro_batches):
    """Prints the microseconds of a micro-batch and of its parts in either order, timed as training
    reads (each micro-batch dropped before the next; glibc keeps freed memory, as in train_gpt2.py),
    the fastest of 5 passes over the first `micro_batches`: next_batch, its read (the shards' checks,
    the preadv calls and the loop around them), the preadv calls alone (one a row, into one buffer,
    on files opened before) and the os.stat of the shards a micro-batch reads."""
    keep_freed_cpu_memory()
    figures = {}
    for order in ("sequential", "shuffled"):
        loader = DataLoader(data_dir, "train", B, T, 0, 1, torch.device("cpu"), order=order)
        if order == "shuffled":
            starts, n = [loader.rows.starts(g * B, B).tolist() for g in range(micro_batches)], T + 1
        else:
            starts, n = [[g * B * T] for g in range(micro_batches)], B * T + 1
        shards = [(np.searchsorted(loader.starts, rows, side="right") - 1).tolist() for rows in starts]
        fds, buffer = [os.open(p, os.O_RDONLY) for p in loader.paths], np.zeros(B * (T + 1), dtype="<u2")
        reads = [(fds[i], buffer[r * n:(r + 1) * n], HEADER_INTS * 4 + 2 * (s - int(loader.starts[i])))
                 for rows, ids in zip(starts, shards) for r, (s, i) in enumerate(zip(rows, ids))]
        paths = [loader.paths[i] for ids in shards for i in set(ids)]

        def batches():
            loader.batch_index = 0
            for _ in range(micro_batches):
                loader.next_batch()

        def fastest(fn):
            return min(seconds(fn)[1] for _ in range(5)) * 1e6 / micro_batches

        figures[order] = [fastest(batches), fastest(lambda: [loader.read(rows, n) for rows in starts]),
                          fastest(lambda: [os.preadv(fd, [out], offset) for fd, out, offset in reads]),
                          fastest(lambda: [os.stat(p) for p in paths])]
        for fd in fds:
            os.close(fd)
    print(f"| micro-batch {B} x {T}, us | sequential | shuffled |\n|---|---|---|")
    for part, sequential, shuffled in zip(["next_batch", "read", "preadv alone", "os.stat of its shards"],
                                          figures["sequential"], figures["shuffled"]):
        print(f"| {part} | {sequential:.1f} | {shuffled:.1f} |")


def main(argv):
    parser = ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--data_dir", required=True, type=Path)
    parser.add_argument("--tokens", type=float, default=0, help="synthetic train tokens to write first")
    parser.add_argument("--mean_document", type=int, default=1000, help="tokens, FineWeb-Edu's mean")
    parser.add_argument("--equal_documents", action="store_true", help="each --mean_document tokens long")
    parser.add_argument("--micro_batch_size", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--micro_batches", type=int, default=500, help="timed per order")
    parser.add_argument("--parts", action="store_true", help="time a micro-batch's parts, as training reads")
    args = parser.parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    if args.tokens:
        write_documents(args.data_dir, int(args.tokens), args.mean_document, args.equal_documents)
    cpu, B, T = torch.device("cpu"), args.micro_batch_size, args.seq_len
    if args.parts:
        return parts(args.data_dir, B, T, max(args.micro_batches, 1))
    for cache in args.data_dir.glob(".*.docs.npy"):
        cache.unlink()  # the one-time index is timed from scratch
    index_s = seconds(lambda: DataLoader(args.data_dir, "train", B, T, 0, 1, cpu, order="shuffled"))[1]
    print("| order | start-up (s) | index, once (s) | rows' memory (MB) | rows an epoch | share read | "
          "share read twice | ms/micro-batch |")
    print("|---|---|---|---|---|---|---|---|")
    for order in ("sequential", "shuffled"):
        loader, start_s = seconds(lambda: DataLoader(args.data_dir, "train", B, T, 0, 1, cpu, order=order))
        rows, read, twice = shares(loader) if order == "shuffled" else (loader.batches_per_epoch * B, 1.0, 0.0)
        loader.next_batch()  # draws the first epoch's permutation
        memory = 2 * loader.rows.rows.nbytes / 1e6 if order == "shuffled" else 0.0  # rows, permutation
        batch_s = seconds(lambda: [loader.next_batch() for _ in range(args.micro_batches)])[1]
        once = f"{index_s:.2f}" if order == "shuffled" else "-"
        print(f"| {order} | {start_s:.2f} | {once} | {memory:.1f} | {rows:,} | {read:.1%} of "
              f"{int(loader.starts[-1]):,} | {twice:.1%} | {1e3 * batch_s / max(args.micro_batches, 1):.3f} |")


if __name__ == "__main__":
    run(main, "bench_data_order.py")
