"""train_gpt2.py's out_dir: the lock that keeps one run in it, and checkpoints written atomically with
a checksum, loaded newest first past damaged ones, and pruned sparing the one resumed from.
open_out_dir() and load_newest() are collectives; the rest runs on rank 0, or on any rank alone."""

import contextlib
import errno
import hashlib
import itertools
import json
import os
import socket
import weakref
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.collectives import agreed
from gpt2_ddp.configurator import UserError

try:
    import fcntl  # POSIX; where it is missing (Windows) out_dir is not locked
except ImportError:
    fcntl = None

KEYS = ("model", "optimizer", "config", "step", "loader")  # what every checkpoint of ours holds
VERSION = 5  # save()'s format; a resume refuses any other, init_from reads only the weights


def path_of(out_dir, step):
    return Path(out_dir) / f"ckpt_{step:07d}.pt"


def step_of(name):
    """The step of a file named as path_of() names a checkpoint, else None."""
    digits = name.removeprefix("ckpt_").removesuffix(".pt")
    return int(digits) if digits.isdecimal() and name == path_of(".", int(digits)).name else None


def listed(out_dir):
    """The run's checkpoints in out_dir (files named as path_of() names them), oldest step first."""
    steps = {step_of(p.name): p for p in Path(out_dir).glob("ckpt_*.pt") if p.is_file()}
    return [steps[step] for step in sorted(steps.keys() - {None})]


def newest_config(out_dir):
    """The config dict of out_dir's newest checkpoint that torch.load reads, unchecked (a resume checks
    the one it loads; every checkpoint of a run has its model's shape), or {} where none is read."""
    for path in reversed(listed(out_dir)):
        with contextlib.suppress(Exception):  # torch.load raises many kinds for a file cut short
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["config"]
    return {}


# the temp files that atomic_write leaves in out_dir when a run is killed mid-write
OWN_TEMPS = ("log.jsonl.tmp", "token_ids.json.tmp", "wandb_run_id.tmp")


def remove(path):
    """Deletes a file; a failure (permissions, a read-only mount) is a warning, not the run's end."""
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as e:
        print(f"warning: cannot delete {path}: {e.strerror}", flush=True)


def lock(out_dir):
    """Makes out_dir and flocks {out_dir}/.lock (released however the process ends), returning the
    file to keep open while the run lasts; a filesystem without flock gets a warning, no lock.
    Raises UserError when out_dir cannot be made or written, or another process holds the lock."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        f = open(out_dir / ".lock", "a+")
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"out_dir {out_dir} is a file or lies inside one: pass a directory as "
                        f"--out_dir") from None
    except OSError as e:
        raise UserError(f"cannot write to out_dir {out_dir}: {e.strerror}; pass a writable "
                        f"--out_dir") from None
    if fcntl is not None:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise UserError(f"out_dir {out_dir} is in use by another run ({holder}); wait for it to "
                            f"end, or pass another --out_dir") from None
        except OSError as e:
            print(f"warning: cannot lock out_dir {out_dir} ({e.strerror}): nothing stops a second "
                  f"run from using it", flush=True)
    f.truncate(0)
    print(f"pid {os.getpid()} on {socket.gethostname()}", file=f, flush=True)
    return f


def sha256(state):
    """Hex SHA-256 of a checkpoint's contents: every tensor's dtype, shape and bytes and every other
    value's repr, in the dicts' order (which torch.save keeps)."""
    h = hashlib.sha256()

    def update(obj):
        if torch.is_tensor(obj):
            t = obj.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(obj, dict):
            for key, value in obj.items():
                h.update(repr(key).encode())
                update(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                update(value)
        else:
            h.update(repr(obj).encode())

    update(state)
    return h.hexdigest()


def map_tensors(fn, obj):
    """obj (nested dicts, lists and tuples) with fn(t) in place of each tensor t."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: map_tensors(fn, value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, value) for value in obj)
    return obj


