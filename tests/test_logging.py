"""wandb and TensorBoard beside log.jsonl: the same numbers, across a resume, from rank 0 alone,
and one line when their package is missing; the peak_flops key."""

import dataclasses
import fcntl
import gc
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
import types

import numpy as np
import pytest
import torch

from conftest import (ROOT, TINY, expected_mfu, record_host_reads, recording, run_training, train_here,
                      write_hellaswag)
from gpt2_ddp import runs
from gpt2_ddp.metrics import Waiting, Wandb
from train_gpt2 import GPT, UserError, load_config
import train_gpt2


def fake_wandb(calls, init_error=None):
    """A stand-in for the wandb package that appends each call to `calls`: ("init", kwargs),
    ("define_metric", name, step_metric), ("log", data), ("finish", exit_code). Its init raises
    wandb.errors.Error(init_error) where one is given."""
    wandb = types.ModuleType("wandb")
    wandb.errors = types.SimpleNamespace(Error=type("Error", (Exception,), {}))

    class Run:
        def __init__(self, run_id):
            self.id = run_id

        def define_metric(self, name, step_metric=None):
            calls.append(("define_metric", name, step_metric))

        def log(self, data):
            calls.append(("log", data))

        def finish(self, exit_code=None):
            calls.append(("finish", exit_code))

    def init(**kwargs):
        if init_error:
            raise wandb.errors.Error(init_error)
        calls.append(("init", kwargs))
        return Run(kwargs["id"] or f"run{len(calls)}")

    wandb.init = init
    return wandb


def tensorboard_scalars(log_dir):
    """{tag: [(step, value)]} of the event files in log_dir, as TensorBoard shows them (the events
    a resumed run purged left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep all
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def assert_tensorboard_shows(log_dir, records):
    """TensorBoard's scalars in log_dir are exactly `records` (log.jsonl's): a tag per key, one
    event per record that has it, at the record's step."""
    scalars = tensorboard_scalars(log_dir)
    assert set(scalars) == {key for record in records for key in record} - {"step"}
    for tag, events in scalars.items():
        # TensorBoard keeps float32: each value is log.jsonl's rounded to the nearest float32
        # (NaN equals NaN here)
        np.testing.assert_array_equal(
            events, [(r["step"], np.float32(r[tag])) for r in records if tag in r], err_msg=tag)


def test_tensorboard_and_wandb_get_what_log_jsonl_keeps_across_a_resume(tmp_path, tiny_data,
                                                                        monkeypatch, one_thread):
    """A run to step 6 with both sinks (wandb: the stand-in), its last checkpoint removed as if it
    had been killed after logging the steps past its checkpoint of step 4; then a run to step 8
    resumes from step 4 and logs other values there (its lr schedule is longer). TensorBoard
    then shows exactly the records of log.jsonl, and wandb got each run's records in one run."""
    pytest.importorskip("tensorboard")
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    write_hellaswag(tiny_data / "hellaswag.jsonl", 5)
    out = tmp_path / "out"
    peak = 1e9
    common = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--total_batch_size=64",
              "--checkpoint_interval=4", "--hellaswag_interval=4",
              f"--hellaswag_path={tiny_data / 'hellaswag.jsonl'}", f"--peak_flops={peak}",
              "--tensorboard=true", "--wandb_log=true"]
    train_here([*common, "--max_steps=6"])
    first = runs.read_log(out)
    max(out.glob("ckpt_*.pt")).unlink()
    train_here([*common, "--max_steps=8"])
    final = runs.read_log(out)

    inits = [i for i, call in enumerate(calls) if call[0] == "init"]
    assert len(inits) == 2
    runs_calls = [calls[:inits[1]], calls[inits[1]:]]
    logged = [[call[1] for call in run if call[0] == "log"] for run in runs_calls]
    kept = len(final) - len(logged[1])  # the first run's records that log.jsonl kept
    assert 0 < kept < len(first)  # the resume cut the records of the steps past the checkpoint
    assert logged[0] == first and final == first[:kept] + logged[1]
    cut_lrs = {r["step"]: r["lr"] for r in first[kept:] if "lr" in r}
    # the resumed run logged steps again that the first had logged, with other values
    assert any(r["lr"] != cut_lrs.get(r["step"], r["lr"]) for r in logged[1] if "lr" in r)
    run_id = (out / "wandb_run_id").read_text()
    assert run_id == f"run{inits[0] + 1}"  # the id the first run's wandb.init made
    for run, asked_id, max_steps in zip(runs_calls, [None, run_id], [6, 8]):
        init = run[0][1]
        assert (init["id"], init["resume"], init["project"], init["name"], init["dir"]) == (
            asked_id, "allow", "gpt2", None, str(out))
        assert init["config"] == dataclasses.asdict(load_config([  # the dtype that dtype=auto ran
            *common, f"--max_steps={max_steps}", "--dtype=float32"]))
        assert run[1:3] == [("define_metric", "step", None), ("define_metric", "*", "step")]
        assert run[-1] == ("finish", 0)

    assert_tensorboard_shows(out / "tensorboard", final)
    assert {"mfu", "hellaswag_acc_norm", "val_loss", "grad_norm"} <= {k for r in final for k in r}
    for r in final:
        if "loss" in r:
            assert r["mfu"] == pytest.approx(expected_mfu(r, TINY, 64, peak), rel=1e-9)


