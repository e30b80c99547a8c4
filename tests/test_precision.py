"""dtype: bfloat16 and float16 autocast, float16 with torch's loss scaler, in every sharding mode and
with Muon, on the CPU, as a GPU runs them; what dtype=auto picks, and dtypes that cannot run.

The runs are the EQUIV config (exact_reduction, dropout, biases, HellaSwag, a sample) for 8 steps,
launched for real: tests/fp16_probe.py around train_gpt2.py, under torchrun at world size 2 (RUNS).
In each dtype, ddp's and zero2's runs are bitwise ddp's one-process run, and fsdp's two processes
are bitwise its one. fsdp casts the parameters to the dtype (FSDP's mixed precision) where autocast
casts per op, so its losses agree with ddp's to the dtype's rounding (rtol 1e-3), not bitwise.
float16's runs overflow in steps 2 to 5, in one rank's part of the gradient (tests/fp16_probe.py).
"""

import contextlib
import io
import json
import re
import shutil

import pytest
import torch

import fp16_probe
from conftest import EQUIV, hellaswag_args, one_torch_thread, train_together
from gpt2_ddp import checkpoints, precision, runs
from gpt2_ddp.configurator import UserError
from scripts.check_equivalence import max_diff
from train_gpt2 import MAX_SKIPPED_STEPS, load_config
import train_gpt2

STEPS, CHECKPOINT_STEP = 8, 6
OVERFLOW_STEPS = [2, 3, 4, 5]  # more in a row than MAX_SKIPPED_STEPS, yet not a divergence
# each dtype runs every mode, and each mode runs at world sizes 1 and 2 in one dtype or both: ddp's
# one process is the reference of ddp's and zero2's runs, fsdp's of fsdp's; Muon in some of them
RUNS = {"bfloat16": [("ddp", "adamw", 1), ("zero2", "adamw", 1), ("fsdp", "muon", 1),
                     ("ddp", "adamw", 2), ("fsdp", "muon", 2)],
        "float16": [("ddp", "muon", 1), ("fsdp", "adamw", 1), ("zero2", "muon", 2),
                    ("fsdp", "adamw", 2)]}


def precision_args(data_dir, dtype, mode, optimizer):
    return [*EQUIV, f"--data_dir={data_dir}", *hellaswag_args(data_dir), f"--dtype={dtype}",
            f"--sharding={mode}", f"--optimizer={optimizer}", f"--max_steps={STEPS}",
            "--eval_interval=4", "--hellaswag_interval=8", "--sample_interval=8", "--sample_prompt=ab",
            f"--checkpoint_interval={CHECKPOINT_STEP}"]


def in_process(args, out, overflow_steps=()):
    """Trains `args` into `out` in one process, this one (no interpreter and torch to start), with
    tests/fp16_probe.py's instruments; returns result()."""
    records, restore = fp16_probe.instrument(set(overflow_steps), rank=0)
    console = io.StringIO()
    try:
        with one_torch_thread(), contextlib.redirect_stdout(console):
            assert train_gpt2.main([*args, f"--out_dir={out}"]) == 0
    finally:
        restore()
    return result(out, console.getvalue(), [records])


def under_torchrun(probed):
    """Trains each of `probed`, (args, out, overflow_steps), into its out at world size 2, all in one
    launch of torchrun with tests/fp16_probe.py the workers' script; returns result() of each."""
    stdout = train_together([{"args": [*args, f"--out_dir={out}"], "out": str(out),
                              "overflow_steps": list(overflow_steps)} for args, out, overflow_steps in probed],
                            2, script="fp16_probe.py")
    consoles = dict(part.split("\n", 1) for part in stdout.split(fp16_probe.MARK)[1:])
    return [result(out, consoles[str(out)], [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)])
            for _, out, _ in probed]


def result(out, console, ranks):
    """A run's log's train records, val losses and HellaSwag records, its sample, final weights,
    each rank's probe records, its console and out."""
    steps, evals, hellaswag = runs.split_records(runs.read_log(out))
    return {"steps": steps, "val_loss": [e["val_loss"] for e in evals], "hellaswag": hellaswag,
            "sample": [line for line in console.splitlines() if line.startswith("sample at step")],
            "model": torch.load(checkpoints.listed(out)[-1], weights_only=True)["model"],
            "ranks": ranks, "stdout": console, "out": out}


