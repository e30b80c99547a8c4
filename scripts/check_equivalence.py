"""
Checks the single-device promise on your machine: trains one config at several world sizes and
prints how far each run's per-step losses and final weights are from the one-process run.

    python -m scripts.check_equivalence configs/shakespeare_cpu.toml --max_steps=20
    python -m scripts.check_equivalence configs/shakespeare_cpu.toml --max_steps=20 --exact_reduction=true
    python -m scripts.check_equivalence configs/gpt2_124m.toml --world_sizes 1 8 --max_steps=50

Arguments other than --world_sizes and --out_dir go to train_gpt2.py. The config's
total_batch_size must be divisible by micro_batch_size * seq_len * world_size for each world size.
World size 1 runs as `python train_gpt2.py`, the others as `torchrun --standalone
--nproc_per_node=N train_gpt2.py`, all with --resume=never --overwrite=true. Each run's steps show on
stderr as it trains; the table goes to stdout.
"""

import sys
from pathlib import Path

import torch

from gpt2_ddp import configurator, runs


def train(world_size, train_args, out_dir, python=sys.executable, label=None):
    """Runs train_gpt2.py at `world_size` into out_dir with the `python` interpreter (and its
    torch), showing its progress on stderr after `label` (default: "world size N"; runs.train);
    returns (train records, eval records, HellaSwag records, final model state dict).
    Raises UserError with the run's output if it fails."""
    runs.train([*train_args, f"--out_dir={out_dir}", "--resume=never", "--overwrite=true"],
               world_size, python=python, progress=label or f"world size {world_size}")
    checkpoint = sorted(Path(out_dir).glob("ckpt_*.pt"))[-1]
    model = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    return (*runs.split_records(runs.read_log(out_dir)), model)


def compare(train_args, world_sizes, out_root):
    """Trains at each world size; returns {world_size: {"step", "loss", "grad_norm", "val_loss",
    "hellaswag", "max_param_diff"}}: the steps (from 1) with their losses and gradient norms
    (before clipping) as lists, the HellaSwag results as (acc_norm, acc, examples) per evaluation
    (none unless hellaswag_interval is set), and the largest absolute weight difference to world
    size 1."""
    trained = {n: train(n, train_args, Path(out_root) / f"world_size_{n}") for n in world_sizes}
    ref_model = trained[world_sizes[0]][-1]
    results = {}
    for n, (steps, evals, hellaswag, model) in trained.items():
        results[n] = {
            "step": [r["step"] for r in steps],
            "loss": [r["loss"] for r in steps],
            "grad_norm": [r["grad_norm"] for r in steps],
            "val_loss": [r["val_loss"] for r in evals],
            "hellaswag": [(r["hellaswag_acc_norm"], r["hellaswag_acc"], r["hellaswag_examples"])
                          for r in hellaswag],
            "max_param_diff": max((model[k].float() - ref_model[k].float()).abs().max().item()
                                  for k in ref_model),
        }
    return results


def print_table(results):
    sizes = list(results)
    ref = results[sizes[0]]
    print(f"{'step':>5} | {f'loss (world size {sizes[0]})':>22} | "
          + " | ".join(f"{f'|diff| world size {n}':>22}" for n in sizes[1:]))
    for i, (step, loss) in enumerate(zip(ref["step"], ref["loss"])):
        diffs = [abs(results[n]["loss"][i] - loss) for n in sizes[1:]]
        print(f"{step:5d} | {loss:22.9f} | " + " | ".join(f"{d:22.3e}" for d in diffs))
    for name in ("loss", "val_loss"):
        worst = [max((abs(a - b) for a, b in zip(results[n][name], ref[name])), default=0.0)
                 for n in sizes[1:]]
        print(f"max |diff| of {name:8s}: " + ", ".join(
            f"world size {n}: {w:.3e}" for n, w in zip(sizes[1:], worst)))
    print("max |diff| of weights : " + ", ".join(
        f"world size {n}: {results[n]['max_param_diff']:.3e}" for n in sizes[1:]))
    if ref["hellaswag"]:
        print("HellaSwag (acc_norm, acc, examples) the same at every world size: "
              + str(all(results[n]["hellaswag"] == ref["hellaswag"] for n in sizes[1:])))
    bitwise = all(results[n][name] == ref[name] for n in sizes[1:] for name in ("loss", "val_loss"))
    if bitwise and all(results[n]["max_param_diff"] == 0 for n in sizes[1:]):
        print("bitwise identical at every world size")
    else:
        print("the differences are float rounding: each world size sums the micro-batches' gradients "
              "in another order, and training amplifies the last-bit differences over steps; "
              "--exact_reduction=true sums in float64 and makes the runs bitwise identical")


def main(argv):
    parser = configurator.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [CONFIG.toml] [--key=value ...] [--world_sizes N ...] [--out_dir DIR]")
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out_dir", default="out/check_equivalence")
    args, train_args = parser.parse_known_args(argv)
    if min(args.world_sizes) < 1:
        parser.error("--world_sizes must be >= 1")
    results = compare(train_args, args.world_sizes, args.out_dir)
    print_table(results)


if __name__ == "__main__":
    configurator.run(main, "check_equivalence.py")