def test_a_run_from_step_0_hides_every_tensorboard_event_of_the_run_before(tmp_path):
    """A run that starts over (its out_dir's log cut to nothing) shows its own step 0 alone, as
    log.jsonl does, not the old run's beside it."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter
    from gpt2_ddp import checkpoints, metrics
    old = SummaryWriter(log_dir=str(tmp_path / "tensorboard"))
    old.add_scalar("val_loss", 7.0, 0)
    old.close()
    out = checkpoints.OutDir(tmp_path)
    out.start(0, None, [])
    [sink] = metrics.open_sinks(out, load_config([*TINY, f"--out_dir={tmp_path}", "--tensorboard=true"]), 0)
    sink.write({"step": 0, "val_loss": 6.0})
    sink.close(failed=False)
    out.lock.close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == {"val_loss": [(0, 6.0)]}


def test_a_run_that_an_error_ends_still_flushes_its_sinks(tmp_path, tiny_data, monkeypatch,
                                                          one_thread):
    """A run that diverges (3 non-finite steps in a row at max_lr 1e30) ends in a UserError: once
    the traceback that holds its Metrics is freed, TensorBoard shows every record of log.jsonl
    and the wandb run is finished as failed. Its out_dir holds an old wandb_run_id but no
    checkpoint: a run from step 0 starts a new wandb run, and its id replaces the old one."""
    pytest.importorskip("tensorboard")
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    (tmp_path / "wandb_run_id").write_text("old-run")
    with pytest.raises(UserError, match="the run diverged"):
        train_here([*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
                    "--total_batch_size=64", "--max_steps=20", "--max_lr=1e30",
                    "--tensorboard=true", "--wandb_log=true"])
    gc.collect()  # the traceback's frames hold the Metrics in reference cycles
    records = runs.read_log(tmp_path)
    assert any(r.get("skipped") for r in records)
    assert calls[-1] == ("finish", 1)
    assert calls[0][0] == "init" and calls[0][1]["id"] is None
    assert (tmp_path / "wandb_run_id").read_text() == "run1"  # the id the stand-in's init made
    logged = [call[1] for call in calls if call[0] == "log"]
    assert json.dumps(logged) == json.dumps(records)  # NaN losses: as text, NaN equals NaN
    assert_tensorboard_shows(tmp_path / "tensorboard", records)


def test_real_wandb_offline_and_tensorboard_log_from_rank_0_alone(tmp_path, tiny_data,
                                                                   monkeypatch):
    """Under torchrun with 2 ranks, the installed wandb (offline) and TensorBoard: the run exits
    0, and out_dir holds one offline wandb run, the one wandb_run_id names, and one event file
    that shows log.jsonl's records."""
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name))  # nothing written to ~
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "out"
    run_training([*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--total_batch_size=128",
                  "--max_steps=2", "--wandb_log=true", "--wandb_run_name=tiny",
                  "--tensorboard=true"], nproc=2)
    run_id = (out / "wandb_run_id").read_text()
    [run_dir] = (out / "wandb").glob("offline-run-*")
    assert run_dir.name.endswith(f"-{run_id}")
    assert (run_dir / f"run-{run_id}.wandb").stat().st_size > 0
    assert len(list((out / "tensorboard").iterdir())) == 1
    assert_tensorboard_shows(out / "tensorboard", runs.read_log(out))


