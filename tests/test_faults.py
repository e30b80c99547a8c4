"""Checkpoints, exact resume, dead ranks and bad input: each fault the way a user meets it."""

import gc
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (ROOT, TINY, free_port, make_shards, read_log, run_training, train_here,
                      write_hellaswag)
from gpt2_ddp import checkpoints, runs
from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.configurator import UserError
from gpt2_ddp.shards import write_shard
import train_gpt2

STEPS = 40
# 8 micro-batches of 32 tokens per step; checkpoints every 5 steps; exact_reduction, so that runs
# at any world size are bitwise the same run
RUN = [*TINY, "--total_batch_size=256", f"--max_steps={STEPS}", "--checkpoint_interval=5",
       "--eval_interval=10", "--dropout=0.1", "--exact_reduction=true"]


@pytest.fixture(scope="module")
def data_dir(equiv_data_dir):
    return equiv_data_dir


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """The reference: never interrupted, in this process (exact_reduction: the same run at any world
    size)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_training([*RUN, f"--data_dir={data_dir}", f"--out_dir={out}"])
    return read_log(out)


def children(pid):
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_for_step(out_dir, step, proc, timeout=120):
    """Blocks until log.jsonl has a train record of `step` or later."""
    deadline = time.time() + timeout
    log = Path(out_dir) / "log.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if log.exists():
            lines = [line for line in log.read_text().splitlines() if line.endswith("}")]
            if any(json.loads(line).get("step", -1) >= step and "loss" in json.loads(line)
                   for line in lines):
                return
        time.sleep(0.01)
    raise TimeoutError(f"step {step} not reached")


def torchrun(args, nproc, extra=()):
    cmd = runs.command(args, nproc, torchrun_args=extra)
    # plain torchrun: no TORCH_DISABLE_SHARE_RDZV_TCP_STORE, which scripts/train_resilient.sh sets
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.compat
def test_sigkilled_worker_is_restarted_and_the_run_continues_bitwise(data_dir, uninterrupted, tmp_path):
    """Plain torchrun --max-restarts=1 restarts both workers after one is SIGKILLed (the workers
    keep each attempt's keys apart in torchrun's store); they resume from the last checkpoint and
    log exactly (bitwise) the losses of the uninterrupted run."""
    proc = torchrun([*RUN, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"], 2,
                    extra=["--max-restarts=1"])
    wait_for_step(tmp_path, 12, proc)
    os.kill(children(proc.pid)[-1], signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    assert "resumed from" in output
    steps, evals = read_log(tmp_path)
    ref_steps, ref_evals = uninterrupted
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))  # replayed steps logged once
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps]
    assert [e["val_loss"] for e in evals] == [e["val_loss"] for e in ref_evals]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_torchrun_saves_a_checkpoint_and_the_rerun_continues_bitwise(
        data_dir, uninterrupted, tmp_path, signum):
    """As a cluster preempts a job (SIGTERM) or an ssh connection closes (SIGHUP): the signal to
    torchrun, which passes it to the workers. They agree to stop after the same step, save a
    checkpoint there (not on a checkpoint_interval step) and say so in one line; rerunning the
    command finishes the run with the uninterrupted losses."""
    args = [*RUN, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--checkpoint_interval=0"]
    proc = torchrun(args, 2)
    wait_for_step(tmp_path, 12, proc)
    proc.send_signal(signum)
    output = proc.communicate(timeout=120)[0]
    steps, _ = read_log(tmp_path)
    last = steps[-1]["step"]
    assert f"stopped by {signum.name} after step {last}, which is saved; rerun the same command to " \
           f"resume" in output
    assert output.count(f"got {signum.name}: the run saves after this step") == 1  # rank 0's alone
    assert [p.name for p in tmp_path.glob("ckpt_*.pt")] == [f"ckpt_{last:07d}.pt"]
    assert "Traceback" not in output.split("stopped by")[0]  # the workers raised nothing
    if signum == signal.SIGHUP:
        return  # the resume is the same as after SIGTERM
    run_training(args, nproc=2)
    steps, evals = read_log(tmp_path)
    ref_steps, ref_evals = uninterrupted
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps]
    assert [e["val_loss"] for e in evals] == [e["val_loss"] for e in ref_evals]


def test_ctrl_c_in_one_process_saves_and_a_second_signal_ends_at_once(data_dir, tmp_path, capfd):
    proc = subprocess.Popen([sys.executable, "train_gpt2.py", *RUN, f"--data_dir={data_dir}",
                             f"--out_dir={tmp_path}", "--max_steps=100000"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path, 3, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT and err == ""
    assert out.splitlines()[-1].startswith("stopped by SIGINT after step ")
    assert out.count("got SIGINT: the run saves after this step (an evaluation ends early) and exits; a "
                     "second stop signal ends it without saving\n") == 1
    assert len(list(tmp_path.glob("ckpt_*.pt"))) == 1

    from gpt2_ddp.collectives import catch_stop_signals
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        received = catch_stop_signals(torch.device("cpu"))
        capfd.readouterr()
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the loop is asked to stop
        assert capfd.readouterr().out.startswith("got SIGTERM: the run saves after this step")  # at once
        os.kill(os.getpid(), signal.SIGHUP)  # a closed ssh connection's, to plain python
        assert received == [signal.SIGTERM, signal.SIGHUP] and capfd.readouterr().out == ""
        assert received.first() == signal.SIGTERM  # the one the run's last line and exit code name
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the next one kills at once
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_stop_signal_that_reached_another_rank_alone_stops_this_ones_evaluation(monkeypatch):
    """A signal to one node's ranks (a closed ssh's SIGHUP) must end every rank's evaluation at the
    same batch, or the others wait in its collectives; here rank 0 of 2, whose peer has one."""
    from gpt2_ddp import collectives

    def all_reduce(t, op):  # this rank's value and its peer's, reduced by the op asked for
        reduce = {"SUM": torch.sum, "MAX": torch.amax, "MIN": torch.amin}[op.name]
        t.copy_(reduce(torch.stack([t, torch.ones_like(t)]), 0))

    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(collectives.dist, "all_reduce", all_reduce)
    received = collectives.StopSignals(torch.device("cpu"))
    with pytest.raises(collectives.Stopped):
        received.check()
    assert received.first() == signal.SIGTERM  # what a rank that received none names


@pytest.mark.compat
def test_resume_on_another_world_size_continues_bitwise_the_same_run(data_dir, uninterrupted, tmp_path):
    """Killed at world size 2 (no restart), resumed at world size 1, killed again, resumed at 4:
    with exact_reduction, bitwise the losses of the uninterrupted run."""
    proc = torchrun([*RUN, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"], 2)
    wait_for_step(tmp_path, 12, proc)
    for pid in children(proc.pid):
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.communicate()
    checkpoints = sorted(tmp_path.glob("ckpt_*.pt"))
    assert checkpoints and torch.load(checkpoints[-1], weights_only=True)["step"] < STEPS
    # world size 1 goes on for a while; its process dies mid-run too
    proc = subprocess.Popen([sys.executable, "train_gpt2.py", *RUN, f"--data_dir={data_dir}",
                             f"--out_dir={tmp_path}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for_step(tmp_path, 25, proc)
    proc.kill()
    proc.communicate()
    out = run_training([*RUN, f"--data_dir={data_dir}", f"--out_dir={tmp_path}"], nproc=4).stdout
    assert "resumed from" in out
    steps, evals = read_log(tmp_path)
    ref_steps, ref_evals = uninterrupted
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps]
    assert [e["val_loss"] for e in evals] == [e["val_loss"] for e in ref_evals]


class PickledCall:
    """Unpickled, it calls open(path, "w"): code a file can carry that weights_only loading refuses."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_checkpoint_carrying_pickled_code_is_refused_and_never_runs_it(tmp_path):
    """A checkpoint someone else wrote may hold code: resuming (load) and reading the newest one's
    shape (newest_config) refuse it without running it."""
    ran = tmp_path / "the pickled code ran"
    torch.save({"config": {"n_layer": 2}, "model": PickledCall(ran)}, tmp_path / "ckpt_0000001.pt")
    assert checkpoints.newest_config(tmp_path) == {}
    with pytest.raises(checkpoints.Unloadable, match="^UnpicklingError: Weights only load failed"):
        checkpoints.load(tmp_path / "ckpt_0000001.pt")
    assert not ran.exists()


