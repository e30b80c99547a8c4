"""scripts/bench.py on a tiny CPU config: every variant runs, is profiled, and gets a table row."""

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, make_shards
from gpt2_ddp.configurator import UserError
from scripts import timeline
from train_gpt2 import GPT, load_config


def test_bench_prints_a_row_per_variant_with_the_time_split(tmp_path):
    make_shards(tmp_path / "data", n_train=20000)
    args = [arg for arg in TINY if not arg.startswith("--compile")]
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", *args, f"--data_dir={tmp_path}/data",
         "--total_batch_size=128", "--nproc", "2", "--steps", "3", "--variants", "eager",
         "compile", "compile_ddp", "exact:--exact_reduction=true,--compile=false", "muon",
         "--micro_batch_sizes", "1", "--out_dir", str(tmp_path / "bench")],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["variant", "tok/s", "ms/step", "MFU"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"eager", "compile", "compile_ddp", "exact", "muon", "B=1"}
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
    # scripts/timeline.py: ddp's collectives are all-reduces, its compute the loop's ranges
    compute, comm = timeline.lanes({"traceEvents": trace}, steps=3)
    assert {kind for kind, _, _ in comm} == {"all_reduce"}
    assert {kind for kind, _, _ in compute} == {"data", "forward", "backward", "optimizer"}
    with pytest.raises(UserError, match="no trace_rank\\*.json in"):
        timeline.main([str(tmp_path)])