@pytest.mark.parametrize("key, module, message", [
    ("wandb_log", "wandb", "wandb_log=true needs the wandb package: pip install wandb"),
    ("tensorboard", "torch.utils.tensorboard",
     "tensorboard=true needs the tensorboard package: pip install tensorboard"),
])
def test_a_missing_package_is_one_line_before_the_first_step(tmp_path, tiny_data, monkeypatch,
                                                             key, module, message):
    monkeypatch.setitem(sys.modules, module, None)  # its import raises ImportError
    with pytest.raises(UserError, match=f"^{message}$"):
        train_here([*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
                    "--total_batch_size=64", "--max_steps=2", f"--{key}=true"])
    assert (tmp_path / "log.jsonl").read_text() == ""  # no step, no eval


def test_a_failed_wandb_init_is_one_line(tmp_path, tiny_data, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(
        calls, init_error="No API key configured. Use `wandb login` to log in.\nmore"))
    with pytest.raises(UserError, match="^wandb.init failed: No API key configured. Use `wandb "
                                        "login` to log in.; set WANDB_MODE=offline to log "
                                        "without a wandb server"):
        train_here([*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
                    "--total_batch_size=64", "--max_steps=2", "--wandb_log=true"])
    assert not (tmp_path / "wandb_run_id").exists()


def test_a_run_resumed_without_a_wandb_run_id_keeps_the_id_of_the_wandb_run_it_starts(tmp_path, monkeypatch):
    """The first resume with wandb_log on (the earlier runs logged to no wandb run) starts a run that
    the next resume must log to."""
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    config = load_config([*TINY, f"--out_dir={tmp_path}", "--wandb_log=true"])
    for _ in range(2):
        Wandb(config, resumed=True)
    assert [call[1]["id"] for call in calls if call[0] == "init"] == [None, "run1"]
    assert (tmp_path / "wandb_run_id").read_text() == "run1"


@pytest.mark.parametrize("what", ["bytes", "directory"])
def test_a_wandb_run_id_file_that_no_run_wrote_is_one_line(tmp_path, tiny_data, monkeypatch, what):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb([]))
    path = tmp_path / "wandb_run_id"
    path.mkdir() if what == "directory" else path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match=f"^{path} is not the wandb run id a run writes there: move "
                                        f"it away, and this run logs to a new wandb run$"):
        train_here([*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
                    "--total_batch_size=64", "--max_steps=2", "--wandb_log=true"])


def test_a_loss_spike_is_one_line_with_its_step_and_a_muon_run_logs_both_lrs(capsys):
    """A loss over a nat above the running mean is named with its step; the mean's own noise and
    a skipped (non-finite) step are not. Under optimizer=muon each step says Muon's lr too."""
    config = load_config([*TINY, "--optimizer=muon", "--max_lr=1e-3", "--muon_lr=0.02", "--max_steps=8"])
    metrics = train_gpt2.Metrics(None, config, 0, 1, torch.device("cpu"), train_gpt2.GPT(config), 0)
    optimizer = GPT(config).configure_optimizers(config, "cpu")
    for group in optimizer.param_groups:  # as the loop sets them for lr 1e-3
        group["lr"] = 1e-3 * group["lr_scale"]
    for step, loss in enumerate([6.0, 6.5, 5.9, 6.0, float("inf"), 7.2, 6.1], start=1):
        metrics.train_step(step, loss, 1e-3, 1.0, time.time() - 0.1, optimizer, None,
                           not np.isfinite(loss), False)
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "spike" in line] == [
        "step     6 | loss spike: 7.200000, the running mean is 6.031500"]
    assert all("| lr 1.0000e-03 | muon_lr 2.0000e-02 |" in line for line in lines if "/8" in line)



