"""scripts/bench.py on a tiny CPU config: every variant runs, is profiled, and gets a table row."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, make_shards
from gpt2_ddp import metrics
from gpt2_ddp.configurator import UserError
from scripts import bench, timeline
from train_gpt2 import GPT, load_config


def test_bench_prints_a_row_per_variant_with_the_time_split(tmp_path):
    make_shards(tmp_path / "data", n_train=20000)
    earlier = tmp_path / "bench" / "eager"  # a run of bench.py's own is replaced
    earlier.mkdir(parents=True)
    (earlier / bench.MARKER).touch()
    (earlier / "old.txt").touch()
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", *TINY, f"--data_dir={tmp_path}/data",
         "--total_batch_size=128", "--nproc", "2", "--steps", "3", "--variants", "eager",
         "compile", "compile_ddp", "exact:--exact_reduction=true,--compile=false", "muon",
         "--out_dir", str(tmp_path / "bench")],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (earlier / "old.txt").exists() and (earlier / bench.MARKER).is_file()
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["variant", "tok/s", "ms/step", "MFU"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"eager", "compile", "compile_ddp", "exact", "muon"}
    # a micro-batch size is one more variant, run as the named ones are
    assert bench.plan(["eager"], [1, 4])[1:] == [("B=1", ["--micro_batch_size=1"]),
                                                 ("B=4", ["--micro_batch_size=4"])]
    assert not list((tmp_path / "bench").glob("*/ckpt_*"))  # a 124M run would leave a checkpoint a variant
    for name in rows:  # each run shows on stderr as it trains
        assert f"{name}: started\n" in proc.stderr and f"{name}: finished in " in proc.stderr
        assert re.search(rf"^{re.escape(name)}: step +\d+/\d+ \| loss", proc.stderr, re.M), proc.stderr
    for row in rows.values():
        tokens_per_sec, ms_per_step = float(row[1].replace(",", "")), float(row[2])
        assert tokens_per_sec > 0 and ms_per_step > 0
        assert row[3] == "-%" and row[4] == "-"  # no MFU or GPU memory on a CPU
        data_ms, fwd_bwd_ms, wait_ms, optim_ms = map(float, row[5:9])
        assert fwd_bwd_ms > 0 and optim_ms > 0 and wait_ms >= 0
        # Newton-Schulz's time, within the optimizer's, for Muon only
        assert (row[0] == "muon") == (row[9] != "-") and (row[9] == "-" or 0 < float(row[9]) < optim_ms)
    # bytes handed to collectives per step: the gradients' all-reduce, float64 with exact_reduction;
    # Muon's bfloat16 broadcast of the blocks' matrices on top
    comm_mb = {name: float(row[11]) for name, row in rows.items()}
    config = load_config(TINY)
    n_params = sum(p.numel() for p in GPT(config).parameters())
    assert comm_mb["eager"] == pytest.approx(n_params * 4 / 2**20, rel=0.01)
    assert comm_mb["exact"] == pytest.approx(2 * comm_mb["eager"], rel=0.01)
    muon_bytes = config.n_layer * 12 * config.n_embd ** 2 * 2
    assert comm_mb["muon"] == pytest.approx(comm_mb["eager"] + muon_bytes / 2**20, rel=0.01)
    # the trace of the profiled steps has the loop's ranges and gloo's all-reduces
    trace = json.load(open(tmp_path / "bench" / "eager" / "trace_rank0.json"))["traceEvents"]
    names = {e.get("name") for e in trace}
    assert {"data", "forward_backward", "forward_backward_sync", "optimizer"} <= names
    assert any("allreduce" in str(n) or "all_reduce" in str(n) for n in names)
    for name in rows:  # the compiled variants' steps run torch.compile's graphs, the others eager
        events = json.load(open(tmp_path / "bench" / name / "trace_rank0.json"))["traceEvents"]
        compiled = any(e.get("name") == "CompiledFunction" for e in events)
        assert compiled == name.startswith("compile"), name
    # scripts/timeline.py: ddp's collectives are all-reduces, its compute the loop's ranges
    compute, comm = timeline.lanes({"traceEvents": trace}, steps=3)
    assert {kind for kind, _, _ in comm} == {"all_reduce"}
    assert {kind for kind, _, _ in compute} == {"data", "forward", "backward", "optimizer"}
    with pytest.raises(UserError, match="no trace_rank\\*.json in"):
        timeline.main([str(tmp_path)])


@pytest.mark.parametrize("args, message", [
    (["--variants", ":--compile=false"], "variant name '' is not a plain directory name"),
    (["--variants", "../../x:--compile=false"], "variant name '../../x' is not a plain directory name"),
    (["--variants", "eager", "eager"], "variant 'eager' is listed twice"),
    (["--variants", "eagr"], f"unknown variant 'eagr'; known: eager, compile, compile_ddp, "
                             f"{', '.join(list(bench.VARIANTS)[3:])}, or write name:--key=value,..."),
    (["--micro_batch_sizes", "1", "0"], "--micro_batch_sizes must be >= 1, not 0"),
    (["--variants", "eager", "mine:--compile=false"], "mine exists and was not made by bench.py"),
])
def test_bench_refuses_before_training_what_would_delete_or_fail_late(tmp_path, args, message):
    """A name that is not plain (the empty one once deleted all of --out_dir), a directory bench.py
    did not make, or a bad micro-batch size is refused before the first variant trains."""
    mine = tmp_path / "bench" / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("keep")
    (tmp_path / "x").mkdir()
    with pytest.raises(UserError, match=re.escape(message)):
        bench.main([*TINY, f"--data_dir={tmp_path}/data", "--out_dir", str(tmp_path / "bench"), *args])
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["bench", "mine", "notes.txt", "x"]
    assert (mine / "notes.txt").read_text() == "keep"


def test_bench_without_variants_times_eager_compile_and_compile_ddp(tmp_path, monkeypatch, capsys):
    """The default --variants, which the first two commands of bench.py's docstring time."""
    planned = []
    monkeypatch.setattr(bench, "plan", lambda specs, micro_batch_sizes: planned.append(specs) or [])
    bench.main(["--out_dir", str(tmp_path)])
    assert planned == [["eager", "compile", "compile_ddp"]]