def test_checkpoints_are_kept_loaded_safely_and_checked(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--total_batch_size=64",
            "--max_steps=6", "--checkpoint_interval=1", "--keep_checkpoints=2"]
    run_training(args)
    assert [p.name for p in sorted(tmp_path.glob("ckpt_*"))] == ["ckpt_0000005.pt", "ckpt_0000006.pt"]
    ckpt = torch.load(tmp_path / "ckpt_0000006.pt", weights_only=True)  # no pickled code inside
    assert set(ckpt) == {"model", "optimizer", "scaler", "config", "step", "loader", "evaluated",
                         "version", "sha256"}
    assert ckpt["scaler"] == {} and ckpt["config"]["dtype"] == "float32"  # dtype=auto on the CPU
    assert ckpt["step"] == 6 and ckpt["loader"]["tokens"] == 6 * 64
    assert ckpt["loader"]["shards"] == [[p.name, (p.stat().st_size - 1024) // 2]
                                        for p in sorted(data_dir.glob("*_train_*.bin"))]
    assert ckpt["version"] == checkpoints.VERSION

    # rerunning a finished run says so, trains nothing and succeeds
    log_before = (tmp_path / "log.jsonl").read_text()
    out = run_training(args).stdout
    assert (f"the run in {tmp_path} is complete: step 6 of max_steps=6. Raise --max_steps to train on, "
            "or start over with --resume=never --overwrite=true or another --out_dir\n") in out
    assert (tmp_path / "log.jsonl").read_text() == log_before

    # a checkpoint of another model is refused, with both sides of each difference, before the
    # optimizer's parameter groups (which the extra layer changes too) are compared
    extra = args[len(TINY):]
    assert (f"is of another model: n_layer=2 in the checkpoint, 3 in this run; to train this model, start "
            f"a new run with --out_dir=NEW_DIR, or start over in {tmp_path} with --resume=never "
            "--overwrite=true (deletes its checkpoints)\n") in train_error(*extra, "--n_layer=3", "--max_steps=8")

    # resume=never refuses to overwrite checkpoints unless told to
    assert train_error(*extra, "--resume=never") == (
        f"train_gpt2.py: error: {tmp_path} has checkpoints and resume=never would overwrite them; pass "
        f"--resume=auto to continue, --overwrite=true to start over, or another --out_dir\n")
    run_training([*args, "--resume=never", "--overwrite=true", "--max_steps=2"])
    assert [p.name for p in sorted(tmp_path.glob("ckpt_*"))] == ["ckpt_0000001.pt", "ckpt_0000002.pt"]
    assert [s["step"] for s in read_log(tmp_path)[0]] == [1, 2]

    # a truncated newest checkpoint (not one of ours: ours are written atomically) is named in a
    # warning and the run resumes from the one before; when none loads, one line says so
    data = (tmp_path / "ckpt_0000002.pt").read_bytes()
    (tmp_path / "ckpt_0000002.pt").write_bytes(data[: len(data) // 2])
    out = run_training([*args, "--max_steps=3"]).stdout
    assert (f"warning: cannot load checkpoint {tmp_path}/ckpt_0000002.pt (not the zip archive torch.save "
            f"writes, but {len(data) // 2} bytes of something else: a save cut short, or another file)") in out
    assert f"resumed from {tmp_path}/ckpt_0000001.pt at step 1" in out
    assert [s["step"] for s in read_log(tmp_path)[0]] == [1, 2, 3]
    for path in tmp_path.glob("ckpt_*.pt"):
        path.write_bytes(b"")
    assert train_error(*extra).endswith(
        f"error: no checkpoint in {tmp_path} can be loaded (the oldest: not the zip archive torch.save "
        f"writes, but 0 bytes of something else: a save cut short, or another file); move the ckpt_*.pt "
        f"files out of it to start over there, or pass another --out_dir\n")


def test_resume_keeps_the_log_up_to_its_checkpoint(tmp_path):
    """Resuming from ckpt_4 keeps the records of steps <= 4 (the evaluations of step 4 ran before
    it was saved) and drops the rest; a damaged line is dropped alone. A fresh start keeps nothing."""
    from gpt2_ddp import checkpoints

    def kept(records, resumed_from):
        out = checkpoints.OutDir(tmp_path)
        out.log_path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
        out.start(4 if resumed_from else 0, resumed_from, [])
        out.lock.close()
        return [(r["step"], "loss" in r) for r in map(json.loads, out.log_path.read_text().splitlines())]

    def train(step):
        return {"step": step, "loss": 1.0}

    def val(step):
        return {"step": step, "val_loss": 2.0}

    ckpt = tmp_path / "ckpt_0000004.pt"
    new = [val(0), *map(train, range(1, 5)), val(4), train(5), train(6)]
    assert kept(new, ckpt) == [(0, False), *((s, True) for s in range(1, 5)), (4, False)]
    assert kept(new, None) == []
    assert kept([train(1), '{"step": 2, "lo', train(3)], ckpt) == [(1, True), (3, True)]


def test_resume_with_another_micro_batch_size_sees_the_same_tokens(data_dir, tmp_path):
    """A run resumed with half the micro_batch_size (twice the micro-steps, as after running out
    of GPU memory) trains on the same sequences: the losses equal the uninterrupted run's to float
    rounding. No dropout: its masks are drawn per micro-batch."""
    args = [*TINY, f"--data_dir={data_dir}", "--total_batch_size=128", "--max_steps=8",
            "--checkpoint_interval=4", "--micro_batch_size=4"]
    run_training([*args, f"--out_dir={tmp_path / 'reference'}"])
    out = tmp_path / "resumed"
    out.mkdir()
    for name in ("ckpt_0000004.pt", "log.jsonl"):
        (out / name).write_bytes((tmp_path / "reference" / name).read_bytes())
    assert "resumed from" in run_training([*args, f"--out_dir={out}", "--micro_batch_size=2"]).stdout
    steps, _ = read_log(out)
    reference, _ = read_log(tmp_path / "reference")
    assert [s["step"] for s in steps] == list(range(1, 9))
    np.testing.assert_allclose([s["loss"] for s in steps], [s["loss"] for s in reference], rtol=1e-5)
    assert [s["loss"] for s in steps][:4] == [s["loss"] for s in reference][:4]


def launch_ranks(args, world_size, port):
    """Starts each rank as a plain process with torchrun's variables, so that no agent kills the
    survivors when one rank dies: only the collective timeout can end them."""
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "train_gpt2.py", *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_survivors_exit_within_the_collective_timeout(data_dir, tmp_path, fault):
    """A rank that dies (SIGKILL) or hangs (SIGSTOP) mid-run: the other rank fails with an error
    within collective_timeout_s (5 s here), not after gloo's default of 30 minutes."""
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--total_batch_size=64",
            "--max_steps=100000", "--eval_interval=0", "--collective_timeout_s=5"]
    survivor, victim = launch_ranks(args, 2, free_port())
    wait_for_step(tmp_path, 3, survivor)
    os.kill(victim.pid, fault)
    start = time.time()
    try:
        output = survivor.communicate(timeout=60)[0]
    finally:
        victim.kill()
        victim.communicate()
    assert survivor.returncode != 0
    assert time.time() - start < 5 + 10  # the timeout, plus teardown
    assert "Traceback" not in output
    assert re.fullmatch(r"train_gpt2.py: error: rank 0: rank 1 stopped, hung or died \([^()]+\): no answer "
                        r"within collective_timeout_s=5 s; its output says why. Rerun to resume, or raise "
                        r"--collective_timeout_s", output.splitlines()[-1])


def test_a_lost_peer_is_named_only_where_two_ranks_leave_one_candidate():
    """Above world size 2 a rank cannot tell which peer was lost, so the line names none."""
    from gpt2_ddp.collectives import machine_failure
    closed = RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:29500")
    assert str(machine_failure(closed, 0, 2, 5)).startswith("rank 0: rank 1 stopped, hung or died (")
    for rank in (0, 3):
        assert str(machine_failure(closed, rank, 4, 5)).startswith(
            f"rank {rank}: another rank stopped, hung or died (Connection closed by peer")


# --- bad input ------------------------------------------------------------------------------------

def train_error(*args, process=False):
    """train_gpt2.py's one-line error for TINY and `args`, as its stderr shows it: the UserError that
    main() raises in this process, or with process=True the stderr of a process of its own, checked
    to be that one line and exit code 1."""
    if not process:
        with pytest.raises(UserError) as error:
            train_here([*TINY, *args])
        line = f"train_gpt2.py: error: {error.value}\n"
        del error
        gc.collect()  # the traceback's frames hold the run's out_dir lock until collected
        return line
    proc = subprocess.run([sys.executable, "train_gpt2.py", *TINY, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("train_gpt2.py: error: ")
    assert proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_docs_own_text_path_runs_as_written_on_100_kb_and_says_what_it_chose(tmp_path):
    """docs/data.md's own-text commands, in a copy of the repository, on a 100 KB text: the val
    split (5 micro-batches) is evaluated whole, in one line; the epochs line gives max_steps against
    the train tokens; the first step's time (warm-up) sets no eta."""
    repo = tmp_path / "repo"
    (repo / "books").mkdir(parents=True)
    for name in ("train_gpt2.py", "prepare_data.py", "gpt2_ddp", "assets", "configs"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, repo / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                          if copy is shutil.copytree else {}))
    (repo / "books" / "small.txt").write_bytes((ROOT / "assets" / "tinyshakespeare.txt").read_bytes()[:100_000])
    block = re.search(r"## Your own text, end to end\n\n```bash\n(.*?)```", (ROOT / "docs" / "data.md").read_text(),
                      re.S)[1]
    prepare, train = [re.sub(r"\s+#.*", "", line) for line in re.sub(r"\\\n\s*", " ", block).splitlines()[:2]]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", f"{prepare} && {train} --max_steps=3"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "val_batches=64 is more than the val split holds: evaluating on all 5 micro-batches\n" in proc.stdout
    assert ("max_steps=3 x 2048 tokens a step = 6,144 tokens: 0.2 epochs of 424 rows, each epoch reading 99.9% "
            "of the 27,582 train tokens (0.0% twice)\n") in proc.stdout
    assert len(re.findall(r"^step +\d/3 \|.*\| eta \d+:\d\d:\d\d$", proc.stdout, re.M)) == 2
    assert re.search(r"^step +1/3 \|", proc.stdout, re.M) and not re.search(r"^step +1/3 .*eta", proc.stdout, re.M)
    assert [record["step"] for record in read_log(repo / "out" / "books")[1]] == [0, 3]


def test_bad_data_is_named_with_the_fix(tmp_path):
    big = tmp_path / "big_ids"
    make_shards(big)
    err = train_error(f"--data_dir={tmp_path}/missing", f"--out_dir={tmp_path}/new/o", process=True)
    assert (f"in {tmp_path}/missing, which does not exist; data dirs beside it with shards: {big}; make "
            f"them with `python prepare_data.py --input FILES --name missing --output_dir {tmp_path}/missing`, "
            f"then rerun `python train_gpt2.py ") in err
    assert not (tmp_path / "new").exists()  # a start that fails leaves no out_dir of its making behind
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    write_shard(only_train / "x_train_000001.bin", np.arange(100))
    assert "no val shards" in train_error(f"--data_dir={only_train}", f"--out_dir={tmp_path}/o")

    write_shard(big / "tiny_train_000001.bin", np.full(2000, 50256))  # GPT-2 ids, vocab_size 512
    err = train_error(f"--data_dir={big}", f"--out_dir={tmp_path}/o")
    assert "tiny_train_000001.bin holds token id 50256, beyond vocab_size=512" in err


@pytest.mark.parametrize("env, message", [
    ({"RANK": "abc"}, "RANK='abc' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a whole number"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 and LOCAL_RANK=0 must be below WORLD_SIZE=1"),
    ({"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "1"},
     "RANK=0 and LOCAL_RANK=1 must be below WORLD_SIZE=1"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK is set but MASTER_ADDR and MASTER_PORT not"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "RANK is set but MASTER_ADDR and MASTER_PORT not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK not: launch with torchrun"),
])
def test_a_launch_mistake_is_one_line(env, message, monkeypatch, plain_process):
    """torchrun's variables set by hand wrongly are refused in one line before any work; RANK marks a
    launched run at any WORLD_SIZE (torchrun --nproc_per_node=1 sets RANK=0, WORLD_SIZE=1)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import train_gpt2
    with pytest.raises(UserError, match=re.escape(message)) as refused:
        train_gpt2.main([*TINY, "--device=cpu"])
    assert "\n" not in str(refused.value)


def test_an_error_that_other_ranks_alone_find_is_raised_on_rank_0_too(monkeypatch):
    """agreed() raises on every rank the error of the lowest rank that found one, rank 0 included
    when it found none: here rank 0 of 3, whose peers' errors arrive in the all-gather."""
    from gpt2_ddp import collectives

    def all_gather_object(out, obj):
        out[:] = [obj, "rank 1's error", "rank 2's error"]

    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(collectives.dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(collectives.dist, "all_gather_object", all_gather_object)
    with pytest.raises(UserError, match="^rank 1's error$"):
        collectives.agreed(lambda: "rank 0's result")


def test_a_rank_waits_for_rank_0s_store_until_it_listens_or_the_timeout_ends(monkeypatch):
    """Ranks started before rank 0 keep trying to connect; past collective_timeout_s, one line."""
    from gpt2_ddp.collectives import wait_for_master
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with socket.socket() as store:
        later = threading.Timer(0.5, lambda: (store.bind(("127.0.0.1", port)), store.listen()))
        later.start()
        wait_for_master(60)
        later.join()
    with pytest.raises(UserError, match=rf"^rank 0 at 127.0.0.1:{port} did not answer within "
                                        rf"collective_timeout_s=0.3 s \("):
        wait_for_master(0.3)


def test_a_rank_whose_peer_never_joins_is_one_line_naming_the_timeout(tmp_path):
    """Rank 0 of two whose peer never starts, and rank 1 whose rank 0 never starts: each ends in one
    line within the collective timeout, not c10d's exception or its logged C++ stack."""
    start = time.time()
    procs, ports = [], set()
    while len(ports) < 2:  # each alone, on a port of its own
        ports.add(free_port())
    for rank, port in enumerate(ports):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "train_gpt2.py", *TINY, "--collective_timeout_s=2",
                                       f"--out_dir={tmp_path / str(rank)}"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, proc in enumerate(procs):
        _, stderr = proc.communicate(timeout=60)
        waited = ("could not join the process group within" if rank == 0
                  else "did not answer within")
        assert proc.returncode == 1 and stderr.startswith("train_gpt2.py: error: rank ")
        assert f" {waited} collective_timeout_s=2 s (" in stderr
        assert stderr.count("\n") == 1, stderr
    assert time.time() - start < 40


def test_unwritable_out_dir_fails_before_training(tmp_path):
    data = tmp_path / "data"
    make_shards(data)
    blocker = tmp_path / "file"
    blocker.write_text("a file where out_dir's parent should be")
    for out_dir in (blocker, blocker / "out"):
        err = train_error(f"--data_dir={data}", f"--out_dir={out_dir}")
        assert err.endswith(f"error: out_dir {out_dir} is a file or lies inside one: pass a directory as "
                            f"--out_dir\n")


def test_killed_prepare_data_leaves_no_shard_and_a_rerun_completes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = np.array(["the", "king", "of", "denmark", "is", "dead", "long", "live", "queen"])
    with open(corpus, "w") as f:
        for _ in range(40000):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 30))}) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "prepare_data.py", "--input", str(corpus), "--output_dir", str(out),
           "--shard_size", "20000", "--val_tokens", "20000", "--workers", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out.glob(".partial/*.bin")) and time.time() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert list(out.glob(".partial/*.bin")), "prepare_data.py ended before it could be killed"
    assert not list(out.glob("*.bin"))  # the loader sees nothing
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    shards = sorted(out.glob("*.bin"))
    assert len(shards) > 2 and not (out / ".partial").exists()


# --- nothing lost: divergence, damaged checkpoints, two runs, overwrite, a full disk ---------------

SMALL = [*TINY, "--total_batch_size=64", "--eval_interval=0", "--keep_checkpoints=2"]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A finished 4-step run with checkpoints of steps 2 and 4, and its data."""
    root = tmp_path_factory.mktemp("good_run")
    make_shards(root / "data")
    run_training([*SMALL, f"--data_dir={root / 'data'}", f"--out_dir={root / 'out'}", "--max_steps=4",
                  "--checkpoint_interval=2"])
    return root


def copy_run(good_run, tmp_path):
    """A copy of good_run's out_dir to change, and the bytes of its checkpoints."""
    out = tmp_path / "out"
    shutil.copytree(good_run / "out", out)
    return out, {p.name: p.read_bytes() for p in out.glob("ckpt_*.pt")}


def all_finite(path):
    state = torch.load(path, weights_only=True)
    tensors = [*state["model"].values(),
               *(t for s in state["optimizer"]["state"].values() for t in s.values())]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("during", ["eval", "hellaswag", "sample"])
def test_a_stop_signal_during_an_evaluation_or_a_sample_is_answered_within_seconds(during, tmp_path):
    """Each of these takes minutes here: SIGTERM ends it within a batch or token and the run exits.
    The evaluations at step 0 leave nothing to save; the sample at step 2 saves step 2 as a step
    whose evaluations did not run, which the resumed run runs."""
    data = tmp_path / "data"
    make_shards(data)
    write_shard(data / "tiny_val_000000.bin", np.random.default_rng(0).integers(0, 512, 700_000))
    write_hellaswag(data / "hellaswag.jsonl", 3000)
    long = {"eval": ["--eval_interval=2", "--val_batches=20000"],
            "hellaswag": ["--hellaswag_interval=2", f"--hellaswag_path={data / 'hellaswag.jsonl'}"],
            "sample": ["--sample_interval=2", "--sample_tokens=100000", "--sample_prompt=a"]}[during]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "train_gpt2.py", *SMALL, f"--data_dir={data}",
                             f"--out_dir={out}", "--max_steps=1000", "--device=cpu", *long], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if during == "sample":
        wait_for_step(out, 2, proc)
    else:
        for line in proc.stdout:
            if line.startswith("MFU not reported"):  # on the CPU, the last line before step 0
                break
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    start = time.time()
    stdout, stderr = proc.communicate(timeout=120)
    assert time.time() - start < 10
    assert proc.returncode == 128 + signal.SIGTERM and stderr == "", stderr
    if during == "sample":
        assert stdout.splitlines()[-1].startswith("stopped by SIGTERM after step 2, which is saved")
        assert torch.load(out / "ckpt_0000002.pt", weights_only=True)["evaluated"] is False
    else:
        assert stdout.splitlines()[-1] == ("stopped by SIGTERM at step 0, before this run's first "
                                           "update: nothing new to save")
        assert not list(out.glob("ckpt_*")) and "val loss" not in stdout and "hellaswag" not in stdout


def test_a_run_non_finite_from_its_first_update_ends_after_max_skipped_steps(tiny_data, tmp_path,
                                                                                   monkeypatch):
    """A fork whose loss is nan from the start has its first MAX_SKIPPED_STEPS updates skipped, not
    one fewer, before the run ends in one line."""
    forward = train_gpt2.GPT.forward

    def nan_loss(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        return logits, None if loss is None else loss * float("nan")

    monkeypatch.setattr(train_gpt2.GPT, "forward", nan_loss)
    err = train_error(*SMALL[len(TINY):], f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'out'}",
                      "--max_steps=20")
    assert f"not finite in steps 1-{train_gpt2.MAX_SKIPPED_STEPS} (loss nan" in err


@pytest.mark.compat
def test_a_diverging_run_skips_its_non_finite_steps_and_keeps_every_good_checkpoint(good_run, tmp_path):
    """lr 1e30 blows the weights up in step 5; from step 6 the loss is nan. Those updates are
    skipped and logged as such, the interval saves wait, and after 3 in a row the run ends in one
    line; the checkpoint it resumed from is kept whatever keep_checkpoints says, and no checkpoint
    holds a non-finite value."""
    out, before = copy_run(good_run, tmp_path)
    err = train_error(*SMALL[len(TINY):], f"--data_dir={good_run / 'data'}", f"--out_dir={out}",
                      "--max_steps=20", "--max_lr=1e30", "--checkpoint_interval=1", "--keep_checkpoints=1")
    assert ("the loss or gradient norm was not finite in steps 6-8 (loss nan, grad norm nan): the "
            "run diverged; those updates were skipped. Lower --max_lr (now 1e+30) or look for bad "
            "data in those steps, and rerun to resume from the newest checkpoint (step 5)") in err
    assert (out / "ckpt_0000004.pt").read_bytes() == before["ckpt_0000004.pt"]
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_0000004.pt", "ckpt_0000005.pt"]
    assert all(all_finite(p) for p in out.glob("ckpt_*.pt"))
    steps, _ = read_log(out)
    assert [s["step"] for s in steps if s.get("skipped")] == [6, 7, 8]
    # diverging before its first save, a resumed run names the checkpoint it resumed from
    out, _ = copy_run(good_run, tmp_path / "unsaved")
    assert "resume from the newest checkpoint (step 4)" in train_error(
        *SMALL[len(TINY):], f"--data_dir={good_run / 'data'}", f"--out_dir={out}", "--max_steps=20",
        "--max_lr=1e30")


def test_a_state_with_one_non_finite_value_is_not_saved_and_the_error_says_why(tmp_path):
    """One NaN among finite weights, in one tensor among finite ones, is enough to refuse the save, so
    no diverged checkpoint is resumed from."""
    path = checkpoints.path_of(tmp_path, 3)
    state = {"model": {"b": torch.ones(2), "w": torch.tensor([1.0, float("nan")])}, "optimizer": {},
             "config": {}, "step": 3, "loader": {}}
    with pytest.raises(UserError, match=rf"^the weights or optimizer state hold non-finite values at step 3, so "
                                        rf"{path} was not saved and the last checkpoint is kept: the run "
                                        rf"diverged; lower --max_lr or --grad_clip and resume$"):
        checkpoints.save(path, state)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_changed_in_a_tensors_shape_dtype_or_name_or_in_a_value_fails_its_checksum(tmp_path):
    """The checksum covers each tensor's dtype and shape, not only its bytes, so a reshaped or
    reinterpreted tensor with the same bytes is damage, not a checkpoint to resume; and each key, so
    a tensor under another name is too; and every value that is not a tensor (the step here), in
    lists too (the loader's shards)."""
    path = checkpoints.path_of(tmp_path, 1)
    checkpoints.save(path, {"model": {"w": torch.zeros(4)}, "optimizer": {}, "config": {}, "step": 1,
                            "loader": {"shards": [["a_train.bin", 100]]}})
    for change in (lambda state: state["model"].update(w=state["model"]["w"].view(2, 2)),
                   lambda state: state["model"].update(w=state["model"]["w"].view(torch.int32)),
                   lambda state: state["model"].update(v=state["model"].pop("w")),
                   lambda state: state.update(step=2),
                   lambda state: state["loader"].update(shards=[["a_train.bin", 99]])):
        state = torch.load(path, weights_only=True)
        change(state)
        torch.save(state, tmp_path / "changed.pt")
        with pytest.raises(checkpoints.Unloadable, match="^its contents do not match its checksum"):
            checkpoints.load(tmp_path / "changed.pt")


def test_a_checkpoint_set_aside_at_a_step_set_aside_before_takes_the_next_free_name(tmp_path):
    """A damaged checkpoint goes to the first of .damaged, .damaged2, .damaged3 ... not taken, so
    none set aside before is overwritten; the one before it is resumed from."""
    checkpoints.save(checkpoints.path_of(tmp_path, 1),
                     {"model": {}, "optimizer": {}, "config": {}, "step": 1, "loader": {}})
    bad = checkpoints.path_of(tmp_path, 2)
    for suffix in (".damaged", ".damaged2"):
        bad.with_name(bad.name + suffix).write_text("set aside before")
    bad.write_bytes(b"not a checkpoint")
    warnings = []
    path, state = checkpoints.newest_loadable(tmp_path, warnings.append)
    assert path == checkpoints.path_of(tmp_path, 1) and state["step"] == 1
    assert bad.with_name(bad.name + ".damaged3").read_bytes() == b"not a checkpoint"
    assert warnings[0].startswith(f"warning: cannot load checkpoint {bad} (")
    assert warnings[1:] == [f"warning: set {bad} aside as {bad.name}.damaged3"]
    assert [bad.with_name(bad.name + s).read_text() for s in (".damaged", ".damaged2")] == [
        "set aside before"] * 2


def test_a_damaged_checkpoint_that_cannot_be_set_aside_is_named_and_the_one_before_resumed(tmp_path,
                                                                                          monkeypatch):
    """A rename refused (a read-only out_dir) is a warning: the run still resumes from the good one."""
    checkpoints.save(checkpoints.path_of(tmp_path, 1),
                     {"model": {}, "optimizer": {}, "config": {}, "step": 1, "loader": {}})
    bad = checkpoints.path_of(tmp_path, 2)
    bad.write_bytes(b"not a checkpoint")

    def refused(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refused)
    warnings = []
    path, state = checkpoints.newest_loadable(tmp_path, warnings.append)
    assert path == checkpoints.path_of(tmp_path, 1) and state["step"] == 1
    assert warnings[-1] == f"warning: cannot rename {bad} (Permission denied): remove it by hand"
    assert bad.read_bytes() == b"not a checkpoint"


def test_when_no_checkpoint_loads_the_error_gives_the_oldest_ones_reason_and_renames_none(tmp_path):
    """The oldest is the last tried, so its reason is the one the run ends on."""
    torch.save({"model": {}}, checkpoints.path_of(tmp_path, 1))
    checkpoints.path_of(tmp_path, 2).write_bytes(b"not a checkpoint")
    oldest = "not a train_gpt2.py checkpoint: no optimizer, config, step, loader, sha256"
    with pytest.raises(UserError, match=rf"^no checkpoint in {tmp_path} can be loaded \(the oldest: {oldest}\); "
                                        rf"move the ckpt_\*\.pt files out of it to start over there, or "
                                        rf"pass another --out_dir$"):
        checkpoints.newest_loadable(tmp_path, lambda line: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_0000001.pt", "ckpt_0000002.pt"]


def test_overwrite_keeps_a_first_checkpoint_that_has_an_old_ones_name(tmp_path):
    """With overwrite, the first save deletes the old checkpoints and log but not the new checkpoint,
    though it takes the name of an old one (the same step): it is the only one left, and loads."""
    state = {"model": {}, "optimizer": {}, "config": {}, "step": 1, "loader": {}}
    old = [checkpoints.path_of(tmp_path, step) for step in (1, 2)]
    for path in old:
        checkpoints.save(path, {**state, "step": 0})
    (tmp_path / "log.jsonl").write_text('{"step": 2, "loss": 3.0}\n')
    out = checkpoints.OutDir(tmp_path)
    out.start(0, None, old)
    assert out.save(1, state, keep=0) == old[0]
    assert checkpoints.listed(tmp_path) == [old[0]] and checkpoints.load(old[0])["step"] == 1
    assert not (tmp_path / "log.jsonl.old").exists()
    out.lock.close()


@pytest.mark.compat
def test_a_damaged_or_foreign_newest_checkpoint_is_set_aside_not_kept_as_newest(good_run, tmp_path):
    """1 KB overwritten in the tensor data of the newest checkpoint (it loads, but fails its
    checksum), and a newer zip that is not a checkpoint of ours: both are named, set aside as
    .damaged, and the run resumes from the good one before them and keeps it (keep_checkpoints=1).
    A damaged line in log.jsonl is dropped, not a traceback."""
    out, before = copy_run(good_run, tmp_path)
    data = bytearray(before["ckpt_0000004.pt"])
    data[len(data) // 2:len(data) // 2 + 1024] = os.urandom(1024)
    (out / "ckpt_0000004.pt").write_bytes(bytes(data))
    torch.save({"model": {}}, out / "ckpt_0000009.pt")
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 1, "loss": 5.0, "lr"\n{"no step": 1}\n')
    proc = run_training([*SMALL, f"--data_dir={good_run / 'data'}", f"--out_dir={out}", "--max_steps=6",
                         "--checkpoint_interval=1", "--keep_checkpoints=1"])
    assert (f"cannot load checkpoint {out}/ckpt_0000009.pt (not a train_gpt2.py checkpoint: no "
            f"optimizer, config, step, loader, sha256)") in proc.stdout
    assert (f"cannot load checkpoint {out}/ckpt_0000004.pt (its contents do not match its checksum: "
            f"the file is corrupt)") in proc.stdout
    assert f"resumed from {out}/ckpt_0000002.pt at step 2" in proc.stdout
    assert sorted(p.name for p in out.glob("ckpt_*")) == [
        "ckpt_0000002.pt", "ckpt_0000004.pt.damaged", "ckpt_0000006.pt", "ckpt_0000009.pt.damaged"]
    assert (out / "ckpt_0000002.pt").read_bytes() == before["ckpt_0000002.pt"]
    assert [s["step"] for s in read_log(out)[0]] == list(range(1, 7))


def test_only_the_runs_own_checkpoint_names_are_resumed_from_pruned_or_counted(good_run, tmp_path):
    """A user's ckpt_best.pt (a good checkpoint, of step 2), a ckpt_abc.pt, a notes.tmp and a
    directory with a checkpoint's name sit beside the run's checkpoints: the run resumes from its
    own newest, prunes only its own (and the temp files of killed writes), and leaves the others as they
    were. Steps past the zero padding sort by number. Good checkpoints named with other digits than
    path_of's 7 (ckpt_12.pt, ckpt_00000001.pt) are the user's too: neither resumed from nor pruned."""
    out, before = copy_run(good_run, tmp_path)
    (out / "ckpt_best.pt").write_bytes(before["ckpt_0000002.pt"])
    # were they the run's, the first would be its newest and the second pruned as its oldest
    (out / "ckpt_12.pt").write_bytes(before["ckpt_0000002.pt"])
    (out / "ckpt_00000001.pt").write_bytes(before["ckpt_0000002.pt"])
    (out / "ckpt_abc.pt").write_bytes(b"notes")
    (out / "ckpt_0000009.pt").mkdir()
    (out / "notes.tmp").write_text("mine")  # a temp name, but not one of a killed save's
    (out / "ckpt_0000003.pt.tmp").write_bytes(b"cut")  # a killed save's
    (out / "wandb_run_id.tmp").write_text("run")  # a killed write's, which this run does not redo
    proc = run_training([*SMALL, f"--data_dir={good_run / 'data'}", f"--out_dir={out}", "--max_steps=6",
                         "--checkpoint_interval=1", "--keep_checkpoints=1"])
    assert f"resumed from {out}/ckpt_0000004.pt at step 4" in proc.stdout
    assert (out / "notes.tmp").read_text() == "mine" and not (out / "ckpt_0000003.pt.tmp").exists()
    assert not (out / "wandb_run_id.tmp").exists()
    assert sorted(p.name for p in out.glob("ckpt_*")) == [
        "ckpt_00000001.pt", "ckpt_0000004.pt", "ckpt_0000006.pt", "ckpt_0000009.pt", "ckpt_12.pt",
        "ckpt_abc.pt", "ckpt_best.pt"]
    assert all((out / name).read_bytes() == before["ckpt_0000002.pt"]
               for name in ("ckpt_best.pt", "ckpt_12.pt", "ckpt_00000001.pt"))
    assert (out / "ckpt_abc.pt").read_bytes() == b"notes" and (out / "ckpt_0000009.pt").is_dir()
    many = tmp_path / "many"
    many.mkdir()
    for step in (10_000_000, 9_999_999):
        checkpoints.path_of(many, step).touch()
    assert [p.name for p in checkpoints.listed(many)] == ["ckpt_9999999.pt", "ckpt_10000000.pt"]


# a checkpoint of the current format (checkpoints.VERSION), written by this model at FORMAT_ARGS
FORMAT_CHECKPOINT = ROOT / "tests" / "data" / f"ckpt_v{checkpoints.VERSION}.pt"
FORMAT_ARGS = ["--n_layer=1", "--n_head=1", "--n_embd=8", "--block_size=8", "--vocab_size=64",
               "--micro_batch_size=1", "--seq_len=8", "--total_batch_size=8", "--warmup_steps=0",
               "--eval_interval=0", "--sample_interval=0", "--checkpoint_interval=1", "--compile=false",
               "--data_order=sequential"]


def test_a_checkpoint_of_this_format_saved_earlier_resumes(tmp_path):
    """tests/data/ckpt_v{VERSION}.pt, saved by an earlier commit of this format, resumes here: a format
    changed without raising checkpoints.VERSION, or VERSION raised with no change, fails here. After a
    change of format, raise VERSION and make the file anew, as docs/checkpoints.md says."""
    make_shards(tmp_path / "data", n_train=400, n_val=200, vocab=64)
    args = [*FORMAT_ARGS, f"--data_dir={tmp_path / 'data'}"]
    if os.environ.get("FORMAT_CHECKPOINT") == "write":
        run_training([*args, f"--out_dir={tmp_path / 'made'}", "--max_steps=1"])
        shutil.copy(tmp_path / "made" / "ckpt_0000001.pt", FORMAT_CHECKPOINT)
    args.append(f"--out_dir={tmp_path / 'out'}")
    (tmp_path / "out").mkdir()
    shutil.copy(FORMAT_CHECKPOINT, tmp_path / "out" / "ckpt_0000001.pt")
    out = run_training([*args, "--max_steps=2", "--allow_new_data=true"]).stdout
    assert "resumed from" in out and [s["step"] for s in read_log(tmp_path / "out")[0]] == [2]


def test_a_resume_names_the_schedule_it_changes_and_a_warmup_past_max_steps_is_warned(good_run, tmp_path):
    """Raising max_steps on a finished run, as its "complete" line advises, reshapes the cosine:
    one line names what changed and the next lr, before and after."""
    from train_gpt2 import get_lr, load_config
    out, _ = copy_run(good_run, tmp_path)
    args = [*SMALL, f"--data_dir={good_run / 'data'}", f"--out_dir={out}", "--max_steps=8",
            "--warmup_steps=8"]
    proc = run_training(args)
    before, after = (get_lr(4, load_config(a)) for a in ([*SMALL, "--max_steps=4"], args))
    assert (f"the schedule changes from the checkpoint's: max_steps 4 -> 8, warmup_steps 2 -> 8; "
            f"the lr of step 5 is {after:.4e}, not {before:.4e}\n") in proc.stdout
    assert ("warning: warmup_steps=8 is not below max_steps=8, so the lr never decays; lower "
            "--warmup_steps\n") in proc.stdout
    assert [s["lr"] for s in read_log(out)[0]][4] == pytest.approx(after)


def test_a_step_saved_before_its_evaluation_is_evaluated_by_the_resumed_run_and_only_then(good_run, tmp_path):
    """A checkpoint whose step's evaluation did not run (evaluated=False, as a stop during it saves)
    has it run first by the resumed run, so the log holds that step's val loss; one whose evaluation
    ran (evaluated=True) is not evaluated twice."""
    for evaluated, val_steps in ((False, [4, 5]), (True, [5])):
        out, _ = copy_run(good_run, tmp_path / str(evaluated))
        rewrite_checkpoint(out / "ckpt_0000004.pt", lambda state: state.update(evaluated=evaluated))
        run_training([*SMALL, f"--data_dir={good_run / 'data'}", f"--out_dir={out}", "--max_steps=5",
                      "--eval_interval=4"])
        assert [e["step"] for e in read_log(out)[1]] == val_steps, evaluated


def test_one_run_per_out_dir_and_a_rank_0_error_is_one_line_under_torchrun(good_run, tmp_path):
    """A run holds an OS lock on its out_dir: a second run refuses in one line naming it. Under
    torchrun, an error that rank 0 alone finds (out_dir is a file) or that every rank finds (the
    config, a shard's token ids that rank 1 alone reads) is one line from rank 0, and no rank prints a
    traceback."""
    import fcntl
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.write("pid 12345 on elsewhere\n")
        holder.flush()
        err = train_error(f"--data_dir={good_run / 'data'}", f"--out_dir={out}")
    assert f"out_dir {out} is in use by another run (pid 12345 on elsewhere); wait for it" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    ids = tmp_path / "ids"  # its second shard is scanned by rank 1 alone: the maximum must reach rank 0
    make_shards(ids)
    write_shard(ids / "tiny_train_000002.bin", np.full(2000, 50256))
    for bad, message in ([f"--out_dir={blocker}/out"], f"out_dir {blocker}/out is a file or lies inside "
                         f"one: pass a directory as --out_dir"), \
                        (["--n_head=3", f"--out_dir={out}"], "n_embd=32 is not divisible by n_head=3"), \
                        ([f"--data_dir={ids}", f"--out_dir={out}"], f"shard {ids}/tiny_train_000002.bin holds "
                         f"token id 50256, beyond vocab_size=512: it was made with another tokenizer; remake "
                         f"it with prepare_data.py or raise vocab_size"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node=2", "train_gpt2.py", *TINY,
                               f"--data_dir={good_run / 'data'}", *bad],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        lines = proc.stderr.splitlines()
        assert {line.split("error: ", 1)[1] for line in lines if "error:" in line} == {message}
        assert lines[-2] == f"  traceback : train_gpt2.py: error: {message}"  # the summary's root cause
        assert 'train_gpt2.py", line' not in proc.stderr  # no worker's traceback; torchrun's is its own


def test_overwrite_deletes_nothing_before_the_run_saves_and_two_datasets_are_refused(good_run, tmp_path):
    """resume=never with overwrite over good checkpoints, on shards of another tokenizer: refused
    before any step with the checkpoints and log untouched. A data_dir holding two datasets is
    refused unless --dataset names one; with it the run trains, and the old checkpoints and log go
    once its first checkpoint is saved. An empty sample_prompt starts from <|endoftext|>, which
    needs GPT-2's vocabulary (refused in one line below it)."""
    out, before = copy_run(good_run, tmp_path)
    log_before = (out / "log.jsonl").read_text()
    data = tmp_path / "data"
    make_shards(data)
    write_shard(data / "tiny_train_000002.bin", np.full(100, 50256))  # GPT-2 ids, vocab_size 512
    never = [*SMALL[len(TINY):], "--resume=never", "--overwrite=true", f"--out_dir={out}"]
    err = train_error(*never, f"--data_dir={data}")
    assert "tiny_train_000002.bin holds token id 50256, beyond vocab_size=512" in err
    assert {p.name: p.read_bytes() for p in out.glob("ckpt_*.pt")} == before
    assert (out / "log.jsonl").read_text() == log_before

    make_shards(data)  # good_run's shards again, which its checkpoints were trained on
    make_shards(data / "other")
    for path in (data / "other").iterdir():
        path.rename(data / path.name.replace("tiny", "other"))
    err = train_error(*never, f"--data_dir={data}")
    assert f"{data} holds the shards of 2 datasets (other, tiny): pass --dataset=NAME" in err
    # a run that fails after it began (diverged) leaves the old log aside, which the next run with
    # resume=auto puts back, resuming from the old checkpoints, and keeps the diverged run's beside
    err = train_error(*never, f"--data_dir={data}", "--dataset=tiny", "--max_lr=1e30", "--max_steps=20")
    assert "the loss or gradient norm was not finite in steps 2-4" in err
    assert {p.name: p.read_bytes() for p in out.glob("ckpt_*.pt")} == before
    assert (out / "log.jsonl.old").read_text() == log_before
    run_training([*SMALL, f"--data_dir={data}", "--dataset=tiny", f"--out_dir={out}", "--max_steps=5"])
    assert [s["step"] for s in read_log(out)[0]] == list(range(1, 6)) and not (out / "log.jsonl.old").exists()
    assert [r["step"] for r in runs.read_log(out / "log.1.jsonl")] == [1, 2, 3, 4]  # the diverged run's

    sample = ["--sample_interval=1", "--sample_prompt=", "--sample_tokens=4"]
    err = train_error(*never, f"--data_dir={data}", "--dataset=tiny", *sample)
    assert "sample_prompt '' has GPT-2 token id 50256, beyond vocab_size=512" in err
    proc = run_training([*SMALL, *never[len(SMALL) - len(TINY):], f"--data_dir={data}",
                         "--dataset=tiny", "--max_steps=2", "--checkpoint_interval=1",
                         "--vocab_size=50304", *sample])
    assert "sample at step 1: '<|endoftext|>" in proc.stdout
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_0000001.pt", "ckpt_0000002.pt"]
    assert [s["step"] for s in read_log(out)[0]] == [1, 2] and not (out / "log.jsonl.old").exists()


def test_a_rerun_with_no_checkpoint_to_resume_keeps_every_earlier_log_line(good_run, tmp_path):
    """An out_dir whose checkpoints were moved away (or a run killed before its first save, which
    left none): the rerun starts afresh, keeps the earlier log.jsonl whole as log.1.jsonl and the
    next as log.2.jsonl, says so, and read_log and scripts.plot read what is kept."""
    out, _ = copy_run(good_run, tmp_path)
    first = (out / "log.jsonl").read_text()
    for path in out.glob("ckpt_*.pt"):
        path.rename(tmp_path / path.name)
    args = [*SMALL, f"--data_dir={good_run / 'data'}", f"--out_dir={out}", "--checkpoint_interval=0"]
    stdout = run_training([*args, "--max_steps=2"]).stdout
    assert f"kept the records of an earlier run with no checkpoint here as {out / 'log.1.jsonl'}" in stdout
    second = (out / "log.jsonl").read_text()
    for path in out.glob("ckpt_*.pt"):
        path.unlink()  # this test's own run
    run_training([*args, "--max_steps=1"])
    assert (out / "log.1.jsonl").read_text() == first and (out / "log.2.jsonl").read_text() == second
    assert [r["step"] for r in read_log(out)[0]] == [1]
    assert [r["step"] for r in runs.read_log(out / "log.1.jsonl") if "loss" in r] == [1, 2, 3, 4]
    subprocess.run([sys.executable, "-m", "scripts.plot", str(out / "log.1.jsonl"), "--out",
                    str(tmp_path / "kept.png")], cwd=ROOT, check=True, capture_output=True)
    assert (tmp_path / "kept.png").stat().st_size > 0


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_older_checkpoints(good_run, tmp_path):
    """A checkpoint write that fails (here: past a 200 KB file-size limit, EFBIG, as ENOSPC would)
    ends the run in one line; the temp file is gone, the older checkpoints are intact, and the
    rerun without the limit resumes from them."""
    import resource
    out, before = copy_run(good_run, tmp_path)
    args = [*SMALL, f"--data_dir={good_run / 'data'}", f"--out_dir={out}", "--max_steps=6",
            "--checkpoint_interval=2"]
    proc = subprocess.run(
        [sys.executable, "train_gpt2.py", *args], cwd=ROOT, capture_output=True, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"train_gpt2.py: error: cannot save checkpoint {out}/ckpt_0000006.pt: "
                           f"File too large; the older checkpoints are kept: free some space or "
                           f"pass another --out_dir, and rerun to resume\n")
    assert {p.name: p.read_bytes() for p in out.glob("ckpt_*")} == before
    assert not list(out.glob("*.tmp"))
    assert f"resumed from {out}/ckpt_0000004.pt at step 4" in run_training(args).stdout


def test_a_filesystem_without_flock_gets_a_warning_not_a_traceback(tmp_path, monkeypatch, capsys):
    """flock fails with ENOLCK on NFS without lockd (ENOSYS on Lustre mounted noflock): the run
    goes on unlocked and says so."""
    import errno
    import fcntl
    from gpt2_ddp import checkpoints

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    checkpoints.lock(tmp_path / "out").close()
    assert f"warning: cannot lock out_dir {tmp_path / 'out'} (No locks available)" in capsys.readouterr().out


def rewrite_checkpoint(path, change):
    """Saves the checkpoint at `path` again, as checkpoints.save writes it (checksum and format
    version), after change(state) has edited its state in place."""
    from gpt2_ddp import checkpoints
    state = checkpoints.load(path)
    state.pop("version")
    change(state)
    checkpoints.save(path, state)


def test_a_checkpoint_of_an_older_format_is_refused_and_init_from_keeps_its_weights(good_run, tmp_path):
    """A checkpoint without this format's version is refused in one line that names --init_from,
    before anything loads; --init_from of its out_dir starts a new run from its weights."""
    from gpt2_ddp import checkpoints
    out, _ = copy_run(good_run, tmp_path)
    for path in out.glob("ckpt_*.pt"):
        state = torch.load(path, weights_only=True)  # read whole: the file is rewritten below
        del state["version"], state["sha256"]
        state["sha256"] = checkpoints.sha256(state)
        torch.save(state, path)
    err = train_error(*SMALL[len(TINY):], f"--data_dir={good_run / 'data'}", f"--out_dir={out}",
                      "--max_steps=6")
    assert err == (f"train_gpt2.py: error: checkpoint {out}/ckpt_0000004.pt is of an older format "
                   f"(version none) than this train_gpt2.py's ({checkpoints.VERSION}): "
                   f"start a new run from its weights with --out_dir=NEW_DIR --init_from={out}\n")
    newer = out / "ckpt_0000005.pt"
    state = torch.load(out / "ckpt_0000004.pt", weights_only=True)
    del state["sha256"]
    state.update(step=5, version=checkpoints.VERSION + 1)
    state["sha256"] = checkpoints.sha256(state)
    torch.save(state, newer)
    assert train_error(*SMALL[len(TINY):], f"--data_dir={good_run / 'data'}", f"--out_dir={out}",
                       "--max_steps=6").endswith(
        f"is of a newer format (version {checkpoints.VERSION + 1}) than this train_gpt2.py's "
        f"({checkpoints.VERSION}): update this repository (git pull) to resume it\n")
    newer.unlink()
    new = tmp_path / "new"
    stdout = run_training([*SMALL, f"--data_dir={good_run / 'data'}", f"--out_dir={new}",
                           f"--init_from={out}", "--max_steps=1", "--max_lr=0", "--min_lr=0"]).stdout
    assert f"init_from {out}: 2 layers, n_embd 32\n" in stdout
    old = torch.load(out / "ckpt_0000004.pt", weights_only=True)["model"]
    assert all(torch.equal(v, old[k]) for k, v in checkpoints.load(new / "ckpt_0000001.pt")["model"].items())


def test_train_shards_that_changed_under_the_checkpoint_are_refused_unless_allowed(good_run, tmp_path):
    """Shards made again (another size) or added under a run's data_dir: its saved position would
    point into other tokens, so the resume is refused in one line naming --init_from and
    --allow_new_data."""
    out, _ = copy_run(good_run, tmp_path)
    data = tmp_path / "data"
    shutil.copytree(good_run / "data", data)
    args = [*SMALL[len(TINY):], f"--data_dir={data}", f"--out_dir={out}", "--max_steps=6"]
    write_shard(data / "tiny_train_000003.bin", np.arange(1500) % 512)  # one more shard, after the others
    assert "(as [name, tokens]: None then, ['tiny_train_000003.bin', 1500] now)" in train_error(*args)
    (data / "tiny_train_000003.bin").unlink()
    write_shard(data / "tiny_train_000002.bin", np.arange(1500) % 512)
    err = train_error(*args)
    assert err == (f"train_gpt2.py: error: the train shards in {data} are not those checkpoint "
                   f"{out}/ckpt_0000004.pt was trained on (as [name, tokens]: ['tiny_train_000002.bin', "
                   f"2000] then, ['tiny_train_000002.bin', 1500] now): start a new run from its weights "
                   f"with --out_dir=NEW_DIR --init_from={out}, or pass --allow_new_data=true to go on "
                   f"at the same token offset in these\n")
    assert "resumed from" in run_training([*TINY, *args, "--allow_new_data=true"]).stdout


def test_a_checkpoint_of_another_architecture_is_one_line_naming_its_keys(good_run, tmp_path):
    """A model whose state keys or shapes differ from the checkpoint's without a config key to
    say so (a fork that swapped learned positions for RoPE, say) is refused in one line naming
    the keys, before anything loads. The checkpoint's first key is renamed, whatever the model's
    layout."""
    out, _ = copy_run(good_run, tmp_path)
    renamed = []

    def rename_a_key(state):
        key = next(iter(state["model"]))
        renamed.extend([key, f"{key}.renamed"])
        state["model"][renamed[1]] = state["model"].pop(key)
    rewrite_checkpoint(out / "ckpt_0000004.pt", rename_a_key)
    err = train_error(*SMALL[len(TINY):], f"--data_dir={good_run / 'data'}", f"--out_dir={out}",
                      "--max_steps=6")
    assert err.startswith(f"train_gpt2.py: error: checkpoint {out}/ckpt_0000004.pt is of another "
                          f"model: missing ['{renamed[0]}']; unexpected ['{renamed[1]}']; to train "
                          f"this model") and err.count("\n") == 1


# --- what changes under a run ---------------------------------------------------------------------

def test_a_shard_that_changes_under_a_run_stops_it_saved_and_untrained_on_the_change(tmp_path):
    """prepare_data --overwrite under a training run: whichever rank reads a changed train shard
    first, every rank stops at the last step, saves it with the loader before the step that met
    the change, and says in one line which shard changed. A changed val shard stops an evaluation
    on every rank the same way (Stopped, then the line)."""
    from train_gpt2 import DataLoader, GPT, Config, evaluate
    from gpt2_ddp.collectives import Stopped
    data, out = tmp_path / "data", tmp_path / "out"
    make_shards(data)
    proc = torchrun([*SMALL, f"--data_dir={data}", f"--out_dir={out}", "--max_steps=100000"], 2)
    try:
        wait_for_step(out, 3, proc)
        for path in data.glob("tiny_train_*.bin"):
            write_shard(path, np.arange(3000) % 512)  # as prepare_data writes: a new file, renamed in
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.terminate()  # torchrun passes it on to the workers
        proc.wait(60)
    steps, _ = read_log(out)
    last = steps[-1]["step"]
    errors = list({line.split("error: ", 1)[1] for line in output.splitlines() if "py: error:" in line})
    assert len(errors) == 1 and re.search(
        rf"^shard {data}/tiny_train_00000[12].bin changed while this run read it \(replaced or "
        rf"rewritten\): the run stopped at its last step, saved, untrained on the change", errors[0])
    assert 'train_gpt2.py", line' not in output
    state = checkpoints.load(out / f"ckpt_{last:07d}.pt")
    assert [p.name for p in out.glob("ckpt_*.pt")] == [f"ckpt_{last:07d}.pt"]
    assert state["loader"]["tokens"] == last * 64  # the step that met the change is not counted

    loader = DataLoader(data, "val", 2, 16, 0, 1, torch.device("cpu"))
    write_shard(data / "tiny_val_000000.bin", np.arange(1000) % 512)
    model = GPT(Config(**{a[2:].split("=")[0]: int(a.split("=")[1]) for a in TINY[:5]}))
    with pytest.raises(Stopped):
        evaluate(model, loader, 4, torch.autocast("cpu", enabled=False), torch.float32)
    with pytest.raises(UserError, match=f"^shard {data}/tiny_val_000000.bin changed while this run"):
        loader.raise_changed()


def test_a_run_whose_out_dir_is_deleted_stops_at_its_next_save(good_run, tmp_path):
    """out_dir deleted under a run, and a new run started in the same out_dir: the first run's
    log records go nowhere and its next save stops it in one line, so it never writes into the
    new run's out_dir."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "train_gpt2.py", *SMALL, f"--data_dir={good_run / 'data'}",
                             f"--out_dir={out}", "--max_steps=100000", "--checkpoint_interval=6"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(out, 2, proc)
        shutil.rmtree(out)
        second = checkpoints.OutDir(out)  # the new run takes the new out_dir's lock
        second.log({"step": 0, "val_loss": 1.0})
        _, err = proc.communicate(timeout=60)
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 1
    assert err == (f"train_gpt2.py: error: out_dir {out} was deleted or replaced while this run trained, "
                   f"so step 6 is not saved there, where another run may be writing: rerun with "
                   f"another --out_dir\n")
    assert (out / "log.jsonl").read_text() == '{"step": 0, "val_loss": 1.0}\n'
    assert not list(out.glob("ckpt_*"))


def test_overwrite_that_cannot_delete_an_old_checkpoint_refuses_before_training(good_run, tmp_path):
    """An immutable old checkpoint (chattr +i) would outlive --overwrite and be resumed as this
    run's newest: refused before any step, with every checkpoint and the log as they were."""
    out, before = copy_run(good_run, tmp_path)
    stuck = out / "ckpt_0000004.pt"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root and a filesystem that supports it")
    try:
        err = train_error(*SMALL[len(TINY):], f"--data_dir={good_run / 'data'}", f"--out_dir={out}",
                          "--resume=never", "--overwrite=true")
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert err == (f"train_gpt2.py: error: --overwrite cannot delete {stuck} (Operation not "
                   f"permitted): delete it by hand, or pass another --out_dir\n")
    assert {p.name: p.read_bytes() for p in out.glob("ckpt_*")} == before


def test_an_out_dir_is_held_while_its_lock_is_the_one_taken(tmp_path):
    out = checkpoints.OutDir(tmp_path / "out")
    assert out.holds_out_dir()
    (tmp_path / "out" / ".lock").unlink()
    assert not out.holds_out_dir()
    checkpoints.OutDir(tmp_path / "out")  # a run since: its lock is another file of the same name
    assert not out.holds_out_dir()


def test_a_log_that_cannot_be_rewritten_at_the_start_is_one_line(tmp_path):
    out = checkpoints.OutDir(tmp_path / "out")
    (tmp_path / "out" / "log.jsonl").mkdir()
    with pytest.raises(UserError, match=f"^cannot write to out_dir {tmp_path / 'out'}: Is a directory; "
                                        f"pass a writable --out_dir$"):
        out.start(0, None, [])


def test_an_old_checkpoint_that_cannot_be_deleted_is_a_warning_not_the_runs_end(tmp_path, capsys):
    stuck = tmp_path / "ckpt_0000001.pt"
    stuck.mkdir()
    checkpoints.remove(stuck)
    checkpoints.remove(tmp_path / "ckpt_0000002.pt")  # already gone: nothing to say
    assert capsys.readouterr().out == f"warning: cannot delete {stuck}: Is a directory\n"
    assert stuck.is_dir()


def test_a_full_disk_leaves_no_torn_line_in_the_log(tmp_path, capsys):
    """An append cut short by a full disk (here: a file-size limit, EFBIG, as ENOSPC) is cut off
    again with a warning; the next append after space is freed starts on its own line."""
    import resource
    out = checkpoints.OutDir(tmp_path / "out")
    out.log({"step": 1, "loss": 1.0})
    size = out.log_path.stat().st_size
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, limit[1]))
        out.log({"step": 2, "loss": 2.0, "dt_ms": 75.23})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    out.log({"step": 3, "loss": 3.0})
    assert [json.loads(line)["step"] for line in out.log_path.read_text().splitlines()] == [1, 3]
    # the limit lets part of the line through, as a full disk does: a short write
    assert capsys.readouterr().out == f"warning: cannot append to {out.log_path}: No space left on device\n"


def test_a_missing_compiler_is_one_line_naming_compile_false(good_run, tmp_path):
    env = dict(os.environ, CXX="/bin/false", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.run([sys.executable, "train_gpt2.py", *SMALL, "--compile=true",
                           f"--data_dir={good_run / 'data'}", f"--out_dir={tmp_path / 'out'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("train_gpt2.py: error: torch.compile found no working C++ compiler")
    assert proc.stderr.endswith("install one (g++), set CXX to one, or pass --compile=false\n")


def test_paths_are_never_empty_and_expand_a_tilde(tmp_path, monkeypatch):
    from train_gpt2 import load_config
    assert "config key 'out_dir' must be a path, not empty, got ''" in train_error("--out_dir=", process=True)
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(["--out_dir=~/runs/x", "--data_dir=~/data", "--init_from=~/gone"])
    assert (config.out_dir, config.data_dir, config.init_from) == (
        f"{tmp_path}/runs/x", f"{tmp_path}/data", f"{tmp_path}/gone")


def test_a_fresh_start_over_an_empty_log_keeps_no_copy_of_it(tmp_path):
    (tmp_path / "log.jsonl").write_text("")  # a run that stopped before its first record
    out = checkpoints.OutDir(tmp_path)
    out.start(0, None, [])
    out.lock.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "log.jsonl"]


def test_a_finetune_resumes_from_its_own_checkpoint_when_its_init_from_is_gone(good_run, tmp_path):
    """A run started from another run's weights (init_from) saves its own checkpoints: once that
    source is deleted, the same command resumes, saying that init_from is not used on a resume; from
    the checkpoint before its newest when that one is damaged, as any resume does."""
    source, _ = copy_run(good_run, tmp_path)
    tune = tmp_path / "tune"
    shape = ("--n_layer=", "--n_head=", "--n_embd=", "--block_size=", "--vocab_size=")
    args = [*(a for a in SMALL if not a.startswith(shape)), f"--data_dir={good_run / 'data'}",  # init_from's
            f"--init_from={source}", f"--out_dir={tune}", "--checkpoint_interval=1"]
    first = run_training([*args, "--max_steps=2"]).stdout
    assert f"init_from {source}: 2 layers" in first and "not used on a resume" not in first
    shutil.rmtree(source)
    (tune / "ckpt_0000002.pt").write_bytes(b"")
    second = run_training([*args, "--max_steps=3"]).stdout
    assert f"init_from={source} is not used on a resume: {tune}'s checkpoint holds the model\n" in second
    assert "init_from " not in second.replace(f"init_from={source} is not used", "")
    assert f"resumed from {tune}/ckpt_0000001.pt at step 1" in second
    assert [r["step"] for r in read_log(tune)[0]] == [1, 2, 3]
    for path in tune.glob("ckpt_*.pt"):
        path.write_bytes(b"")
    with pytest.raises(UserError, match=f"^no checkpoint in {tune} can be loaded "):
        train_here([*args, "--max_steps=4"])


def test_a_second_lock_on_a_locked_out_dir_is_refused_until_the_first_is_released(tmp_path):
    """checkpoints.lock takes an exclusive lock: a second one on the same out_dir, even from this
    process (flock locks belong to each open file), is refused in one line naming the holder, with
    its file closed, and taken once the first is released; the one who takes it then is the only
    holder named."""
    out = tmp_path / "out"
    refused = pytest.raises(UserError, match="^" + re.escape(
        f"out_dir {out} is in use by another run (pid {os.getpid()} on {socket.gethostname()}); "
        f"wait for it to end, or pass another --out_dir") + "$")
    for _ in range(2):
        first = checkpoints.lock(out)
        open_files = len(os.listdir("/dev/fd"))
        with refused:  # its traceback keeps the refused call's frame, and an unclosed file in it, alive
            checkpoints.lock(out)
        assert len(os.listdir("/dev/fd")) == open_files
        first.close()


def test_an_atomic_write_syncs_the_new_file_before_the_rename_and_its_directory_after(tmp_path,
                                                                                     monkeypatch):
    """A kill or power loss leaves the old file or the new one: the new bytes reach the disk before
    the rename makes them the file, and the rename once its directory is synced."""
    path, synced, fsync = tmp_path / "state.pt", [], os.fsync
    path.write_bytes(b"old")

    def recording(fd):
        kind = "directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        synced.append((kind, path.read_bytes()))
        fsync(fd)
    monkeypatch.setattr(os, "fsync", recording)
    atomic_write(path, lambda f: f.write(b"new"))
    assert synced == [("file", b"old"), ("directory", b"new")]
