"""Collectives beyond DDP's own (every rank agreeing on a user's error, small values), each working
without a process group too; and torchrun's variables, a peer's failure and stop signals."""

import os
import re
import signal
import socket
import time
import traceback

import torch
import torch.distributed as dist

from gpt2_ddp.configurator import UserError


def agreed(fn, master_only=False):
    """Runs fn() on every rank (rank 0 alone with master_only); returns its result there, None elsewhere.
    A collective: a UserError of fn on any rank (the lowest's) is raised on every rank."""
    result, error = None, None
    if not master_only or not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise UserError(error)
    return result


def all_reduce_max(values, device):
    """The element-wise maximum of a list of ints over ranks. A collective."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def torchrun_env():
    """(launched, rank, local_rank, world_size) from torchrun's variables; without RANK, rank 0 of
    1. Raises UserError, in one line, for a value that is not a whole number, RANK or LOCAL_RANK not
    below WORLD_SIZE, WORLD_SIZE above 1 without RANK, or RANK set without MASTER_ADDR and MASTER_PORT."""
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for name, default in defaults.items():
        if not os.environ.get(name, default).isdecimal():
            raise UserError(f"{name}={os.environ[name]!r} is not a whole number; launch with torchrun, "
                            f"which sets it, or unset it to run one process")
    rank, local_rank, world_size = (int(os.environ.get(name, default)) for name, default in defaults.items())
    if max(rank, local_rank) >= world_size:
        raise UserError(f"RANK={rank} and LOCAL_RANK={local_rank} must be below WORLD_SIZE={world_size} "
                        f"(ranks count from 0); launch with torchrun --nproc_per_node=N, which sets them")
    launched = "RANK" in os.environ
    if not launched and world_size != 1:
        raise UserError(f"WORLD_SIZE={world_size} is set but RANK not: launch with torchrun, which sets "
                        f"both, or unset WORLD_SIZE to run one process")
    if missing := [name for name in ("MASTER_ADDR", "MASTER_PORT") if launched and not os.environ.get(name)]:
        raise UserError(f"RANK is set but {' and '.join(missing)} not: launch with torchrun "
                        f"(--standalone on one machine), which sets them")
    return launched, rank, local_rank, world_size


def wait_for_master(timeout_s):
    """Waits up to timeout_s seconds for rank 0's store at MASTER_ADDR:MASTER_PORT to take a connection;
    raises UserError when it does not (c10d's wait logs a C++ stack)."""
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(address, timeout=1).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise UserError(f"rank 0 at {address[0]}:{address[1]} did not answer within "
                                f"collective_timeout_s={timeout_s} s ({e.strerror or e}): start every "
                                f"rank, check MASTER_ADDR and MASTER_PORT") from None
            time.sleep(0.1)


def machine_failure(e, rank, world_size, timeout_s):
    """The UserError for a collective's peer stopped, hung or gone (gloo's timeout or closed connection,
    NCCL's DistError) or torch.compile without a working C++ compiler; None for another error. A peer lost
    in train()'s loop under torchrun with restarts left: the step after which it was lost and the checkpoint
    that the restarted workers resume from (train()'s locals `step` and `last_saved`)."""
    text = re.sub(r"^.*\] ", "", (str(e).strip().splitlines() or [""])[0]).split(". ")[0]  # after [file:line]
    if "InvalidCxxCompiler" in text:
        return UserError(f"torch.compile found no working C++ compiler ({text}): install one (g++), "
                         f"set CXX to one, or pass --compile=false")
    if not isinstance(e, dist.DistError) and not re.search(r"Timed out waiting|by peer", text):
        return None
    loop = next((f.f_locals for f, _ in traceback.walk_tb(e.__traceback__) if "last_saved" in f.f_locals), {})
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if loop and restarts[0] != restarts[1]:
        return UserError(f"rank {rank}: a peer process was lost after step {loop['step']} ({text}); torchrun "
                         f"restarts the workers, which resume from the last checkpoint "
                         + (f"(step {loop['last_saved']})" if loop["last_saved"] else "(none yet: step 0)"))
    return UserError(f"rank {rank}: {f'rank {1 - rank}' if world_size == 2 else 'another rank'} stopped, "
                     f"hung or died ({text}): no answer within collective_timeout_s={timeout_s} s; its "
                     f"output says why. Rerun to resume, or raise --collective_timeout_s")


class Stopped(Exception):
    """A stop signal reached some rank during an evaluation or a sample, which is left undone."""


class StopSignals(list):
    """The stop signals (STOP_SIGNALS) this rank has received, in order."""

    def __init__(self, device):
        super().__init__()
        self.device = device

    def first(self):
        """The first signal received; SIGTERM for one that reached another rank only."""
        return signal.Signals(self[0] if self else signal.SIGTERM)

    def check(self):
        """Raises Stopped if any rank has received one. A collective with a host sync (once per batch)."""
        flag = torch.tensor(float(len(self)), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise Stopped


STOP_SIGNALS = [signal.SIGINT, signal.SIGTERM] + [signal.SIGHUP] * hasattr(signal, "SIGHUP")


def catch_stop_signals(device):
    """Makes the STOP_SIGNALS (Ctrl-C, a scheduler's before a kill, a closed ssh's) ask the loop to save
    and exit, and a second one end it at once; the first one's line says so at once (rank 0's). Returns
    the StopSignals the handler appends them to."""
    received = StopSignals(device)

    def handler(signum, frame):
        received.append(signum)
        signal.signal(signum, signal.SIG_DFL)
        if len(received) == 1 and int(os.environ.get("RANK", 0)) == 0:  # os.write: a print may be mid-line
            os.write(1, f"got {signal.Signals(signum).name}: the run saves after this step (an evaluation "
                        f"ends early) and exits; a second stop signal ends it without saving\n".encode())

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)
    return received


def stopped_line(signum, step, start_step):
    """What a run stopped by signum at `step` says: the step saved, or that it made no update."""
    if step > start_step:
        return f"stopped by {signum.name} after step {step}, which is saved; rerun the same command to resume"
    return f"stopped by {signum.name} at step {step}, before this run's first update: nothing new to save"