@pytest.fixture(scope="module")
def precision_runs(equiv_data_dir, tmp_path_factory):
    """{dtype: {(mode, world_size): result()}}, float16's with its overflows."""
    runs = {(dtype, mode, n): (precision_args(equiv_data_dir, dtype, mode, optimizer),
                               tmp_path_factory.mktemp(f"{dtype}_{mode}_{n}"),
                               OVERFLOW_STEPS if dtype == "float16" else ())
            for dtype in RUNS for mode, optimizer, n in RUNS[dtype]}
    launched = [key for key in runs if key[2] == 2]
    results = dict(zip(launched, under_torchrun([runs[key] for key in launched])))
    results.update({key: in_process(*run) for key, run in runs.items() if key[2] == 1})
    return {dtype: {(mode, n): results[(dtype, mode, n)] for mode, _, n in RUNS[dtype]} for dtype in RUNS}


def assert_bitwise_same(run, reference):
    for key in ("val_loss", "hellaswag", "sample"):
        assert run[key] == reference[key], key
    for field in ("loss", "grad_norm", "loss_scale", "skipped"):
        assert [s.get(field) for s in run["steps"]] == [s.get(field) for s in reference["steps"]], field
    assert max_diff(run["model"], reference["model"]) == 0.0


@pytest.mark.compat
@pytest.mark.parametrize("dtype", RUNS)
def test_every_mode_trains_bitwise_the_same_run_at_world_sizes_1_and_2(dtype, precision_runs,
                                                                       equiv_runs):
    """In exact mode each dtype keeps the promise of float32: ddp's and zero2's runs are ddp's one
    process, fsdp's two are its one (losses, gradient norms, val losses, HellaSwag, the sample, the
    final weights). The runs are autocast's, not float32's (equiv_runs): the
    step-1 loss and the step-0 val loss, on the same weights and batches, differ; fsdp's parameter
    cast makes its losses differ from ddp's, to rounding; Muon's runs log its lr."""
    runs_ = precision_runs[dtype]
    ddp, fsdp = runs_[("ddp", 1)], runs_[("fsdp", 1)]
    for (mode, n), run in runs_.items():
        if (mode, n) not in (("ddp", 1), ("fsdp", 1)):
            assert_bitwise_same(run, fsdp if mode == "fsdp" else ddp)
    float32 = equiv_runs[1]
    for run in (ddp, fsdp):
        assert len(run["steps"]) == STEPS and len(run["hellaswag"]) == 2 and len(run["sample"]) == 1
        assert run["steps"][0]["loss"] != float32["loss"][0]
        assert run["steps"][0]["loss"] == pytest.approx(float32["loss"][0], rel=1e-3)
        assert run["val_loss"][0] != float32["val_loss"][0]
    assert fsdp["steps"][0]["loss"] != ddp["steps"][0]["loss"]
    assert fsdp["steps"][0]["loss"] == pytest.approx(ddp["steps"][0]["loss"], rel=1e-3)
    for mode, optimizer, n in RUNS[dtype]:
        assert ("muon_lr" in runs_[(mode, n)]["steps"][0]) == (optimizer == "muon"), (mode, n)
        assert ("loss_scale" in runs_[(mode, n)]["steps"][0]) == (dtype == "float16")


@pytest.mark.compat
@pytest.mark.parametrize("mode", ["zero2", "fsdp"])
def test_float16_overflows_skip_the_update_halve_the_scale_and_the_run_goes_on(mode, precision_runs):
    """Four overflows in a row (more than MAX_SKIPPED_STEPS) are skipped and logged with the halved
    scale, and the run ends normally. In zero2 and fsdp only rank 0 holds the overflowing element,
    yet both ranks skip the same updates and keep the same scale: the found-inf flag is all-reduced."""
    run = precision_runs["float16"][(mode, 2)]
    assert len(OVERFLOW_STEPS) > MAX_SKIPPED_STEPS
    scales = [2.0**16] + [2.0**16 / 2**k for k in range(1, 5)] + [2.0**12] * 3
    assert [s["loss_scale"] for s in run["steps"]] == scales
    for record in run["steps"]:
        overflow = record["step"] in OVERFLOW_STEPS
        assert record.get("skipped", False) == record.get("overflow", False) == overflow
    assert "update skipped: float16 overflow, loss scale halved to 32768" in run["stdout"]
    assert "diverged" not in run["stdout"] and run["steps"][-1]["step"] == STEPS
    ranks = run["ranks"]
    assert [r["stepped"] for r in ranks[0]] == [s not in OVERFLOW_STEPS for s in range(1, STEPS + 1)]
    assert ranks[1] == ranks[0]
    assert [r["scale"] for r in ranks[0]] == scales


