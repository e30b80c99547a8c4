"""
Launching train_gpt2.py and reading the log.jsonl it writes, for the tests and for the scripts
that train (scripts/bench.py, scripts/check_equivalence.py) or read logs (scripts/plot.py).
"""

import json
import subprocess
import sys
from pathlib import Path

from configurator import UserError

ROOT = Path(__file__).resolve().parent


def command(args, nproc=1, python=sys.executable, torchrun_args=()):
    """The argv that runs train_gpt2.py with `args` as a user would, under the interpreter
    `python` (and its torch): `python train_gpt2.py` for one process, torchrun (`python -m
    torch.distributed.run --standalone --nproc_per_node=N`, then `torchrun_args`) for more."""
    script = str(ROOT / "train_gpt2.py")
    if nproc == 1:
        return [python, script, *args]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *torchrun_args, script, *args]


def train(args, nproc=1, python=sys.executable, timeout=None, env=None):
    """Runs command(args, nproc, python) in the repo root with the environment `env` (None: this
    process's) and waits for it. Returns the CompletedProcess, its stdout and stderr as text.

    Raises UserError with the command, its exit status and its output if it fails, and
    subprocess.TimeoutExpired if it runs past `timeout` seconds.
    """
    cmd = command(args, nproc, python)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise UserError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_log(path):
    """The records of a log.jsonl, or of DIR/log.jsonl, as a list of dicts in the file's order.
    A last line that is not JSON is skipped: a run killed while appending it leaves it cut.

    Raises UserError, in one line, for a file that cannot be read, a line before the last that is
    not JSON, or a file without records.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "log.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not text: not a log.jsonl?") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise UserError(f"{path} line {number} is not JSON: not a log.jsonl?") from None
    if not records:
        raise UserError(f"{path} holds no records")
    return records


def split_records(records):
    """(train steps, evals, HellaSwag evals): the records that hold "loss", "val_loss" and
    "hellaswag_acc_norm", each list in the log's order."""
    return ([r for r in records if "loss" in r], [r for r in records if "val_loss" in r],
            [r for r in records if "hellaswag_acc_norm" in r])
