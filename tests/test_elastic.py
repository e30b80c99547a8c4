"""Elastic runs: two agents of scripts/train_elastic.sh on this machine stand for two nodes, and one
of them is lost mid-run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY, free_port, make_shards, read_log, run_training

STEPS = 20
# exact_reduction: world size 2, then 1 after the resume, give the bits of a one-process run
RUN = [*TINY, "--total_batch_size=64", f"--max_steps={STEPS}", "--checkpoint_interval=5",
       "--eval_interval=10", "--exact_reduction=true"]
# seconds where torchrun's defaults take up to minutes: an agent missing 3 heartbeats of 1 s is
# lost, and a round of fewer agents than the maximum waits last_call_timeout for more
RDZV_CONF = ("join_timeout=30,last_call_timeout=1,close_timeout=1,keep_alive_interval=1,"
             "keep_alive_max_attempt=3")


def launch_agent(args, port, is_host, log_path):
    """One agent of scripts/train_elastic.sh with one worker, in a session of its own; is_host: it
    holds the rendezvous (as the node at RDZV_HOST does)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RDZV_HOST="127.0.0.1", RDZV_PORT=str(port), NPROC="1",
               RDZV_ID=f"test_{port}", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               TORCHRUN_ARGS=f"--rdzv-conf={RDZV_CONF},is_host={int(is_host)} --monitor-interval=0.1")
    with open(log_path, "w") as log:
        return subprocess.Popen(["bash", "scripts/train_elastic.sh", *args], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def processes(pid):
    """pid and its descendants, parents first; torchrun starts each worker in a session of its own."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # already gone
        return []
    return [pid] + [p for child in children for p in processes(int(child))]


def kill_node(proc):
    """SIGKILLs an agent that still runs and its workers at once, as a node that loses power."""
    for pid in processes(proc.pid) if proc.poll() is None else []:  # a pid reaped may be reused
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_for_step(out_dir, step, proc, timeout=60):
    """Blocks until log.jsonl has a train record of `step` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        log = Path(out_dir) / "log.jsonl"
        lines = log.read_text().splitlines() if log.exists() else []
        if any(json.loads(line).get("step", -1) >= step for line in lines if line.endswith("}")):
            return
        time.sleep(0.01)
    raise TimeoutError(f"step {step} not reached in {timeout} s")


@pytest.mark.compat
def test_a_lost_node_restarts_the_survivor_at_world_size_1_which_ends_the_run_bitwise(tmp_path):
    """Two agents of scripts/train_elastic.sh (--nnodes=1:2, c10d rendezvous) train at world size 2,
    and one is SIGKILLed with its worker after a checkpoint, as a lost node. The survivor's
    worker says so in one line, naming the step and that checkpoint, with no traceback; torchrun
    restarts it at world size 1, it resumes from that checkpoint, and the run logs exactly (bitwise)
    the losses and val losses of an uninterrupted one-process run."""
    make_shards(tmp_path / "data")
    out = tmp_path / "elastic"
    args = [*RUN, f"--data_dir={tmp_path / 'data'}", f"--out_dir={out}"]
    port = free_port()
    survivor = launch_agent(args, port, True, tmp_path / "survivor.log")
    lost = launch_agent(args, port, False, tmp_path / "lost.log")
    try:
        wait_for_step(out, 7, survivor)
        kill_node(lost)
        # the reference trains here while the survivor waits to restart
        run_training([*RUN, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'reference'}"])
        survivor.wait(timeout=60)
    finally:
        for proc in (survivor, lost):
            kill_node(proc)

    output = (tmp_path / "survivor.log").read_text()
    assert survivor.returncode == 0, output
    assert "world_size 2 |" in output + (tmp_path / "lost.log").read_text()  # from rank 0, either
    lost_lines = [line for line in output.splitlines() if "a peer process was lost" in line]
    assert len(lost_lines) == 1, output
    match = re.fullmatch(r"train_gpt2.py: error: rank [01]: a peer process was lost after step (\d+) "
                         r"\([^()]*Connection (?:closed|reset) by peer[^()]*\); torchrun restarts the "
                         r"workers, which resume from the last checkpoint \(step (\d+)\)", lost_lines[0])
    assert match, lost_lines[0]
    lost_after, saved = int(match[1]), int(match[2])
    assert 5 <= saved <= lost_after < STEPS and saved % 5 == 0
    assert f"resumed from {out / f'ckpt_{saved:07d}.pt'} at step {saved}" in output
    assert "world_size 1 |" in output
    rest = output.replace(lost_lines[0], "")
    assert "Traceback" not in rest and "by peer" not in rest, output  # gloo's error, only in the line

    steps, evals = read_log(out)
    ref_steps, ref_evals = read_log(tmp_path / "reference")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))  # replayed steps logged once
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps]
    assert [e["val_loss"] for e in evals] == [e["val_loss"] for e in ref_evals]
