"""The single-device promise: N processes train the same model as one, dropout included.

Each test launches real processes (torchrun, gloo on CPU). Tolerances, float32:
- per-step losses and val losses: rtol 1e-5. The runs differ only in the order in which float
  sums are taken (gradient all-reduce, loss averaging); measured differences are ~1e-7.
- final weights: atol 1e-5 after 6 AdamW steps. The test model has bias=false: with biases, the
  key bias of c_attn has a gradient that is 0 in exact arithmetic, and AdamW's normalisation
  scales its float noise (~1e-9) up to +-lr per step, so the weights would differ by ~lr for
  reasons that have nothing to do with data parallelism (PITFALLS.md).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from check_equivalence import compare, print_table
from conftest import EQUIV, ROOT, STEPS, read_log


def assert_same_run(result, reference):
    np.testing.assert_allclose(result["loss"], reference["loss"], rtol=1e-5)
    np.testing.assert_allclose(result["val_loss"], reference["val_loss"], rtol=1e-5)
    assert result["max_param_diff"] < 1e-5


def test_world_sizes_1_2_4_train_the_same_model_with_dropout(equiv_runs):
    assert len(equiv_runs[1]["loss"]) == STEPS and len(equiv_runs[1]["val_loss"]) == 3
    assert equiv_runs[1]["loss"][-1] < equiv_runs[1]["loss"][0]
    assert equiv_runs[1]["max_param_diff"] == 0.0
    for n in (2, 4):
        assert_same_run(equiv_runs[n], equiv_runs[1])


def test_check_script_prints_the_table(equiv_runs, capsys):
    print_table(equiv_runs)
    out = capsys.readouterr().out
    assert "|diff| world size 2" in out and "|diff| world size 4" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == STEPS
    assert "max |diff| of weights" in out


def test_dropout_masks_depend_on_the_micro_batch_not_the_rank(equiv_data_dir, equiv_runs, tmp_path):
    """The same run with dropout 0 differs: dropout is really on, and the match above is not
    because every rank drew the same masks (with identical masks, world size 2 would differ)."""
    no_dropout = compare([*EQUIV, f"--data_dir={equiv_data_dir}", "--dropout=0.0"], [1], tmp_path)
    assert abs(no_dropout[1]["loss"][0] - equiv_runs[1]["loss"][0]) > 1e-3


def probe(args, nproc, out, late_toggle=False):
    """Runs tests/ddp_probe.py under torchrun; returns the per-rank probe records and the log."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PROBE_OUT=str(out),
               PROBE_LATE_TOGGLE="1" if late_toggle else "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "ddp_probe.py"), *args, f"--out_dir={out}", "--resume=never"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return ranks, read_log(out)[0]


def test_gradients_are_all_reduced_once_per_step_and_the_logged_loss_is_the_mean(equiv_data_dir, tmp_path):
    ranks, steps = probe([*EQUIV, f"--data_dir={equiv_data_dir}"], 2, tmp_path)
    grad_accum_steps = 4
    for rank in ranks:
        per_step, current = [], []
        for event in rank["events"]:
            if event == "step":
                per_step.append(current)
                current = []
            else:
                current.append(int(event.split()[1]))
        assert len(per_step) == STEPS
        for buckets in per_step:
            # every bucket exactly once: DDP all-reduced on the last micro-step only, not on 4
            assert sorted(buckets) == list(range(len(buckets))), buckets
        assert all(per_step)  # and it did all-reduce on every step
    # the logged loss is the mean over both ranks' micro-batch losses of the step
    micro = np.array([rank["micro_losses"] for rank in ranks])  # (ranks, steps * grad_accum_steps)
    micro = micro.reshape(2, STEPS, grad_accum_steps)
    np.testing.assert_allclose([s["loss"] for s in steps], micro.mean(axis=(0, 2)), rtol=1e-6)
    assert not np.allclose(micro[0], micro[1])  # the ranks saw different data


def test_sync_flag_set_after_the_forward_is_caught(equiv_data_dir, equiv_runs, tmp_path):
    """build-nanogpt #30: with the flag set after the forward, DDP syncs the first micro-step's
    gradients only. The equivalence check above must see that as a different run."""
    ranks, steps = probe([*EQUIV, f"--data_dir={equiv_data_dir}"], 2, tmp_path, late_toggle=True)
    losses = [s["loss"] for s in steps]
    assert losses[0] == pytest.approx(equiv_runs[1]["loss"][0], rel=1e-5)  # the same first forward
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(losses, equiv_runs[1]["loss"], rtol=1e-5)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_with_c10d_rendezvous_match_one_process(equiv_data_dir, equiv_runs, tmp_path):
    """Two torchrun agents on one machine, as two nodes of one process each: RANK 1 has
    LOCAL_RANK 0."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two_nodes",
         str(ROOT / "train_gpt2.py"), *EQUIV, f"--data_dir={equiv_data_dir}", f"--out_dir={tmp_path}",
         "--resume=never"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    steps, evals = read_log(tmp_path)
    np.testing.assert_allclose([s["loss"] for s in steps], equiv_runs[1]["loss"], rtol=1e-5)
    np.testing.assert_allclose([e["val_loss"] for e in evals], equiv_runs[1]["val_loss"], rtol=1e-5)
