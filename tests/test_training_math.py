"""The arithmetic of a training step, against what it should be: the gradient is the mean loss's
over the whole batch, however it is split into ranks and micro-steps; the learning rate follows
its schedule; weight decay falls on the 2-D weights alone; a non-finite step changes nothing;
float16 logs float32's gradient norm; the val loss is the mean over val_batches at any world size."""

import contextlib
import dataclasses
import io
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch._subclasses.fake_tensor import FakeTensor

import train_gpt2
from conftest import TINY, read_log, record_host_reads, recording, run_training, train_together
from gpt2_ddp import checkpoints, precision

STEPS = 4
# 4 micro-batches of 2 x 16 tokens a step: 4 micro-steps on one process, 2 on each of two ranks
ARGS = [*TINY, "--total_batch_size=128", f"--max_steps={STEPS}", "--eval_interval=0"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from conftest import make_shards
    path = tmp_path_factory.mktemp("math_data")
    make_shards(path)
    return path


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """The records of ARGS trained by 1 process (4 micro-steps) and by 2 ranks (2 each), in the
    default mode, and by 2 ranks in exact mode (which divides by all 4 micro-batches)."""
    paths = {name: tmp_path_factory.mktemp(name) for name in ("1x4", "2x2", "exact")}
    run_training([*ARGS, f"--data_dir={data_dir}", f"--out_dir={paths['1x4']}"])
    train_together([[*ARGS, *extra, f"--data_dir={data_dir}", f"--out_dir={paths[name]}"]
                    for name, extra in (("2x2", []), ("exact", ["--exact_reduction=true"]))], 2)
    return {name: read_log(path)[0] for name, path in paths.items()}


def test_grad_norm_of_one_process_equals_two_ranks(runs):
    """The gradient is the mean over the step's micro-batches whether one process accumulates 4 or
    two ranks 2 each: the logged norms (before clipping) agree to float32 rounding (rtol 1e-5)."""
    np.testing.assert_allclose([r["grad_norm"] for r in runs["1x4"]],
                               [r["grad_norm"] for r in runs["2x2"]], rtol=1e-5)


def mean_loss_grad_norm(data_dir, config):
    """The 2-norm of the gradient of the mean cross-entropy over step 1's micro-batches, computed
    apart from the training loop: the initial weights (build_model's, as the run's), the batch
    read straight from the shards (the train split, in name order, as one stream), one forward of
    all its sequences, float64 sums."""
    B, T = config.micro_batch_size, config.seq_len
    n = config.total_batch_size // (B * T)
    stream = np.concatenate([np.fromfile(p, dtype="<u2", offset=1024)
                             for p in sorted(data_dir.glob("*_train_*.bin"))]).astype(np.int64)
    sequences = torch.from_numpy(stream[:n * B * T + 1])
    x = sequences[:-1].view(n * B, T)
    y = sequences[1:].view(n * B, T)
    model = train_gpt2.build_model(config, torch.device("cpu"))
    logits, _ = model(x)
    F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).backward()
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))


@pytest.mark.parametrize("name", ["2x2", "exact"])
def test_step_1_grad_norm_is_that_of_the_mean_loss(runs, data_dir, name):
    """Step 1's logged gradient norm equals the norm of the gradient of the mean loss over its
    whole batch, computed without the loop (rtol 1e-5, float32 rounding): the loop divides each
    micro-step's loss by the right count, in the default mode and in exact mode (2 ranks each)."""
    config = train_gpt2.load_config([*ARGS, f"--data_dir={data_dir}"])
    assert runs[name][0]["grad_norm"] == pytest.approx(mean_loss_grad_norm(data_dir, config),
                                                       rel=1e-5)


def test_float16_logs_the_grad_norm_of_float32(runs, data_dir, tmp_path, one_thread):
    """float16 unscales the gradient before it clips and logs its norm: ARGS trained under float16's
    loss scaler (scale 65536) log the gradient norms of the float32 run on the same weights and
    batches (runs' 1x4) to float16's rounding (rtol 1e-2), and above grad_clip, where clipping acts.
    A norm taken of the scaled gradient is 65536 times as large."""
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_gpt2.main([*ARGS, "--dtype=float16", f"--data_dir={data_dir}",
                                f"--out_dir={tmp_path}"]) == 0
    steps = read_log(tmp_path)[0]
    assert [s["loss_scale"] for s in steps] == [2.0**16] * STEPS
    float32 = [r["grad_norm"] for r in runs["1x4"]]
    assert min(float32) > train_gpt2.Config.grad_clip
    np.testing.assert_allclose([s["grad_norm"] for s in steps], float32, rtol=1e-2)


