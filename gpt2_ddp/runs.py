"""Launching train_gpt2.py and reading the log.jsonl it writes, for the tests and scripts; and running
any command with its output streamed."""

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpt2_ddp.configurator import UserError

ROOT = Path(__file__).resolve().parent.parent
STOP_GRACE_S = 60  # how long a stopped child may take to end (a training run saves its last step)


def command(args, nproc=1, python=sys.executable, torchrun_args=(), torchrun=None):
    """The argv that runs train_gpt2.py with `args` under `python`: plain for one process, under
    torchrun --standalone --nproc_per_node=N (then `torchrun_args`) for more, or with torchrun=True."""
    script = str(ROOT / "train_gpt2.py")
    if not (nproc > 1 if torchrun is None else torchrun):
        return [python, script, *args]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *torchrun_args, script, *args]


@contextlib.contextmanager
def stop_signals_end(child):
    """While the block waits on child, SIGTERM or SIGINT here passes SIGTERM on to it, waits up to
    STOP_GRACE_S for it to end (then kills it) and exits 128 + signum; off the main thread, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopped = []

    def stop(signum, frame):
        for s in handlers:  # a second signal while the child ends must not leave it behind
            signal.signal(s, signal.SIG_IGN)
        print(f"{Path(sys.argv[0]).name}: stopped by {signal.Signals(signum).name}; ending the "
              f"command it runs", file=sys.stderr, flush=True)
        child.terminate()
        stopped.append(signum)
        raise SystemExit(128 + signum)  # out of the block's wait, which holds Popen's lock

    handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except SystemExit:
        if stopped:
            try:
                child.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        raise
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def stream(cmd, on_line, timeout=None, env=None):
    """Runs cmd in the repo root, calling on_line(line, from_stdout) for each output line, one call at
    a time; a stop signal here ends cmd first (stop_signals_end). Returns (exit code, or None when
    killed past `timeout` seconds; stdout; stderr)."""
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=ROOT)
    stdout, stderr, lock = [], [], threading.Lock()

    def read(pipe, lines, from_stdout):
        with pipe:
            for line in pipe:
                with lock:
                    lines.append(line)
                    on_line(line, from_stdout)

    # a full pipe would stall the run; daemon threads, as workers of a killed torchrun may hold them
    readers = [threading.Thread(target=read, args=(child.stdout, stdout, True), daemon=True),
               threading.Thread(target=read, args=(child.stderr, stderr, False), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        with stop_signals_end(child):
            code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        code = None
    for reader in readers:
        reader.join(1 if code is None else None)  # what is left in the pipes after a kill
    return code, "".join(stdout), "".join(stderr)


def train(args, nproc=1, python=sys.executable, timeout=None, env=None, progress=None, torchrun=None):
    """The CompletedProcess of command(args, ...) run by stream(), with `progress` labelling its "step"
    lines on stderr. Raises UserError with the output if it fails, TimeoutExpired past `timeout` s."""
    cmd = command(args, nproc, python, torchrun=torchrun)
    start = time.monotonic()
    if progress is not None:
        print(f"{progress}: started", file=sys.stderr, flush=True)

    def show(line, from_stdout):
        if progress is not None and from_stdout and line.startswith("step"):
            print(f"{progress}: {line.rstrip()}", file=sys.stderr, flush=True)

    code, stdout, stderr = stream(cmd, show, timeout, env)
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    if code != 0:
        raise UserError(f"{' '.join(cmd)} failed ({code}):\n{stdout}\n{stderr}")
    if progress is not None:
        print(f"{progress}: finished in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def read_log(path, keep=lambda record: True, what="a JSON object"):
    """The records (dicts, in order) of a log.jsonl or DIR/log.jsonl. Lines not `what` (a JSON object
    keep(record) takes) are skipped with one warning naming them; an unterminated last one silently.
    Raises UserError for a file that cannot be read or that holds no record kept."""
    path = Path(path) / "log.jsonl" if Path(path).is_dir() else Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not text: not a log.jsonl?") from None
    records, bad, lines = [], [], text.splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and keep(record):
            records.append(record)
        elif number < len(lines) or text.endswith("\n"):
            bad.append(number)
    if bad:
        print(f"warning: {path}: skipped {len(bad)} line{'s that are' if len(bad) > 1 else ' that is'} "
              f"not {what} (line{'s' * (len(bad) > 1)} {', '.join(map(str, bad[:10]))}"
              f"{', ...' if len(bad) > 10 else ''})", file=sys.stderr, flush=True)
    if not records:
        raise UserError(f"{path} holds no line that is {what}: not a log.jsonl of train_gpt2.py?")
    return records


def split_records(records):
    """(train steps, evals, HellaSwag evals): the records holding "loss", "val_loss", "hellaswag_acc_norm"."""
    return tuple([r for r in records if key in r] for key in ("loss", "val_loss", "hellaswag_acc_norm"))
