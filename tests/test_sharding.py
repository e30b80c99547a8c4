"""sharding=zero2 and sharding=fsdp: the same run as ddp and as one process, exact resume at any
world size, and optimizer state split over ranks. Tolerances as in test_equivalence.py."""

import json
import shutil

import numpy as np
import pytest
import torch

from check_equivalence import compare
from conftest import EQUIV, STEPS, read_log, run_training
from test_equivalence import assert_same_run


@pytest.mark.parametrize("mode", ["zero2", "fsdp"])
def test_sharded_modes_train_the_same_model_as_one_ddp_process(mode, equiv_data_dir, equiv_runs, tmp_path):
    sharded = compare([*EQUIV, f"--data_dir={equiv_data_dir}", f"--sharding={mode}"], [1, 2, 4], tmp_path)
    for n in (1, 2, 4):
        assert_same_run(sharded[n], equiv_runs[1])


@pytest.mark.parametrize("mode", ["zero2", "fsdp"])
def test_sharded_checkpoints_resume_exactly_and_on_other_world_sizes(mode, equiv_data_dir, tmp_path):
    """A run at world size 2 saves every 2 steps; its late checkpoints are removed as if it had
    died after step 2, and it is resumed at world size 2 (bitwise) and at 4 and 1 (tolerance)."""
    args = [*EQUIV, f"--data_dir={equiv_data_dir}", f"--sharding={mode}", "--checkpoint_interval=2",
            "--keep_checkpoints=0"]
    full = tmp_path / "full"
    run_training([*args, f"--out_dir={full}"], nproc=2)
    ref_steps, ref_evals = read_log(full)
    ckpt = torch.load(full / "ckpt_0000002.pt", weights_only=True)
    assert ckpt["config"]["sharding"] == mode
    for world_size in (2, 4, 1):
        out = tmp_path / f"resumed_{world_size}"
        out.mkdir()
        shutil.copy(full / "ckpt_0000002.pt", out)
        shutil.copy(full / "log.jsonl", out)  # cut back to step 2 on resume
        proc = run_training([*args, f"--out_dir={out}"], nproc=world_size if world_size > 1 else None)
        assert "resumed from" in proc.stdout
        steps, evals = read_log(out)
        assert [s["step"] for s in steps] == list(range(STEPS))
        losses, ref = [s["loss"] for s in steps], [s["loss"] for s in ref_steps]
        if world_size == 2:
            assert losses == ref
        else:
            np.testing.assert_allclose(losses, ref, rtol=1e-5)
        np.testing.assert_allclose([e["val_loss"] for e in evals],
                                   [e["val_loss"] for e in ref_evals], rtol=1e-5)


def test_zero2_and_ddp_checkpoints_are_interchangeable(equiv_data_dir, tmp_path):
    """zero2 saves the full AdamW state in torch.optim.AdamW's format, so ddp can resume it."""
    args = [*EQUIV, f"--data_dir={equiv_data_dir}", "--checkpoint_interval=3", "--keep_checkpoints=0"]
    run_training([*args, f"--out_dir={tmp_path}/zero2", "--sharding=zero2"], nproc=2)
    ddp_ref = tmp_path / "ddp"
    run_training([*args, f"--out_dir={ddp_ref}"], nproc=2)
    out = tmp_path / "mixed"
    out.mkdir()
    shutil.copy(tmp_path / "zero2" / "ckpt_0000003.pt", out)
    run_training([*args, f"--out_dir={out}", "--sharding=ddp"], nproc=2)
    np.testing.assert_allclose([s["loss"] for s in read_log(out)[0]],
                               [s["loss"] for s in read_log(ddp_ref)[0]][3:], rtol=1e-5)


def test_optimizer_state_per_rank_shrinks_with_the_world_size(equiv_data_dir, tmp_path):
    """AdamW keeps 8 bytes per parameter; zero2 and fsdp keep 1/world_size of it per rank."""
    bytes_per_rank = {}
    for mode in ("ddp", "zero2", "fsdp"):
        for n in (1, 2, 4):
            out = tmp_path / f"{mode}_{n}"
            run_training([*EQUIV, f"--data_dir={equiv_data_dir}", f"--sharding={mode}", "--max_steps=1",
                          f"--out_dir={out}"], nproc=n if n > 1 else None)
            bytes_per_rank[mode, n] = read_log(out)[0][0]["optimizer_state_bytes"]
    full = bytes_per_rank["ddp", 1]
    for n in (1, 2, 4):
        assert bytes_per_rank["ddp", n] == full
        for mode in ("zero2", "fsdp"):
            assert full / n <= bytes_per_rank[mode, n] < full / n * 1.05 + 1024, (mode, n)


def test_zero2_trace_shows_reduce_scatters_launched_during_the_backward(equiv_data_dir, tmp_path):
    run_training([*EQUIV, f"--data_dir={equiv_data_dir}", "--sharding=zero2", "--profile=true",
                  f"--out_dir={tmp_path}"], nproc=2)
    events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
    syncing = [e for e in events if e.get("name") == "forward_backward_sync" and e.get("ph") == "X"]
    scatters = [e for e in events if "reduce_scatter" in str(e.get("name")) and e.get("ph") == "X"]
    assert syncing and scatters
    # each profiled syncing micro-step launched reduce-scatters before its backward had ended
    for window in syncing:
        inside = [e for e in scatters if window["ts"] <= e["ts"] < window["ts"] + window["dur"]]
        assert len(inside) > 1