def training_processes(marker):
    """The pids of live processes whose command line holds `marker`, this one's aside."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and marker in cmdline and state != "Z" and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def test_sigterm_to_bench_ends_its_training_processes(tmp_path):
    """bench.py passes SIGTERM on to the torchrun it runs and ends only when its workers have."""
    make_shards(tmp_path / "data", n_train=20000)
    out = tmp_path / "bench"
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.bench", *TINY, f"--data_dir={tmp_path}/data",
         "--total_batch_size=128", "--nproc", "2", "--steps", "100000", "--variants", "eager",
         "--out_dir", str(out)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("eager: step"):
            break
    assert len(training_processes(str(out))) >= 4  # bench.py, torchrun and its two workers
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    assert "bench.py: stopped by SIGTERM; ending the command it runs\n" in rest
    assert training_processes(str(out)) == []


def test_bench_leaves_out_exactly_the_steps_the_profiler_records(tmp_path, monkeypatch):
    """UNTIMED_STEPS ends with the last step train_gpt2.py's profiler records, PROFILED_STEPS of them."""
    made = {}

    class Recorded:
        def __init__(self, **kwargs):
            made.update(kwargs)

        def start(self):
            pass

    monkeypatch.setattr(torch.profiler, "profile", Recorded)
    metrics.start_profiler(load_config([*TINY, "--profile=true", f"--out_dir={tmp_path}"]), 0)
    action = torch.profiler.ProfilerAction
    recorded = [step for step in range(1, 20)  # the schedule counts updates from 0
                if made["schedule"](step - 1) in (action.RECORD, action.RECORD_AND_SAVE)]
    assert recorded == list(range(bench.UNTIMED_STEPS - bench.PROFILED_STEPS + 1, bench.UNTIMED_STEPS + 1))