def save(path, state):
    """Writes state (a dict of KEYS, "scaler" and "evaluated"), its format VERSION and its sha256 to `path`
    atomically. Raises UserError, writing nothing and keeping every older checkpoint, when a float in state
    is not finite (the run diverged) or the write fails (disk full, permissions)."""
    found, floats = [], {}  # floats by device: one host sync per device, not per tensor
    map_tensors(found.append, state)
    for t in filter(torch.is_floating_point, found):
        floats.setdefault(t.device, []).append(torch.isfinite(t).all())
    if not all(bool(torch.stack(flags).all()) for flags in floats.values()):
        raise UserError(f"the weights or optimizer state hold non-finite values at step "
                        f"{state['step']}, so {path} was not saved and the last checkpoint is "
                        f"kept: the run diverged; lower --max_lr or --grad_clip and resume")
    # on the CPU once, for the checksum and the write
    state = {**map_tensors(lambda t: t.detach().cpu(), state), "version": VERSION}
    state["sha256"] = sha256(state)
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:
        # torch.save's zip writer ends a failed write with a RuntimeError of its own
        error = e if isinstance(e, OSError) else e.__context__
        if not isinstance(error, OSError):
            raise
        raise UserError(f"cannot save checkpoint {path}: {error.strerror or error}; the older checkpoints "
                        f"are kept: free some space or pass another --out_dir, and rerun to resume") from None


def resolve(source):
    """The checkpoint that `source` names: itself, or an out_dir's newest (listed()); None for a Hugging Face
    directory (with config.json) or no path (a hub name). Raises UserError for a directory holding neither."""
    path = Path(source)
    if path.is_dir() and not (path / "config.json").exists():
        if not (found := listed(path)):
            raise UserError(f"{path} holds neither checkpoints (ckpt_NNNNNNN.pt) nor a Hugging Face "
                            f"config.json")
        return found[-1]
    return path if path.is_file() else None


class Unloadable(Exception):
    """A checkpoint that cannot be read, is not one of train_gpt2.py's, or fails its checksum."""


class NotOurs(Unloadable):
    """A file torch.load reads that lacks `missing`, keys every train_gpt2.py checkpoint holds."""

    def __init__(self, missing):
        super().__init__(f"not a train_gpt2.py checkpoint: no {', '.join(missing)}")
        self.missing = missing


