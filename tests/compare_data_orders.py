"""
The table of docs/data.md that compares data orders: for each run directory, the val loss at its
last step, the best one, the last checkpoint's loss on the val split's rows (packed as a shuffled run
reads them; every whole micro-batch of them, the same for every run), and how much the train-loss curve repeats
with the data: the correlation of the train loss, less its 21-step moving mean, with itself one
epoch (of that run's order) earlier.

    python -m tests.compare_data_orders out/order_*
"""

import contextlib
from pathlib import Path

import numpy as np
import torch

from gpt2_ddp.configurator import ArgumentParser, run
from gpt2_ddp.runs import read_log, split_records
import train_gpt2
from train_gpt2 import DataLoader


def epoch_steps(config):
    """Optimizer steps an epoch of the train split takes in the run of `config` (a checkpoint's)."""
    B, T = config["micro_batch_size"], config["seq_len"]
    loader = DataLoader(config["data_dir"], "train", B, T, 0, 1, torch.device("cpu"), config["dataset"],
                        config["data_order"], config["seed"])
    micro_batches = loader.batches_per_epoch if loader.rows is None else len(loader.rows) / B
    return micro_batches * B * T / config["total_batch_size"]


def val_rows_loss(ckpt):
    """The loss of checkpoint `ckpt`'s model on the val split's rows (seed 0's order, every whole
    micro-batch), as train_gpt2 evaluates them."""
    config = train_gpt2.Config(**ckpt["config"])
    model = train_gpt2.GPT(config)
    model.load_state_dict(ckpt["model"])
    val = DataLoader(config.data_dir, "val", config.micro_batch_size, config.seq_len, 0, 1,
                     torch.device("cpu"), config.dataset, "shuffled")
    return train_gpt2.evaluate(model, val, len(val.rows) // val.B, contextlib.nullcontext(), torch.float32)


def repeat_correlation(losses, lag, window=21):
    detrended = losses - np.convolve(losses, np.ones(window) / window, mode="same")
    inner = detrended[window:-window]  # the moving mean is cut short at the ends
    return np.corrcoef(inner[lag:], inner[:-lag])[0, 1]


def main(argv):
    parser = ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="out_dirs of finished runs")
    args = parser.parse_args(argv)
    print("| data_order | seed | val loss, last step | best val loss (step) | val rows loss, last step | "
          "repeat correlation |")
    print("|---|---|---|---|---|---|")
    for out_dir in args.runs:
        ckpt = torch.load(sorted(out_dir.glob("ckpt_*.pt"))[-1], weights_only=True)
        config = ckpt["config"]
        steps, evals, _ = split_records(read_log(out_dir))
        best = min(evals[1:], key=lambda r: r["val_loss"])
        losses = np.array([r["loss"] for r in steps])
        lag = round(epoch_steps(config))
        print(f"| {config['data_order']} | {config['seed']} | {evals[-1]['val_loss']:.4f} | "
              f"{best['val_loss']:.4f} ({best['step']}) | {val_rows_loss(ckpt):.4f} | "
              f"{repeat_correlation(losses, lag):.2f} |")


if __name__ == "__main__":
    run(main, "compare_data_orders.py")
