r"""
Checks that another torch trains the same model as this one: runs one config at world size 2 in
each sharding mode, default and exact_reduction, under this interpreter and under each other
Python given (a venv holding another torch), and prints how far each run's per-step losses,
gradient norms, val losses and final weights are from this interpreter's.

    python -m venv venv-2.8 && venv-2.8/bin/pip install torch==2.8.0 -r requirements.txt
    python prepare_data.py
    python -m scripts.check_torch_versions --python venv-2.8/bin/python \
        configs/shakespeare_cpu.toml --max_steps=20

Arguments other than --python, --world_size, --tolerance and --out_dir go to train_gpt2.py. Exits
1 when a loss or gradient norm differs by more than --tolerance (default 1e-4): a torch that trains
another model.
"""

import subprocess
import sys
from pathlib import Path

from gpt2_ddp import configurator
from gpt2_ddp.configurator import UserError
from scripts.check_equivalence import train

VARIANTS = {  # name: train_gpt2.py arguments
    mode + (" exact" if exact else ""): [f"--sharding={mode}", f"--exact_reduction={exact}".lower()]
    for exact in (False, True) for mode in ("ddp", "zero2", "fsdp")
}


def torch_version(python):
    """The torch version of the interpreter `python`. Raises UserError if it cannot be run or
    cannot import torch."""
    try:
        proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                              capture_output=True, text=True)
    except OSError as e:
        raise UserError(f"cannot run --python {python}: {e.strerror}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{python} cannot import torch ({last}): install torch and "
                        f"requirements.txt into it")
    return proc.stdout.strip()


def compare_versions(pythons, train_args, world_size, out_root):
    """Trains every variant under each interpreter; returns (versions, {variant: [(max |loss
    diff|, max |grad norm diff|, max |val loss diff|, max |weight diff|) to pythons[0]'s run, for
    each other python]})."""
    versions = [torch_version(p) for p in pythons]
    results = {}
    for variant, args in VARIANTS.items():
        runs = [train(world_size, [*train_args, *args],
                      Path(out_root) / f"torch-{v}" / variant.replace(" ", "_"), python=p,
                      label=f"torch {v}, {variant}")
                for p, v in zip(pythons, versions)]
        (ref_steps, ref_evals, _, ref_model) = runs[0]
        results[variant] = [
            (max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, ref_steps)),
             max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(steps, ref_steps)),
             max((abs(a["val_loss"] - b["val_loss"]) for a, b in zip(evals, ref_evals)),
                 default=0.0),
             max((model[k].float() - ref_model[k].float()).abs().max().item() for k in ref_model))
            for steps, evals, _, model in runs[1:]]
        print(f"{variant:12s} " + " | ".join(
            f"torch {v}: loss {d[0]:.2e}, grad norm {d[1]:.2e}, val loss {d[2]:.2e}, weights "
            f"{d[3]:.2e}" + (" (bitwise)" if not any(d) else "")
            for v, d in zip(versions[1:], results[variant])), flush=True)
    return versions, results


def main(argv):
    parser = configurator.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s --python PYTHON [--python ...] [CONFIG.toml] [--key=value ...]")
    parser.add_argument("--python", action="append", required=True,
                        help="another interpreter (a venv's bin/python) whose torch to check")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--out_dir", default="out/check_torch_versions")
    args, train_args = parser.parse_known_args(argv)
    if args.world_size < 1:
        parser.error("--world_size must be >= 1")
    print(f"max |diff| to torch {torch_version(sys.executable)} ({sys.executable}), world size "
          f"{args.world_size}:", flush=True)
    versions, results = compare_versions([sys.executable, *args.python], train_args,
                                         args.world_size, args.out_dir)
    worst = max(max(d[:2]) for diffs in results.values() for d in diffs)
    verdict = "within" if worst <= args.tolerance else "OVER"
    print(f"largest loss or grad norm difference {worst:.2e}: {verdict} the tolerance "
          f"{args.tolerance:.0e}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    configurator.run(main, "check_torch_versions.py")