def copy_checkpoint(run, out):
    """`run`'s checkpoint of CHECKPOINT_STEP and its log, copied into out to resume from."""
    shutil.copy(checkpoints.path_of(run["out"], CHECKPOINT_STEP), out)
    shutil.copy(run["out"] / "log.jsonl", out)


@pytest.mark.compat
def test_a_float16_resume_continues_the_loss_scale_bitwise_in_another_mode_and_world_size(
        precision_runs, equiv_data_dir, tmp_path):
    """zero2's two processes saved step 6 at a loss scale of 4096, after their overflows; one ddp
    process resumes it and logs the same steps 7 and 8, loss scale included, and ends with the
    same weights."""
    reference = precision_runs["float16"][("zero2", 2)]
    saved = torch.load(checkpoints.path_of(reference["out"], CHECKPOINT_STEP), weights_only=True)
    assert saved["scaler"]["scale"] == 2.0**12 and saved["config"]["dtype"] == "float16"
    copy_checkpoint(reference, tmp_path)
    resumed = in_process(precision_args(equiv_data_dir, "float16", "ddp", "muon"), tmp_path)
    assert "resumed from" in resumed["stdout"] and "dtype changes" not in resumed["stdout"]
    fields = ("step", "loss", "grad_norm", "lr", "loss_scale")
    assert [[s[f] for f in fields] for s in resumed["steps"]] == \
        [[s[f] for f in fields] for s in reference["steps"]]
    assert max_diff(resumed["model"], reference["model"]) == 0.0


def test_a_resume_in_another_dtype_says_so_and_starts_the_scaler_anew(precision_runs, equiv_data_dir,
                                                                       tmp_path):
    """bfloat16's checkpoint resumed in float16: one line says so, and the loss scaler starts at
    torch's initial scale."""
    copy_checkpoint(precision_runs["bfloat16"][("ddp", 1)], tmp_path)
    resumed = in_process(precision_args(equiv_data_dir, "float16", "ddp", "adamw"), tmp_path)
    assert ("the dtype changes from the checkpoint's bfloat16 to float16; the loss scaler starts "
            "anew") in resumed["stdout"]
    assert [s.get("loss_scale") for s in resumed["steps"]] == [None] * CHECKPOINT_STEP + [2.0**16] * 2


