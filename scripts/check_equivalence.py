"""
Checks the single-device promise on your machine: trains one config at several world sizes and
prints how far each run's per-step losses and final weights are from the one-process run. With
--python, it also trains under other interpreters (venvs holding other torch versions) and checks
that each trains the same model as this one at every world size.

    python -m scripts.check_equivalence configs/shakespeare_cpu.toml --max_steps=20
    python -m scripts.check_equivalence configs/shakespeare_cpu.toml --max_steps=20 --exact_reduction=true
    python -m scripts.check_equivalence configs/gpt2_124m.toml --world_sizes 1 8 --max_steps=50
    python -m scripts.check_equivalence configs/shakespeare_cpu.toml --world_sizes 2 --python venv/bin/python

Arguments other than the options below go to train_gpt2.py. World size 1 runs as `python train_gpt2.py`,
the others under torchrun, all with --resume=never --overwrite=true; steps on stderr, tables on stdout.
With --python it exits 1 when a loss or gradient norm differs by more than --tolerance, relative.
"""

import subprocess
import sys
from pathlib import Path
if not __spec__: raise SystemExit("run it as python -m scripts.check_equivalence from the repository root")

import torch

from gpt2_ddp import checkpoints, configurator, runs
from gpt2_ddp.configurator import UserError


def train(world_size, train_args, out_dir, python=sys.executable, label=None):
    """(train, eval and HellaSwag records, final model state dict) of train_gpt2.py at `world_size` in
    out_dir under `python`, progress after `label`. Raises UserError with the output if it fails."""
    runs.train([*train_args, f"--out_dir={out_dir}", "--resume=never", "--overwrite=true"],
               world_size, python=python, progress=label or f"world size {world_size}")
    model = torch.load(checkpoints.listed(out_dir)[-1], map_location="cpu", weights_only=True)["model"]
    return (*runs.split_records(runs.read_log(out_dir)), model)


def compare(train_args, world_sizes, out_root, python=sys.executable, label=""):
    """{world_size: {"step", "loss", "grad_norm", "val_loss", "hellaswag", "model", "max_param_diff"}}
    of a run at each: per-step lists, (acc_norm, acc, examples) per HellaSwag eval, the final state
    dict, and its largest absolute weight difference to the first world size's."""
    trained = {n: train(n, train_args, Path(out_root) / f"world_size_{n}", python,
                        f"{label}world size {n}") for n in world_sizes}
    ref_model = trained[world_sizes[0]][-1]
    return {n: {"step": [r["step"] for r in steps], "loss": [r["loss"] for r in steps],
                "grad_norm": [r["grad_norm"] for r in steps], "val_loss": [r["val_loss"] for r in evals],
                "hellaswag": [(r["hellaswag_acc_norm"], r["hellaswag_acc"], r["hellaswag_examples"])
                              for r in hellaswag],
                "model": model, "max_param_diff": max_diff(model, ref_model)}
            for n, (steps, evals, hellaswag, model) in trained.items()}


def max_diff(model, reference):
    return max((model[k].float() - reference[k].float()).abs().max().item() for k in reference)


def worst_diff(values, reference):
    """The largest absolute difference of two lists of numbers, element by element; 0.0 for none."""
    return max((abs(a - b) for a, b in zip(values, reference)), default=0.0)


def print_table(results):
    sizes = list(results)
    ref = results[sizes[0]]
    print(f"{'step':>5} | {f'loss (world size {sizes[0]})':>22} | "
          + " | ".join(f"{f'|diff| world size {n}':>22}" for n in sizes[1:]))
    for i, (step, loss) in enumerate(zip(ref["step"], ref["loss"])):
        diffs = [abs(results[n]["loss"][i] - loss) for n in sizes[1:]]
        print(f"{step:5d} | {loss:22.9f} | " + " | ".join(f"{d:22.3e}" for d in diffs))
    for name in ("loss", "val_loss"):
        print(f"max |diff| of {name:8s}: " + ", ".join(
            f"world size {n}: {worst_diff(results[n][name], ref[name]):.3e}" for n in sizes[1:]))
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


def torch_version(python):
    """The torch version of `python`. Raises UserError if it cannot be run or cannot import torch."""
    try:
        proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                              capture_output=True, text=True)
    except OSError as e:
        raise UserError(f"cannot run --python {python}: {e.strerror}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{python} cannot import torch ({last}): install torch and requirements.txt into it")
    return proc.stdout.strip()


def compare_pythons(pythons, results, train_args, world_sizes, out_root):
    """Trains under `pythons`, printing differences to `results`; returns the worst relative one."""
    worst = 0.0
    for python in pythons:
        version = torch_version(python)
        other = compare(train_args, world_sizes, Path(out_root) / f"torch-{version}", python,
                        f"torch {version}, ")
        for n in world_sizes:
            diffs = [worst_diff(other[n][key], results[n][key]) for key in ("loss", "grad_norm", "val_loss")]
            diffs.append(max_diff(other[n]["model"], results[n]["model"]))
            # relative: a loss spike's gradient norm is large, and so is its rounding
            worst = max(worst, *(abs(a - b) / max(abs(b), 1e-12) for key in ("loss", "grad_norm")
                                 for a, b in zip(other[n][key], results[n][key])))
            print(f"torch {version}, world size {n}: max |diff| of loss {diffs[0]:.2e}, grad norm "
                  f"{diffs[1]:.2e}, val loss {diffs[2]:.2e}, weights {diffs[3]:.2e}"
                  + (" (bitwise)" if not any(diffs) else ""), flush=True)
    return worst


def main(argv):
    parser = configurator.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [CONFIG.toml] [--key=value ...] [--world_sizes N ...] [--python PYTHON] "
              "[--out_dir DIR]")
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 2, 4],
                        help="processes of each run, compared with the first")
    parser.add_argument("--python", action="append", default=[],
                        help="another interpreter (a venv's bin/python) whose torch to check")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="with --python: the largest relative loss or gradient norm difference allowed")
    parser.add_argument("--out_dir", default="out/check_equivalence", help="each run's directory goes here")
    args, train_args = parser.parse_known_args(argv)
    if min(args.world_sizes) < 1:
        parser.error("--world_sizes must be >= 1")
    if len(set(args.world_sizes)) < 2 and not args.python:
        raise UserError(f"--world_sizes {' '.join(map(str, args.world_sizes))} compares nothing: pass "
                        f"two or more different ones (--world_sizes 1 2) or another --python")
    for python in args.python:  # before any run: a bad interpreter is one line, not minutes later
        torch_version(python)
    results = compare(train_args, args.world_sizes, args.out_dir)
    if len(results) > 1:  # one world size is compared across interpreters alone
        print_table(results)
    if args.python:
        worst = compare_pythons(args.python, results, train_args, args.world_sizes, args.out_dir)
        print(f"largest relative loss or grad norm difference to torch {torch.__version__}: {worst:.2e}, "
              f"{'within' if worst <= args.tolerance else 'OVER'} the tolerance {args.tolerance:.0e}")
        return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    configurator.run(main, "check_equivalence.py")
