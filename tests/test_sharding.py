"""sharding=zero2 and sharding=fsdp: bitwise the same run as ddp and as one process (with
exact_reduction, as test_equivalence.py), bitwise resume at any world size and from the other
modes' checkpoints, and optimizer state split over ranks."""

import gc
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import (EQUIV, assert_bitwise_same_run, compare, compare_together, hellaswag_args, read_log,
                      run_training)
from scripts import timeline
from train_gpt2 import GPT, load_config

# each sharded mode runs another seed than test_equivalence.py's, so that with ddp's three
# seeds are checked at world sizes 1, 2 and 4; a checkpoint at step 30 for the resume test. 40
# steps, not the 100 that test_equivalence.py needs to show the default mode's drift: exact mode
# is bitwise or not from the first step, and the 8 runs of 100 steps took 110 s of the suite
SEEDS = {"zero2": 2, "fsdp": 3}
STEPS = 40
RESUME_STEP = 30


def seeded_args(mode, data_dir):
    return [*EQUIV, f"--data_dir={data_dir}", f"--seed={SEEDS[mode]}", f"--max_steps={STEPS}",
            f"--checkpoint_interval={RESUME_STEP}", *hellaswag_args(data_dir)]


@pytest.fixture(scope="module")
def sharding_runs(equiv_data_dir, tmp_path_factory):
    """compare's runs of this file, with the folder of each, by name: each sharded mode at world
    sizes 1, 2 and 4 (its name) and ddp at 1 (ddp_{mode}), of that mode's seed; with activation
    checkpointing at 2 (checkpointed_{mode}); each mode without exact_reduction at 2 for 6 steps
    (default_{mode}); zero2 profiled at 2 for 7 steps (profiled). One launch a world size."""
    calls = {}
    for mode in SEEDS:
        args = seeded_args(mode, equiv_data_dir)
        calls[mode] = ([*args, f"--sharding={mode}"], [1, 2, 4])
        calls[f"ddp_{mode}"] = (args, [1])
        calls[f"checkpointed_{mode}"] = ([*args, f"--sharding={mode}", "--activation_checkpointing=true"],
                                         [2])
    for mode in ("ddp", *SEEDS):
        calls[f"default_{mode}"] = ([*EQUIV, f"--data_dir={equiv_data_dir}", "--exact_reduction=false",
                                     "--max_steps=6", f"--sharding={mode}"], [2])
    calls["profiled"] = ([*EQUIV, f"--data_dir={equiv_data_dir}", "--sharding=zero2", "--profile=true",
                          "--max_steps=7"], [2])
    outs = {name: tmp_path_factory.mktemp(name) for name in calls}
    results = compare_together([(args, world_sizes, outs[name])
                                for name, (args, world_sizes) in calls.items()])
    return {name: (result, outs[name]) for name, result in zip(calls, results)}


@pytest.fixture(scope="module")
def sharded_runs(sharding_runs):
    """For each sharded mode: its runs at world sizes 1, 2 and 4, and ddp's at world size 1, of
    that mode's seed, as check_equivalence.compare returns them, and the folder of its runs."""
    return {mode: (sharding_runs[mode][0], sharding_runs[f"ddp_{mode}"][0][1], sharding_runs[mode][1])
            for mode in SEEDS}


@pytest.mark.compat
@pytest.mark.parametrize("mode", ["zero2", "fsdp"])
def test_sharded_modes_train_bitwise_the_same_model_as_one_ddp_process(mode, sharded_runs):
    sharded, ddp, _ = sharded_runs[mode]
    for n in (1, 2, 4):
        assert_bitwise_same_run(sharded[n], ddp)


def test_optimizer_state_per_rank_shrinks_with_the_world_size(equiv_runs, equiv_runs_dir, sharded_runs):
    """AdamW keeps 8 bytes per parameter; zero2 and fsdp keep 1/world_size of it per rank.
    Rank 0's state is logged on the first step of the runs above."""
    def state_bytes(out):
        return read_log(out)[0][0]["optimizer_state_bytes"]

    full = state_bytes(equiv_runs_dir / "world_size_1")
    for n in (1, 2, 4):
        assert state_bytes(equiv_runs_dir / f"world_size_{n}") == full
        for mode in ("zero2", "fsdp"):
            sharded = state_bytes(sharded_runs[mode][2] / f"world_size_{n}")
            assert full / n <= sharded < full / n * 1.05 + 1024, (mode, n)


@pytest.mark.compat
def test_sharded_modes_in_the_default_mode_agree_with_ddp_to_rounding(sharding_runs):
    """Without exact_reduction each mode reduces in its own float32 order (so not bitwise), but
    the gradient is the same mean: losses and gradient norms agree with ddp's to rounding over
    the first steps. (torch 2.8's gloo summed where FSDP asked it to average: twice the norm.)"""
    runs = {mode: sharding_runs[f"default_{mode}"][0][2] for mode in ("ddp", "zero2", "fsdp")}
    for mode in ("zero2", "fsdp"):
        for key in ("loss", "grad_norm", "val_loss"):
            np.testing.assert_allclose(runs[mode][key], runs["ddp"][key], rtol=1e-5, err_msg=mode)