def test_bench_times_only_the_steps_after_warm_up_and_profiling(tmp_path, monkeypatch):
    """The first UNTIMED_STEPS steps (compilation, warm-up, the profiler's) are left out of the medians."""
    records = [{"step": step, "loss": 5.0, "dt_ms": float(step), "tokens_per_sec": 1000.0 / step}
               for step in range(1, bench.UNTIMED_STEPS + 4)]
    records[0]["optimizer_state_bytes"] = 2**20  # train_gpt2.py logs it once, with the first step
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))
    monkeypatch.setattr(bench, "time_split", lambda events: {})
    monkeypatch.setattr(bench, "comm_bytes", lambda events: 0)
    summary = bench.summarize(records, tmp_path / "trace.json")
    assert summary["ms_per_step"] == bench.UNTIMED_STEPS + 2  # the median of the 3 timed steps
    assert summary["tokens_per_sec"] == 1000.0 / (bench.UNTIMED_STEPS + 2)
    assert summary["optimizer_state_mb"] == 1.0


def test_a_reduce_scatter_or_all_gather_counts_its_whole_tensor_in_its_dtype():
    """zero2's and fsdp's collectives hand over the whole tensor, the larger of output and input
    (a reduce-scatter's input, an all-gather's output), at its element size."""
    events = [{"ph": "X", "name": "c10d::_reduce_scatter_base_",
               "args": {"Input Dims": [[8], [16]], "Input type": ["float", "float"]}},
              {"ph": "X", "name": "c10d::_allgather_base_",
               "args": {"Input Dims": [[16], [8]], "Input type": ["c10::BFloat16", "c10::BFloat16"]}}]
    assert bench.comm_bytes(events) == (16 * 4 + 16 * 2) / bench.PROFILED_STEPS


def test_an_all_reduce_counts_its_elements_at_the_dtype_the_backends_event_names():
    """c10d's all-reduce event lacks the dtype: the backend's event of the same size gives it, so
    exact_reduction's float64 sums count 8 bytes an element, float32 ones 4."""
    events = [{"ph": "X", "name": "gloo:all_reduce", "args": {"Input Dims": [[12]], "Input type": ["double"]}},
              {"ph": "X", "name": "c10d::allreduce_", "args": {"Input Dims": [[[3, 4]]], "Input type": [[]]}},
              {"ph": "X", "name": "gloo:all_reduce", "args": {"Input Dims": [[5]], "Input type": ["float"]}},
              {"ph": "X", "name": "c10d::allreduce_", "args": {"Input Dims": [[[5]]], "Input type": [[]]}}]
    assert bench.comm_bytes(events) == (12 * 8 + 5 * 4) / bench.PROFILED_STEPS


def test_the_time_split_is_per_step_and_the_wait_is_what_syncing_adds():
    """Each range's milliseconds over the profiled steps; a syncing micro-step's excess over a
    non-syncing one's is the all-reduce wait, and fwd_bwd keeps the rest."""
    steps = bench.PROFILED_STEPS
    events = [{"ph": "X", "cat": "user_annotation", "name": name, "dur": dur}
              for name, dur in [("data", 300)] * steps + [("forward_backward", 1000)] * steps
              + [("forward_backward_sync", 1500)] * steps + [("optimizer", 200)] * steps]
    events.append({"ph": "X", "cat": "cpu_op", "name": "data", "dur": 10**6})  # not a range of ours
    assert bench.time_split(events) == pytest.approx(
        {"data": 0.3, "fwd_bwd": 2.0, "allreduce_wait": 0.5, "optimizer": 0.2, "newton_schulz": None})