def test_evaluations_show_a_progress_bar_on_a_terminal_alone(tmp_path, tiny_data):
    """On a terminal (a pty of 120 columns) rank 0 shows a bar while the val loss and HellaSwag
    run; with output to a file or pipe, as in run_training, the lines stay clean."""
    write_hellaswag(tmp_path / "hellaswag.jsonl", 3)
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'out'}", "--max_steps=1",
            "--total_batch_size=32", "--hellaswag_interval=1",
            f"--hellaswag_path={tmp_path / 'hellaswag.jsonl'}"]
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "train_gpt2.py", *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # Linux's answer once the process has closed its side
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, output
    assert b"val loss:   0%" in output and b"hellaswag:   0%" in output, output
    assert not re.search(rb"(val loss|hellaswag): +100%[^\r\n]*\r?\n", output), output  # each bar cleared
    plain = run_training([*args, f"--out_dir={tmp_path / 'plain'}"])
    assert "%|" not in plain.stdout + plain.stderr
    assert not (tmp_path / "plain" / "tensorboard").exists()  # TensorBoard and wandb are opt-in


def test_only_rank_0_draws_the_evaluations_bars_on_the_terminal_all_ranks_share(tmp_path, tiny_data,
                                                                               monkeypatch):
    """torchrun's workers all write to its terminal, where rank 1's bars would garble rank 0's."""
    from gpt2_ddp import hellaswag, precision

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    path = tmp_path / "hellaswag.jsonl"
    write_hellaswag(path, 3)
    config = load_config([*TINY, "--hellaswag_interval=1", f"--hellaswag_path={path}"])
    model, cpu = GPT(config), torch.device("cpu")
    autocast, examples = precision.autocast("float32", cpu), hellaswag.examples_for_training(config)
    drawn = []
    for rank in (0, 1):  # as each rank of 2, its stderr a terminal
        monkeypatch.setattr(sys, "stderr", Terminal())
        loader = train_gpt2.DataLoader(tiny_data, "val", 2, 16, rank, 2, cpu)
        train_gpt2.evaluate(model, loader, 2, autocast, torch.float32)
        hellaswag.evaluate(model, examples, cpu, rank, 2, autocast)
        drawn.append([name in sys.stderr.getvalue() for name in ("val loss:", "hellaswag:")])
    assert drawn == [[True, True], [False, False]]


def test_the_eta_comes_from_steady_steps_and_a_slow_first_step_says_what_it_waits_for(capsys):
    """After a resume at step 10 the first step (8.7 s of warm-up) sets no eta; the next (0.5 s)
    does, for the 8 steps left, and the next (5.5 s) moves the average a tenth of the way to it. A
    first step whose line is later than first_wait's interval (5 s) says what it waits for, as does
    an evaluation; fast ones say nothing, then or later."""
    config = load_config([*TINY, "--max_steps=20"])
    optimizer = GPT(config).configure_optimizers(config, "cpu")
    for slow in (True, False):
        metrics = train_gpt2.Metrics(None, config, 0, 1, torch.device("cpu"), GPT(config), 10)
        metrics.first_wait.interval = 0.2 if slow else 1.0
        t0 = metrics.step_begins()
        time.sleep(0.4 if slow else 0)
        metrics.train_step(11, 6.0, 1e-3, 1.0, t0 - 8.7, optimizer, None, False, False)
        metrics.train_step(12, 6.0, 1e-3, 1.0, time.time() - 0.5, optimizer, None, False, False)
        metrics.train_step(13, 6.0, 1e-3, 1.0, time.time() - 5.5, optimizer, None, False, False)
        time.sleep(1.2)  # past the interval: a fast first step's line has ended the wait for good
        metrics.close()
        lines = capsys.readouterr().out.splitlines()[-4:]
        assert "eta" not in lines[-3] and lines[-2].endswith("| eta 0:00:04")
        assert lines[-1].endswith("| eta 0:00:07")  # 7 steps at 0.9 * 0.5 s + 0.1 * 5.5 s
        waited = "waiting for step 11, the first after a start: it warms up (memory, kernels)"
        assert (lines[0] == waited) == slow, lines
        with Waiting("the val loss", seconds=0.2):  # what evaluate() says of a long evaluation
            time.sleep(0.4 if slow else 0)
        time.sleep(0.3)
        assert capsys.readouterr().out == ("waiting for the val loss\n" if slow else "")


