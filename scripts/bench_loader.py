"""
Host memory and speed of train_gpt2.DataLoader as the shards grow: its memory should stay flat.

    python -m scripts.bench_loader                             # shards of 1e6, 1e7, 5e7 tokens
    python -m scripts.bench_loader --sizes 1e6 1e8 --batches 500 --tmp_dir /mnt/scratch

For each size a fresh process builds the CPU loader on a new shard of random tokens (in the page
cache) and reads --batches micro-batches of B x T spread over it. RSS columns are the peak RSS (VmHWM)
before the loader, after building it and after reading, and growth = after - before. A loader that
read the whole shard into RAM would grow by its size (x4 as int64).
"""

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
from gpt2_ddp import configurator
from gpt2_ddp.configurator import UserError


def peak_rss_mb():
    """This process's peak RSS in MiB: VmHWM where /proc has it, else ru_maxrss, which on Linux
    survives exec and so would report the shard-writing parent's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(data_dir, B, T, n_batches):
    """Runs in the fresh process: the loader's RSS and speed on data_dir, as a dict."""
    import torch

    import train_gpt2

    base = peak_rss_mb()
    loader = train_gpt2.DataLoader(data_dir, "train", B, T, rank=0, world_size=1,
                                   device=torch.device("cpu"))
    built = peak_rss_mb()
    starts = np.linspace(0, loader.batches_per_epoch - 1, n_batches).astype(int)
    t0 = time.perf_counter()
    for g in starts:  # jump to micro-batch g, as a resumed run would, then read it
        loader.load_state_dict({"tokens": int(g) * B * T})
        x, y = loader.next_batch()
        assert x.shape == (B, T) and y.shape == (B, T)
    seconds = time.perf_counter() - t0
    return {"base": base, "built": built, "after": peak_rss_mb(), "seconds": seconds}


def main(argv=None):
    parser = configurator.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 5e7],
                        help="train shard sizes in tokens (default: 1e6 1e7 5e7)")
    parser.add_argument("--batches", type=int, default=200, help="micro-batches read per size (default: 200)")
    parser.add_argument("-B", "--batch_size", type=int, default=8, help="B (default: 8)")
    parser.add_argument("-T", "--seq_len", type=int, default=1024, help="T (default: 1024)")
    parser.add_argument("--tmp_dir", help="where the shards are written (default: the system temp dir)")
    parser.add_argument("--measure", metavar="DATA_DIR", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    B, T = args.batch_size, args.seq_len

    if args.measure:
        print(json.dumps(measure(args.measure, B, T, args.batches)))
        return

    from gpt2_ddp.shards import write_shard

    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench_loader_", dir=args.tmp_dir))
    rows = []
    try:
        for size in map(int, args.sizes):
            data_dir = tmp / f"size_{size}"
            data_dir.mkdir()
            for name, n in (("rand_val_000000.bin", max(size // 10, 1)), ("rand_train_000001.bin", size)):
                write_shard(data_dir / name, rng.integers(0, 50257, n, dtype=np.uint16))
            cmd = [sys.executable, "-m", "scripts.bench_loader", "--measure", str(data_dir), "-B", str(B),
                   "-T", str(T), "--batches", str(args.batches)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise UserError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
            rows.append((size, json.loads(proc.stdout.splitlines()[-1])))
            shutil.rmtree(data_dir)
    finally:
        shutil.rmtree(tmp)

    print(f"B={B} T={T}, {args.batches} batches per size, peak RSS (VmHWM) in MiB")
    print(f"{'shard tokens':>13}{'shard MB':>10}{'RSS before':>12}{'RSS loader':>12}{'RSS after':>11}"
          f"{'growth':>8}{'batches/s':>11}{'tokens/s':>14}")
    for size, r in rows:  # MB columns are MiB
        rate = args.batches / r["seconds"]
        print(f"{size:>13,}{2 * size / 2**20:>10.1f}{r['base']:>12.1f}{r['built']:>12.1f}{r['after']:>11.1f}"
              f"{r['after'] - r['base']:>8.1f}{rate:>11,.0f}{rate * B * T:>14,.0f}")


if __name__ == "__main__":
    configurator.run(main, "bench_loader.py")