def load(path):
    """The state that save() wrote, on the CPU (memory-mapped, so ranks on one node share the
    pages), after checking its keys and checksum. Raises Unloadable with the reason in one line."""
    if not zipfile.is_zipfile(path):  # torch.load's message for it is about save() options
        raise Unloadable(f"not the zip archive torch.save writes, but {os.path.getsize(path)} bytes of "
                         f"something else: a save cut short, or another file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch.load raises many kinds for a zip it cannot read
        raise Unloadable(f"{e.__class__.__name__}: {(str(e).strip().splitlines() or [''])[0]}")
    missing = [key for key in (*KEYS, "sha256") if key not in state] if isinstance(state, dict) else KEYS
    if missing:
        raise NotOurs(missing)
    expected = state.pop("sha256")
    if sha256(state) != expected:
        raise Unloadable("its contents do not match its checksum: the file is corrupt")
    return state


def newest_loadable(out_dir, warn):
    """The newest checkpoint of out_dir that loads, as (path, state), or (None, None) if there is
    none. Each newer one that fails is named in warn() and renamed {name}.damaged (.damaged2...).
    Raises UserError, renaming nothing, when checkpoints exist but none loads."""
    damaged = []
    for path in reversed(listed(out_dir)):
        try:
            state = load(path)
        except Unloadable as e:
            warn(f"warning: cannot load checkpoint {path} ({e}); trying the one before")
            damaged.append((path, e))
            continue
        for bad, _ in damaged:
            aside, n = bad.with_name(bad.name + ".damaged"), 1
            while aside.exists():  # set aside before, at the same step
                n += 1
                aside = bad.with_name(f"{bad.name}.damaged{n}")
            try:
                os.replace(bad, aside)
                warn(f"warning: set {bad} aside as {aside.name}")
            except OSError as e:
                warn(f"warning: cannot rename {bad} ({e.strerror}): remove it by hand")
        return path, state
    if damaged:
        raise UserError(f"no checkpoint in {out_dir} can be loaded (the oldest: {damaged[-1][1]}); "
                        f"move the ckpt_*.pt files out of it to start over there, or pass another --out_dir")
    return None, None


def unmake(dirs, lock_file):
    """Deletes out_dir's lock, and then the dirs made for out_dir (deepest first) that are empty."""
    with contextlib.suppress(OSError):
        if [p.name for p in dirs[0].iterdir()] == [".lock"]:
            (dirs[0] / ".lock").unlink()  # while still held, so no other run's lock is deleted
        lock_file.close()
        for d in dirs:
            d.rmdir()


class OutDir:
    """Rank 0's hold on a run's out_dir: its lock (taken at once; raises UserError as lock() does),
    log.jsonl and checkpoints. With `overwrite` nothing old is deleted until the run's first
    checkpoint is saved; till then the old log waits as log.jsonl.old for a later run to restore."""

    def __init__(self, path):
        self.path = Path(path)
        made = [p for p in (self.path, *self.path.parents) if not p.exists()]  # deepest first
        self.lock = lock(self.path)
        # a run that fails before its first step leaves no empty out_dir of its making behind
        self.unmake = weakref.finalize(self, unmake, made, self.lock) if made else None
        self.log_path, self.old_log = self.path / "log.jsonl", self.path / "log.jsonl.old"
        self.overwrite = None  # with overwrite: the old checkpoints, deleted at the first save
        self.protected = set()

    def start(self, start_step, resumed_from, overwrite):
        """Before the first step: removes the temp files of killed saves, then cuts log.jsonl to
        the records up to start_step; on a fresh start it keeps an earlier run's log.jsonl as
        log.N.jsonl (the first N free), or with `overwrite` (a list of checkpoints) sets it aside.
        Raises UserError if out_dir can't be written or one of those deleted."""
        self.protected = {resumed_from} - {None}
        if self.unmake:
            self.unmake.detach()
        for old in overwrite:  # renamed away and back: what deleting it needs, changing nothing
            try:
                os.replace(old, old.with_name(old.name + ".probe"))
                os.replace(old.with_name(old.name + ".probe"), old)
            except OSError as e:
                raise UserError(f"--overwrite cannot delete {old} ({e.strerror}): delete it by hand, or "
                                f"pass another --out_dir") from None
        try:
            for stale in self.path.glob("*.tmp"):
                if stale.name in OWN_TEMPS or step_of(stale.name.removesuffix(".tmp")) is not None:
                    stale.unlink()
            fresh = resumed_from is None and not overwrite or self.old_log.exists()
            if fresh and self.log_path.is_file() and self.log_path.stat().st_size:
                n = next(n for n in itertools.count(1) if not (self.path / f"log.{n}.jsonl").exists())
                aside = self.path / f"log.{n}.jsonl"
                os.replace(self.log_path, aside)  # a run with no checkpoint to resume keeps its records
                print(f"kept the records of an earlier run with no checkpoint here as {aside}", flush=True)
            if self.old_log.exists():  # an overwrite ended before its first checkpoint
                os.replace(self.old_log, self.log_path)
            if overwrite:
                self.overwrite = list(overwrite)
                if self.log_path.exists():
                    os.replace(self.log_path, self.old_log)
                return
            kept = []
            for line in (self.log_path.read_text().splitlines() if self.log_path.exists() else []):
                try:
                    record = json.loads(line)
                    if int(record["step"]) <= start_step:
                        kept.append(json.dumps(record) + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # cut by a kill, or damaged: it cannot be plotted either
            atomic_write(self.log_path, lambda f: f.write("".join(kept).encode()))
        except OSError as e:
            raise UserError(f"cannot write to out_dir {self.path}: {e.strerror}; pass a writable "
                            f"--out_dir") from None

    def holds_out_dir(self):
        """Whether out_dir's .lock is the file this run locked, not one of a run since (or none)."""
        try:
            return os.path.samestat(os.stat(self.lock.name), os.fstat(self.lock.fileno()))
        except OSError:
            return False

    def log(self, record):
        """Appends record (a dict) to log.jsonl as one JSON line, unless out_dir is no longer this
        run's. A failed append (a full disk) is cut off again: readers never meet a torn line."""
        line = (json.dumps(record) + "\n").encode()
        try:
            if not self.holds_out_dir():
                return  # the next save stops the run
            with open(self.log_path, "ab", buffering=0) as f:  # one write(2): all, part or nothing
                end = f.seek(0, os.SEEK_END)
                if f.write(line) != len(line):  # a full disk took part of it
                    f.truncate(end)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:  # the next save reports a full disk on every rank
            print(f"warning: cannot append to {self.log_path}: {e.strerror}", flush=True)

    def save(self, step, state, keep):
        """Saves the checkpoint of `step` (save(), whose UserError it raises), deletes the old
        ones and log the first time with overwrite, then keeps the newest `keep`. Returns its path."""
        path = path_of(self.path, step)
        if not self.holds_out_dir():
            raise UserError(f"out_dir {self.path} was deleted or replaced while this run trained, so "
                            f"step {step} is not saved there, where another run may be writing: rerun "
                            f"with another --out_dir")
        save(path, state)
        if self.overwrite is not None:
            for old in self.overwrite:
                if old != path:  # the new checkpoint may have an old one's name
                    remove(old)
            remove(self.old_log)
            self.overwrite = None
        if keep > 0:  # 0 keeps all; never prunes the one resumed from or the one just saved
            for old in listed(self.path)[:-keep]:
                if old not in self.protected | {path}:
                    remove(old)
        return path


def open_out_dir(config):
    """A collective: rank 0's OutDir of config.out_dir (a second run on it stops here) and the checkpoints
    there. Raises UserError on every rank when resume=never would overwrite them without overwrite=true."""
    out = agreed(lambda: OutDir(config.out_dir), master_only=True)
    existing = listed(config.out_dir)
    if config.resume == "never" and existing and not config.overwrite:
        raise UserError(f"{config.out_dir} has checkpoints and resume=never would overwrite them; pass "
                        f"--resume=auto to continue, --overwrite=true to start over, or another --out_dir")
    return out, existing


def load_newest(out_dir, warn):
    """newest_loadable's (path, state) on every rank, which load rank 0's choice. Raises UserError on every
    rank when none loads, a rank cannot read rank 0's choice, or it is of another format than VERSION."""
    master_process = not dist.is_initialized() or dist.get_rank() == 0
    found = agreed(lambda: newest_loadable(out_dir, warn), master_only=True)
    box = [found[0] if master_process else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if (path := box[0]) is None:
        return None, None

    def load_here():
        if master_process:
            return found[1]
        try:
            return load(path)
        except Unloadable as e:
            raise UserError(f"checkpoint {path} loads on rank 0 but not on this node ({e}): out_dir "
                            f"must be a directory that every node sees") from None

    state = agreed(load_here)
    if (version := state.get("version", "none")) != VERSION:
        newer = isinstance(version, int) and version > VERSION
        raise UserError(f"checkpoint {path} is of {'a newer' if newer else 'an older'} format (version "
                        f"{version}) than this train_gpt2.py's ({VERSION}): " + (
                            "update this repository (git pull) to resume it" if newer else
                            f"start a new run from its weights with --out_dir=NEW_DIR --init_from={out_dir}"))
    return path, state
