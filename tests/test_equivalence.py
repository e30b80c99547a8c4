"""The single-device promise: N processes train the same model as one, dropout included.

Each test launches real processes (torchrun, gloo on CPU). With exact_reduction (the EQUIV
config) runs at world sizes 1, 2 and 4 are bitwise identical: losses, val losses and weights are
compared with ==, over 100 steps with GPT-2's biases and dropout 0.1. The default mode sums the
gradients in float32 in an order that depends on the world size; its runs agree to rounding over
a few steps (rtol 1e-5 on losses) and then drift apart, which the last tests show.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import (EQUIV, EVALS, HELLASWAG_EVALS, ROOT, STEPS, assert_bitwise_same_run, compare,
                      free_port, read_log)
from scripts.check_equivalence import print_table


@pytest.mark.compat
def test_world_sizes_1_2_4_train_bitwise_the_same_model_with_dropout(equiv_runs):
    assert len(equiv_runs[1]["loss"]) == STEPS and len(equiv_runs[1]["val_loss"]) == EVALS
    assert [n for _, _, n in equiv_runs[1]["hellaswag"]] == [7] * HELLASWAG_EVALS
    assert equiv_runs[1]["loss"][-1] < equiv_runs[1]["loss"][0]
    for n in (2, 4):
        assert_bitwise_same_run(equiv_runs[n], equiv_runs[1])


@pytest.fixture(scope="module")
def default_mode_runs(equiv_and_default_mode_runs):
    """The EQUIV config without exact_reduction, at world sizes 1 and 2."""
    return equiv_and_default_mode_runs[1]


def test_default_mode_agrees_to_rounding_then_drifts(default_mode_runs, equiv_runs):
    """What exact_reduction is for: without it, world sizes 1 and 2 agree over the first steps
    and then differ, so the bitwise tests above can fail."""
    runs = default_mode_runs
    np.testing.assert_allclose(runs[2]["loss"][:6], runs[1]["loss"][:6], rtol=1e-5)
    np.testing.assert_allclose(runs[1]["loss"][:6], equiv_runs[1]["loss"][:6], rtol=1e-5)
    assert runs[2]["max_param_diff"] > 0.0
    assert runs[2]["loss"] != runs[1]["loss"]


def test_check_script_prints_the_table(equiv_runs, default_mode_runs, capsys):
    print_table(equiv_runs)
    out = capsys.readouterr().out
    assert "|diff| world size 2" in out and "|diff| world size 4" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == STEPS
    assert "max |diff| of weights" in out
    assert "bitwise identical at every world size" in out
    print_table(default_mode_runs)
    out = capsys.readouterr().out
    assert "--exact_reduction=true sums in float64" in out
    for name in ("loss", "val_loss"):  # each world size's largest difference, labelled with it
        worst = max(abs(a - b) for a, b in zip(default_mode_runs[2][name], default_mode_runs[1][name]))
        assert worst > 0 and f"max |diff| of {name:8s}: world size 2: {worst:.3e}\n" in out
    print_table({n: {**run, "val_loss": []} for n, run in equiv_runs.items()})  # runs that never evaluated
    out = capsys.readouterr().out
    assert "max |diff| of val_loss: world size 2: 0.000e+00, world size 4: 0.000e+00\n" in out


def test_dropout_masks_depend_on_the_micro_batch_not_the_rank(equiv_data_dir, equiv_runs, tmp_path):
    """The same run with dropout 0 differs: dropout is really on, and the match above is not
    because every rank drew the same masks (with identical masks, world size 2 would differ)."""
    no_dropout = compare([*EQUIV, f"--data_dir={equiv_data_dir}", "--dropout=0.0", "--max_steps=1"],
                         [1], tmp_path)
    assert abs(no_dropout[1]["loss"][0] - equiv_runs[1]["loss"][0]) > 1e-3


# The probes count DDP's all-reduces with a comm hook of their own, in the default mode.
PROBE_STEPS = 6
PROBE = [*EQUIV, "--exact_reduction=false", f"--max_steps={PROBE_STEPS}"]


def probe(args, nproc, out, late_toggle=False):
    """Runs tests/ddp_probe.py under torchrun; returns the per-rank probe records and the log."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PROBE_OUT=str(out), PYTHONPATH=str(ROOT),
               PROBE_LATE_TOGGLE="1" if late_toggle else "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "ddp_probe.py"), *args, f"--out_dir={out}", "--resume=never"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return ranks, read_log(out)[0]


def test_gradients_are_all_reduced_once_per_step_and_the_logged_loss_is_the_mean(equiv_data_dir, tmp_path):
    """DDP all-reduces each bucket once per step, on its last micro-step; the logged loss is the mean
    over both ranks' micro-batches; and a stop signal that reached one rank alone stops both."""
    ranks, steps = probe([*PROBE, f"--data_dir={equiv_data_dir}"], 2, tmp_path)
    assert [rank["stopped"] for rank in ranks] == [[True], [True]]
    grad_accum_steps = 4
    for rank in ranks:
        per_step, current = [], []
        for event in rank["events"]:
            if event == "step":
                per_step.append(current)
                current = []
            else:
                current.append(int(event.split()[1]))
        assert len(per_step) == PROBE_STEPS
        for buckets in per_step:
            # every bucket exactly once: DDP all-reduced on the last micro-step only, not on 4
            assert sorted(buckets) == list(range(len(buckets))), buckets
        assert all(per_step)  # and it did all-reduce on every step
    # the logged loss is the mean over both ranks' micro-batch losses of the step
    micro = np.array([rank["micro_losses"] for rank in ranks])  # (ranks, steps * grad_accum_steps)
    micro = micro.reshape(2, PROBE_STEPS, grad_accum_steps)
    np.testing.assert_allclose([s["loss"] for s in steps], micro.mean(axis=(0, 2)), rtol=1e-6)
    assert not np.allclose(micro[0], micro[1])  # the ranks saw different data


def test_sync_flag_set_after_the_forward_is_caught(equiv_data_dir, default_mode_runs, tmp_path):
    """build-nanogpt #30: with the flag set after the forward, DDP syncs the first micro-step's
    gradients only. The equivalence check above must see that as a different run."""
    ranks, steps = probe([*PROBE, f"--data_dir={equiv_data_dir}"], 2, tmp_path, late_toggle=True)
    losses = [s["loss"] for s in steps]
    reference = default_mode_runs[1]["loss"][:PROBE_STEPS]
    assert losses[0] == pytest.approx(reference[0], rel=1e-5)  # the same first forward
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(losses, reference, rtol=1e-5)


@pytest.mark.compat
def test_two_nodes_with_c10d_rendezvous_match_one_process(equiv_data_dir, equiv_runs, tmp_path):
    """Two torchrun agents on one machine, as two nodes of one process each: RANK 1 has
    LOCAL_RANK 0, and prints no step line, as rank 0 prints them for the run."""
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
    assert sorted(f"step {STEPS:5d}/{STEPS} | loss: " in output for output in outputs) == [False, True]
    steps, evals = read_log(tmp_path)
    assert [s["loss"] for s in steps] == equiv_runs[1]["loss"]
    assert [e["val_loss"] for e in evals] == equiv_runs[1]["val_loss"]