@pytest.mark.compat
@pytest.mark.parametrize("mode", ["zero2", "fsdp"])
def test_sharded_checkpoints_resume_bitwise_on_any_world_size(mode, sharded_runs, equiv_data_dir,
                                                              tmp_path):
    """The world size 2 run above, as if it had died after its checkpoint of step 30, resumed at
    world size 4 (fsdp) or 2 (zero2), where each rank's slices are copies of the loaded weights:
    bitwise the same run. Every mode saves whole tensors in torch.optim's format, so ddp resumes
    either in one process, bitwise."""
    runs, _, out_dir = sharded_runs[mode]
    full = out_dir / "world_size_2"
    ckpt = f"ckpt_{RESUME_STEP:07d}.pt"
    assert torch.load(full / ckpt, weights_only=True)["config"]["sharding"] == mode
    for world_size, resume_mode in [(4 if mode == "fsdp" else 2, mode), (1, "ddp")]:
        out = tmp_path / f"resumed_{world_size}_{resume_mode}"
        out.mkdir()
        shutil.copy(full / ckpt, out)
        shutil.copy(full / "log.jsonl", out)  # cut back to the checkpoint's step on resume
        proc = run_training([*seeded_args(mode, equiv_data_dir), f"--out_dir={out}",
                             f"--sharding={resume_mode}"], nproc=world_size)
        assert "resumed from" in proc.stdout
        steps, evals = read_log(out)
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        assert [s["loss"] for s in steps] == runs[2]["loss"]
        assert [e["val_loss"] for e in evals] == runs[2]["val_loss"]
        final = f"ckpt_{STEPS:07d}.pt"
        assert_same_tensors(torch.load(out / final, weights_only=True)["model"],
                            torch.load(full / final, weights_only=True)["model"])
    # the model check_equivalence compared is the run's last checkpoint's, not its step 30's
    assert_same_tensors(runs[2]["model"], torch.load(full / final, weights_only=True)["model"])


def assert_same_tensors(state, reference):
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)


@pytest.mark.compat
def test_zero2_trace_shows_reduce_scatters_launched_during_the_backward(sharding_runs, tmp_path):
    traces = sharding_runs["profiled"][1] / "world_size_2"
    events = json.load(open(traces / "trace_rank0.json"))["traceEvents"]
    syncing = [e for e in events if e.get("name") == "forward_backward_sync" and e.get("ph") == "X"]
    scatters = [e for e in events if "reduce_scatter" in str(e.get("name")) and e.get("ph") == "X"]
    assert syncing and scatters
    # each profiled syncing micro-step launched reduce-scatters before its backward had ended
    for window in syncing:
        inside = [e for e in scatters if window["ts"] <= e["ts"] < window["ts"] + window["dur"]]
        assert len(inside) > 1
    # scripts/timeline.py draws both ranks' traces: compute ranges, and the collectives by what
    # was issued (gloo runs a reduce-scatter as an all-reduce)
    for rank in (0, 1):
        compute, comm = timeline.lanes(json.load(open(traces / f"trace_rank{rank}.json")), steps=1)
        assert {kind for kind, _, _ in compute} == {"data", "forward", "backward", "optimizer"}
        assert {kind for kind, _, _ in comm} == {"reduce_scatter", "all_gather", "all_reduce"}
        n_params = len(list(GPT(load_config(EQUIV)).parameters()))
        assert sum(kind == "reduce_scatter" for kind, _, _ in comm) == n_params
        assert sum(kind == "all_gather" for kind, _, _ in comm) == n_params
    timeline.main([str(traces), "--out", str(tmp_path / "t.png")])
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("mode, world_size", [("ddp", 1), ("zero2", 2), ("fsdp", 2)])
def test_activation_checkpointing_changes_no_number(mode, world_size, equiv_runs, equiv_runs_dir,
                                                    equiv_data_dir, sharding_runs, tmp_path):
    """With activation_checkpointing the backward recomputes each block's forward, dropout 0.1
    included (its RNG state is restored): the losses, val losses and final weights are bitwise
    those of the same run without it. One world size per mode: in exact mode world sizes 1 and 2
    are bitwise the same run (tested above), so ddp at 1 and the sharded modes at 2 cover both."""
    if mode == "ddp":
        args = [*EQUIV, f"--data_dir={equiv_data_dir}", *hellaswag_args(equiv_data_dir)]
        result = compare([*args, "--activation_checkpointing=true"], [1], tmp_path)[1]
        reference, reference_dir, out = equiv_runs[1], equiv_runs_dir / "world_size_1", tmp_path
    else:
        result = sharding_runs[f"checkpointed_{mode}"][0][world_size]
        out = sharding_runs[f"checkpointed_{mode}"][1]
        reference = sharding_runs[mode][0][world_size]
        reference_dir = sharding_runs[mode][1] / f"world_size_{world_size}"
    for key in ("loss", "val_loss", "hellaswag"):
        assert result[key] == reference[key], key
    final = sorted(reference_dir.glob("ckpt_*.pt"))[-1].name
    assert_same_tensors(torch.load(out / f"world_size_{world_size}" / final, weights_only=True)["model"],
                        torch.load(reference_dir / final, weights_only=True)["model"])