def test_the_first_step_after_a_resume_logs_the_optimizer_state_bytes():
    """A run resumed at step 10 logs rank 0's optimizer state bytes in step 11's record, as a fresh
    run does in step 1's, and in no later record: AdamW's two float32 moments a parameter and its
    float32 step count a tensor."""
    config = load_config([*TINY, "--max_steps=20"])
    model = GPT(config)
    optimizer = model.configure_optimizers(config, "cpu")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW makes its state in its first step
    records = []
    metrics = train_gpt2.Metrics(types.SimpleNamespace(log=records.append), config, 0, 1,
                                 torch.device("cpu"), model, 10)
    for step in (11, 12):
        metrics.train_step(step, 6.0, 1e-3, 1.0, time.time() - 0.5, optimizer, None, False, False)
    metrics.close()
    assert [record["step"] for record in records] == [11, 12]
    assert "optimizer_state_bytes" not in records[1]
    params = list(model.parameters())
    assert records[0]["optimizer_state_bytes"] == 2 * 4 * sum(p.numel() for p in params) + 4 * len(params)


def test_a_profiled_run_that_ends_inside_the_profilers_schedule_still_writes_its_trace(tmp_path):
    """A run of 4 steps ends before the profiler's last active step (6): close() writes the steps it
    recorded, each a ProfilerStep range as scripts/timeline.py reads them."""
    config = load_config([*TINY, f"--out_dir={tmp_path}", "--profile=true", "--max_steps=4"])
    model = GPT(config)
    metrics = train_gpt2.Metrics(None, config, 0, 1, torch.device("cpu"), model, 0)
    optimizer = model.configure_optimizers(config, "cpu")
    for step in range(1, 5):
        metrics.train_step(step, 6.0, 1e-3, 1.0, time.time() - 0.1, optimizer, None, False, False)
    metrics.close()
    events = json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("ProfilerStep#") for e in events)


def test_a_forks_extra_metrics_reach_every_sink_in_the_steps_one_host_read(tmp_path, tiny_data, monkeypatch,
                                                                           one_thread):
    """A fork (a z-loss added to GPT's loss) puts its value in `extra_metrics` from its forward,
    touching nothing else: each step's `z_loss` is the mean over its 2 micro-batches (==), in
    log.jsonl, on the console line, in TensorBoard and in what wandb gets, and the step still reads
    the device once. A name the record has already is refused."""
    pytest.importorskip("tensorboard")
    drawn = []  # each training forward's z-loss, a 0-d tensor

    class ZLossGPT(GPT):
        def forward(self, idx, targets=None, cache=None):
            logits, loss = super().forward(idx, targets, cache)
            if targets is not None:
                z = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
                self.extra_metrics = {"z_loss": z}
                if self.training and type(z) is torch.Tensor:  # not the memory plan's fake tensors
                    drawn.append(z.detach())
                loss = loss + 1e-4 * z
            return logits, loss

    events = []
    monkeypatch.setattr(train_gpt2, "GPT", ZLossGPT)
    record_host_reads(monkeypatch, events)
    for name, what in (("step_begins", "begin"), ("train_step", "log")):
        monkeypatch.setattr(train_gpt2.Metrics, name, recording(events, what, getattr(train_gpt2.Metrics, name)))
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    out = tmp_path / "out"
    console = train_here([*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--total_batch_size=64",
                          "--max_steps=2", "--tensorboard=true", "--wandb_log=true"])
    assert [s.split("log")[0].split() for s in " ".join(events).split("begin")[1:]] == [["read"]] * 2
    records = runs.read_log(out)
    steps = [r for r in records if "loss" in r]
    assert [r["z_loss"] for r in steps] == [((drawn[i] + drawn[i + 1]) / 2).item() for i in (0, 2)]
    assert len(drawn) == 4
    lines = [line for line in console.splitlines() if "/2 |" in line]
    assert [f"| norm: {r['grad_norm']:.4f} | z_loss: {r['z_loss']:.4g} | dt: " in line
            for r, line in zip(steps, lines)] == [True, True]
    assert [call[1] for call in calls if call[0] == "log"] == records
    assert_tensorboard_shows(out / "tensorboard", records)
    config = load_config(TINY)
    metrics = train_gpt2.Metrics(None, config, 0, 1, torch.device("cpu"), GPT(config), 0)
    with pytest.raises(ValueError, match=r"^extra_metrics names \['lr'\], which the record of a step"):
        metrics.train_step(1, 6.0, 1e-3, 1.0, time.time(), GPT(config).configure_optimizers(config, "cpu"),
                           None, False, False, {"z_loss": 1.0, "lr": 2.0})