def evaluate_on_ranks(model, data_dir, val_batches, world_size, monkeypatch):
    """(each rank's val loss, the global micro-batches each rank read) of train_gpt2.evaluate() run in
    this process as every rank of `world_size` in turn, its all-reduce summing every rank's sums:
    one pass gathers each rank's sums, a second hands each rank their total."""
    loaders = [train_gpt2.DataLoader(data_dir, "val", 2, 16, rank, world_size, torch.device("cpu"))
               for rank in range(world_size)]
    read = [[] for _ in loaders]

    def recording(get_batch, batches):
        def get(g):
            batches.append(g)
            return get_batch(g)
        return get

    for loader, batches in zip(loaders, read):
        monkeypatch.setattr(loader, "get_batch", recording(loader.get_batch, batches))
    sums = []
    monkeypatch.setattr(train_gpt2.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(train_gpt2.dist, "all_reduce", lambda total: sums.append(total.clone()))
    autocast = precision.autocast("float32", torch.device("cpu"))
    for loader in loaders:
        train_gpt2.evaluate(model, loader, val_batches, autocast, torch.float32)
    monkeypatch.setattr(train_gpt2.dist, "all_reduce", lambda total: total.copy_(sum(sums)))
    for batches in read:
        batches.clear()
    losses = [train_gpt2.evaluate(model, loader, val_batches, autocast, torch.float32) for loader in loaders]
    return losses, read


@pytest.mark.parametrize("val_batches, world_size", [(3, 2), (5, 4)])
def test_the_val_loss_is_the_mean_over_val_batches_at_any_world_size(data_dir, monkeypatch, val_batches,
                                                                     world_size):
    """Every rank's val loss is the mean cross-entropy over exactly the first val_batches micro-batches
    of the val split, computed apart from evaluate() in one forward of their tokens read straight
    from the shard (rtol 1e-5, float32 rounding), where val_batches does not divide over the ranks
    too: micro-batch g is read on rank g % world_size, every rank reads as many, and those past
    val_batches weigh nothing. evaluate() hands the model back in training mode (the next steps'
    dropout)."""
    config = train_gpt2.load_config(TINY)
    torch.manual_seed(0)
    model = train_gpt2.GPT(config)
    losses, read = evaluate_on_ranks(model, data_dir, val_batches, world_size, monkeypatch)
    assert all(m.training for m in model.modules())
    per_rank = math.ceil(val_batches / world_size)
    assert read == [list(range(rank, per_rank * world_size, world_size)) for rank in range(world_size)]
    tokens = np.fromfile(data_dir / "tiny_val_000000.bin", dtype="<u2", offset=1024).astype(np.int64)
    stream = torch.from_numpy(tokens[:val_batches * 2 * 16 + 1])
    model.eval()
    with torch.no_grad():
        logits, _ = model(stream[:-1].view(-1, 16))
    expected = F.cross_entropy(logits.view(-1, logits.size(-1)), stream[1:]).item()
    for loss in losses:
        assert loss == pytest.approx(expected, rel=1e-5)


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    """GPT-3's schedule (appendix B): linear warmup to max_lr, then a cosine to min_lr at
    max_steps, never rising after warmup."""
    config = train_gpt2.load_config(["--warmup_steps=10", "--max_steps=110", "--max_lr=1.0",
                                     "--min_lr=0.1"])
    lr = [train_gpt2.get_lr(step, config) for step in range(config.max_steps + 1)]
    assert lr[0] == pytest.approx(0.1) and lr[4] == pytest.approx(0.5) and lr[9] == pytest.approx(1.0)
    assert lr[10] == pytest.approx(1.0) and lr[60] == pytest.approx(0.55)  # the decay's midpoint
    assert lr[109] == pytest.approx(0.1, abs=1e-3) and lr[110] == 0.1
    assert lr[10] <= lr[9]
    assert all(later < earlier for earlier, later in zip(lr[10:], lr[11:]))  # min_lr at max_steps alone


def test_logged_lr_is_the_schedule(runs, data_dir):
    """Step N's record (the N-th update) logs get_lr(N - 1): updates are counted from 0 by the
    schedule and from 1 in the log."""
    config = train_gpt2.load_config([*ARGS, f"--data_dir={data_dir}"])
    for name in runs:
        assert [r["lr"] for r in runs[name]] == [train_gpt2.get_lr(s - 1, config)
                                                 for s in range(1, STEPS + 1)]


def test_a_resume_names_every_lr_key_it_changes(capsys):
    """max_steps and warmup_steps are named in test_faults.py; the lrs reshape the schedule too."""
    config = train_gpt2.load_config(["--optimizer=muon"])
    for key in ("max_lr", "min_lr", "muon_lr"):
        saved = {**dataclasses.asdict(config), key: getattr(config, key) / 2}
        train_gpt2.note_schedule(config, saved, 10)
        assert (f"the schedule changes from the checkpoint's: {key} {saved[key]} -> {getattr(config, key)}; "
                f"the lr of step 11 is ") in capsys.readouterr().out
    saved = {**dataclasses.asdict(config), "max_steps": config.max_steps * 2}  # warmup's lrs stay
    train_gpt2.note_schedule(config, saved, 0)
    assert capsys.readouterr().out.endswith(
        f"max_steps {saved['max_steps']} -> {config.max_steps}; the lr of step 1 is "
        f"{train_gpt2.get_lr(0, config):.4e}, as before; later steps follow the new schedule\n")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_weight_decay_falls_on_2d_weights_alone(optimizer):
    """As GPT-2 and nanoGPT: the embeddings' and matmuls' weights decay; biases and LayerNorm gains
    do not. With Muon the blocks' matrices are Muon's, which decays none, so only the embeddings
    (GPT-2's wte, tied to lm_head, and wpe) decay. Told by module type, whatever the layout.
    AdamW takes the config's weight_decay and betas, in order, and GPT-3's eps."""
    config = train_gpt2.load_config([*TINY, f"--optimizer={optimizer}", "--weight_decay=0.3",
                                     "--beta1=0.8", "--beta2=0.99"])
    model = train_gpt2.GPT(config)
    names = {id(p): name for name, p in model.named_parameters()}  # a tied weight has one name
    groups = model.configure_optimizers(config, "cpu").param_groups
    decayed = {names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    adamw = [g for g in groups if "betas" in g]
    assert [(g["betas"], g["eps"]) for g in adamw] == [((0.8, 0.99), 1e-8)] * 2
    assert sorted(g["weight_decay"] for g in adamw) == [0.0, 0.3]
    matrices = {names[id(m.weight)] for name, m in model.named_modules()
                if isinstance(m, torch.nn.Embedding) or (isinstance(m, torch.nn.Linear) and (
                    optimizer == "adamw" or not name.startswith("transformer.h.")))}
    assert "transformer.wte.weight" in matrices
    assert decayed == matrices
    assert not {n for n in decayed if n.endswith(".bias") or ".ln_" in n}


def one_update(config, changes=0.0):
    """A tiny GPT and its optimizer after one micro-batch's backward and train_gpt2.update() at lr
    1e-3, with `changes` ranks having met a changed shard: (model, optimizer, weights before,
    update's results)."""
    torch.manual_seed(0)
    model = train_gpt2.GPT(config)
    optimizer = model.configure_optimizers(config, "cpu")
    x = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(x, x)[1]
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = precision.grad_scaler("float32", "ddp", torch.device("cpu"))
    flags = torch.stack([loss.detach(), torch.tensor(0.0), torch.tensor(changes)])  # loss sum, stops, changes
    results = train_gpt2.update(optimizer, scaler, torch.nn.utils.clip_grad_norm_, model, 1e-3, config,
                                flags, 1)
    return model, optimizer, before, results


def test_a_step_that_met_a_changed_shard_updates_no_weight():
    """update() skips the optimizer step when a rank met a changed shard, though the loss and the
    gradient norm are finite: every weight stays as it was, while the same step without the change
    moves them."""
    config = train_gpt2.load_config(TINY)
    model, _, before, results = one_update(config, changes=1.0)
    assert results[3] == 1 and math.isfinite(results[0]) and math.isfinite(results[2])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model, _, before, _ = one_update(config)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_each_parameter_group_gets_the_schedules_lr_times_its_scale():
    """update() sets each group's lr to the schedule's times its lr_scale: AdamW's groups the
    schedule's lr, Muon's that lr times muon_lr / max_lr."""
    config = train_gpt2.load_config([*TINY, "--optimizer=muon", "--muon_lr=0.05"])
    _, optimizer, _, _ = one_update(config)
    scale = config.muon_lr / config.max_lr
    expected = [1e-3, 1e-3, 1e-3 * scale, 1e-3 * scale]
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(expected, rel=1e-12)


class NanGradient(torch.autograd.Function):
    """The identity whose backward gives NaN: a finite loss with a non-finite gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


POISONS = {"nan_loss": lambda loss: loss * float("nan"), "nan_gradient": NanGradient.apply}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_skipped_non_finite_step_changes_no_weight_and_no_optimizer_state(data_dir, tmp_path,
                                                                           monkeypatch, poison, dtype):
    """A forward patched to make the last update's loss NaN, or its gradient NaN under a finite
    loss: the update is skipped and logged so, and the checkpoint saved after it holds bitwise the
    weights and optimizer state of the one before (which an update does change). Under float16 the
    NaN gradient is what an overflow looks like to the loss scaler, and is logged as one; the NaN
    loss is not."""
    forward, calls = train_gpt2.GPT.forward, []

    def poisoned(self, idx, targets=None, cache=None):
        logits, loss = forward(self, idx, targets, cache)
        if self.training and targets is not None and not isinstance(loss, FakeTensor):  # not the plan's
            calls.append(1)
            if len(calls) > 2 * 4:  # updates 1 and 2 take 4 micro-steps each
                loss = POISONS[poison](loss)
        return logits, loss

    monkeypatch.setattr(train_gpt2.GPT, "forward", poisoned)
    assert train_gpt2.main([*TINY, "--total_batch_size=128", "--max_steps=3", "--eval_interval=0",
                            "--checkpoint_interval=1", "--keep_checkpoints=0", f"--dtype={dtype}",
                            f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]) == 0
    steps = read_log(tmp_path)[0]
    assert [r.get("skipped", False) for r in steps] == [False, False, True]
    assert steps[-1].get("overflow", False) == (dtype == "float16" and poison == "nan_gradient")

    def tensors(step):
        ckpt = checkpoints.load(tmp_path / f"ckpt_{step:07d}.pt")
        return {**{("model", k): v for k, v in ckpt["model"].items()},
                **{(i, k): v for i, s in ckpt["optimizer"]["state"].items() for k, v in s.items()}}

    first, before, after = map(tensors, (1, 2, 3))
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert not all(torch.equal(first[k], before[k]) for k in before)


@pytest.mark.parametrize("dtype, optimizer", [("float32", "adamw"), ("float16", "muon")])
def test_a_step_reads_the_device_once_after_its_update_and_the_next_batch_are_queued(
        data_dir, tmp_path, monkeypatch, dtype, optimizer):
    """From one update's start to the next, the loop reads one tensor's values on the host (the
    step's loss, flags, norm and loss scale together), after the optimizer step is queued and the
    next step's first micro-batch is read and its copy queued: on a GPU that is the step's one sync,
    and the GPU never waits for the host's launches or reads. Counted on the CPU by wrapping every
    way a tensor's value reaches Python."""
    events = []
    record_host_reads(monkeypatch, events)
    for owner, name, what in ((train_gpt2.Metrics, "step_begins", "begin"),
                              (train_gpt2.precision, "step_unless", "step"),
                              (train_gpt2.DataLoader, "prefetch", "prefetch")):
        monkeypatch.setattr(owner, name, recording(events, what, getattr(owner, name)))
    assert train_gpt2.main([*ARGS, "--max_steps=5", f"--dtype={dtype}", f"--optimizer={optimizer}",
                            f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]) == 0
    steps = [s.split() for s in " ".join(events[events.index("begin"):]).split("begin")[1:]]
    assert steps[:-1] == [["step", "prefetch", "read"]] * 4
    assert steps[-1][:2] == ["step", "read"]  # the last: nothing to prefetch; then the save