@pytest.mark.compat
@pytest.mark.parametrize("sharding, exact", [("ddp", True), ("zero2", False), ("zero2", True),
                                             ("fsdp", False), ("fsdp", True)])
def test_each_swap_in_presents_ddps_interface_and_torch_optims(sharding, exact, monkeypatch):
    """data_parallel.wrap's model and optimizer, in a process group of one: a backward inside
    no_sync() leaves its gradient to accumulate, the synced one after it adds it in, and
    clip_grad_norm_ returns the norm of their sum as torch's does for a plain model (to float32
    rounding, 1e-5); the optimizer's step gives the plain AdamW's weights, its state_dict() holds
    whole tensors as torch.optim's does, and load_state_dict() takes it back; zero_grad() frees every
    gradient, zero2's slices' too. zero2's one rank steps its weights in place, with no
    reduce-scatter or all-gather."""
    import torch.distributed as dist

    from gpt2_ddp import data_parallel
    collectives = []
    for name in ("reduce_scatter_single", "all_gather_single"):
        monkeypatch.setattr(data_parallel, name, lambda *args, _f=getattr(data_parallel, name), **kwargs:
                            collectives.append(1) or _f(*args, **kwargs))
    config = load_config(["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16",
                          "--vocab_size=64", "--seq_len=16", "--compile=false", f"--sharding={sharding}",
                          "--dtype=float32",
                          f"--exact_reduction={str(exact).lower()}"])
    tokens = torch.randint(0, 64, (2, 3, 17), generator=torch.Generator().manual_seed(0))
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]  # (x, y), (3, 16)
    torch.manual_seed(0)
    plain = GPT(config)
    reference = plain.configure_optimizers(config, "cpu")
    for x, y in batches:
        plain(x, y)[1].backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)
    reference.step()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = optimizer = None
    try:
        torch.manual_seed(0)
        raw = GPT(config)
        model, optimizer = data_parallel.wrap(raw, raw.configure_optimizers(config, "cpu"), config,
                                              torch.device("cpu"))
        with model.no_sync():
            model(*batches[0])[1].backward()
        model(*batches[1])[1].backward()  # synced, as DDP is unless told otherwise
        assert model.module is not None
        torch.testing.assert_close(model.clip_grad_norm_(raw.parameters(), 1e9), norm, rtol=1e-5,
                                   atol=0)
        optimizer.step()
        assert collectives == [] or sharding != "zero2"
        state = raw.state_dict()
        for name, p in plain.state_dict().items():
            torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-7)
        saved = optimizer.state_dict()
        assert [g["lr"] for g in saved["param_groups"]] == [g["lr"] for g in optimizer.param_groups]
        expected = reference.state_dict()["state"]
        assert {i: {k: v.shape for k, v in s.items()} for i, s in saved["state"].items()} == \
            {i: {k: v.shape for k, v in s.items()} for i, s in expected.items()}
        optimizer.zero_grad(set_to_none=True)
        optimizer.load_state_dict(saved)
        assert all(p.grad is None for p in raw.parameters())
        assert all(p.grad is None for group in optimizer.param_groups for p in group["params"])  # zero2's slices
    finally:
        del model, optimizer
        gc.collect()  # as main() does: gloo aborts if work objects in reference cycles outlive the group
        dist.destroy_process_group()


def test_clip_grad_norm_sums_the_squares_in_float64():
    """Gradients whose squares pass float32's range (1e20**2) still give their true norm, 2e20, and
    are scaled to max_norm: clip_grad_norm sums squares in float64 off MPS, as its docstring says."""
    from gpt2_ddp.data_parallel import clip_grad_norm
    grads = [torch.full((3,), 1e20), torch.full((1,), -1e20)]
    norm = clip_grad_norm(grads, 1.0, sharded=False)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(2e20, rel=1e-6)
    torch.testing.assert_close(torch.cat(grads), torch.tensor([0.5, 0.5, 0.5, -0.5]), rtol=1e-5, atol=0)


def test_exact_ddp_in_one_process_starts_each_step_from_a_zero_sum():
    """ExactDDP without a process group, 2 micro-steps a step: each step's gradient is the sum of
    that step's micro-batches alone (to float32 rounding, 1e-5), the float64 sum of the step before
    left behind by its syncing micro-step."""
    from gpt2_ddp import data_parallel
    config = load_config(["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--vocab_size=64",
                          "--seq_len=16", "--compile=false", "--exact_reduction=true"])
    tokens = torch.randint(0, 64, (2, 2, 3, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = GPT(config)
    torch.manual_seed(0)
    raw = GPT(config)
    model = data_parallel.ExactDDP(raw, config, torch.device("cpu"))
    for step in tokens:
        plain.zero_grad(set_to_none=True)
        raw.zero_grad(set_to_none=True)
        for micro_step, t in enumerate(step):
            x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
            model.require_backward_grad_sync = micro_step == 1
            model(x, y)[1].backward()
            plain(x, y)[1].backward()
        for p, q in zip(raw.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