class FakeGPU:
    """torch.cuda's answers for one GPU, by name and compute capability."""

    def __init__(self, monkeypatch, name, capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
        monkeypatch.setattr(precision, "check_runs", lambda dtype, device: None)


@pytest.mark.parametrize("name, capability, picked, why", [
    ("NVIDIA H100 80GB HBM3", (9, 0), "bfloat16", "has bfloat16 tensor cores"),
    ("NVIDIA A100-SXM4-40GB", (8, 0), "bfloat16", "has bfloat16 tensor cores"),
    ("Tesla V100-SXM2-16GB", (7, 0), "float16 with loss scaling", "lacks bfloat16 tensor cores"),
    ("Tesla T4", (7, 5), "float16 with loss scaling", "lacks bfloat16 tensor cores"),
])
def test_auto_picks_bfloat16_from_compute_capability_8_and_float16_before(monkeypatch, name, capability,
                                                                          picked, why):
    FakeGPU(monkeypatch, name, capability)
    config, line = precision.resolve(load_config([]), torch.device("cuda"))
    assert config.dtype == picked.split()[0]
    assert line == f"dtype {picked}: dtype=auto: {name} (compute capability {capability[0]}." \
                   f"{capability[1]}) {why}"
    if capability < (8, 0):
        gpu = re.escape(f"{name} (compute capability {capability[0]}.{capability[1]})")
        with pytest.raises(UserError, match=f"^--dtype=bfloat16: {gpu} has no bfloat16 tensor cores "
                                            rf"\(8\.0 and later do\); pass --dtype=float16, which scales "
                                            f"the loss, or --dtype=auto$"):
            precision.resolve(load_config(["--dtype=bfloat16"]), torch.device("cuda"))
    else:  # the major version decides: 8.0's minor of 0 is no reason to refuse
        config, line = precision.resolve(load_config(["--dtype=bfloat16"]), torch.device("cuda"))
        assert config.dtype == "bfloat16" and line == "dtype bfloat16: set by dtype=bfloat16"


def test_auto_runs_float32_on_the_cpu_and_mps_and_a_set_dtype_says_so(monkeypatch):
    config, line = precision.resolve(load_config([]), torch.device("cpu"))
    assert config.dtype == "float32" and line.startswith("dtype float32: dtype=auto on cpu")
    monkeypatch.setattr(precision, "check_runs", lambda dtype, device: None)  # no MPS here
    config, line = precision.resolve(load_config([]), torch.device("mps"))
    assert config.dtype == "float32" and line.startswith("dtype float32: dtype=auto on mps")
    for dtype in ("bfloat16", "float16", "float32"):
        config, line = precision.resolve(load_config([f"--dtype={dtype}"]), torch.device("cpu"))
        assert config.dtype == dtype and line.endswith(f": set by dtype={dtype}")


def test_a_dtype_this_torch_cannot_run_is_one_line(monkeypatch):
    """Where autocast or the loss scaler's unscale_ fails on the device (MPS on an older torch, say),
    the run stops in one line before any work; where torch turns autocast off with a warning, too."""
    def unsupported(scaler, optimizer):
        raise RuntimeError("_amp_foreach_non_finite_check_and_unscale_ not implemented\nstack")

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unsupported)
    version = re.escape(torch.__version__)
    with pytest.raises(UserError, match=rf"^--dtype=float16 does not run on cpu with torch {version} "
                                        r"\(_amp_foreach_non_finite_check_and_unscale_ not implemented\): "
                                        r"pass --dtype=float32$"):
        precision.check_runs("float16", torch.device("cpu"))
    with pytest.raises(UserError, match="^--dtype=float16 does not run on cpu"):  # as a run resolves it
        precision.resolve(load_config([*EQUIV, "--dtype=float16"]), torch.device("cpu"))
    monkeypatch.setattr(precision, "autocast", lambda dtype, device: torch.autocast("cpu", enabled=False))
    with pytest.raises(UserError, match=rf"^--dtype=bfloat16 does not run on cpu with torch {version} "
                                        r"\(autocast gave torch.float32\): pass --dtype=float32$"):
        precision.check_runs("bfloat16", torch.device("cpu"))


def test_an_overflow_below_a_loss_scale_of_1_is_a_divergence():
    """The scale after update(), read on the device with the step's other values: 0.5 was halved
    from 1, an overflow of the scaled gradient; 0.25 from 0.5, where the gradient overflows unscaled."""
    scaler = torch.amp.GradScaler("cpu", init_scale=0.5)
    scaler.scale(torch.ones(()))  # the scale is set lazily
    nan, scale = float("nan"), precision.scale(scaler, torch.device("cpu"))
    assert scale.item() == 0.5 and scale.device.type == "cpu"
    assert precision.overflowed(scaler, 2.0, nan, 0.5) and precision.overflowed(scaler, 2.0, float("inf"), 0.5)
    assert not precision.overflowed(scaler, nan, nan, 0.5) and not precision.overflowed(scaler, 2.0, 1.0, 0.5)
    assert not precision.overflowed(scaler, 2.0, nan, 0.25)
    error = precision.diverged(8, 3, 2.0, nan, 4, load_config([]))
    assert "not finite in steps 6-8 (loss 2.0, grad norm nan)" in str(error) and "(step 4)" in str(error)
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert not precision.overflowed(off, 2.0, nan, 1.0) and precision.scale(off, torch.device("cpu")).item() == 1
