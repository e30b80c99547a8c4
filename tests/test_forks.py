"""Two more forks of the model, made in this process as a researcher makes one in train_gpt2.py: a
SwiGLU MLP with RMSNorm in place of LayerNorm, and QK-norm with an lm_head of its own (not tied to
wte). Each trains with Muon through train_gpt2.main, resumes bit for bit, samples through
scripts/sample.py, is counted by the memory plan as a CPU step holds it, and splits between Muon and
AdamW by its own modules: nothing there assumes GPT-2's modules."""

import dataclasses
import io
import math
import shutil

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import train_gpt2
from conftest import TINY, change_qk, make_shards, read_log, tied_names, train_here
from gpt2_ddp import checkpoints, memory_plan
from gpt2_ddp.tokenizer import gpt2_encoding
from scripts import sample as sample_script
from test_muon import check_muon_split

STEPS = 2


class SwiGLU(nn.Module):
    """LLaMA's MLP (Shazeer 2020): c_proj(silu(c_gate(x)) * c_fc(x)), x (B, T, n_embd), its hidden
    width 8/3 * n_embd so that it holds about as many weights as GPT-2's MLP."""

    def __init__(self, config):
        super().__init__()
        hidden = 8 * config.n_embd // 3
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.c_proj.SCALE_INIT = 1
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x)))


class SwiGLUGPT(train_gpt2.GPT):
    """train_gpt2.GPT with a SwiGLU MLP in every block and RMSNorm in place of every LayerNorm."""

    def __init__(self, config):
        super().__init__(config)
        for block in self.transformer.h:
            block.ln_1, block.ln_2 = nn.RMSNorm(config.n_embd), nn.RMSNorm(config.n_embd)
            block.mlp = SwiGLU(config)
            if self.lm_head.weight.device.type != "meta":
                block.mlp.apply(self._init_weights)
        self.transformer.ln_f = nn.RMSNorm(config.n_embd)


class QKNormGPT(train_gpt2.GPT):
    """train_gpt2.GPT with q and k RMS-normalized per head (gains q_norm and k_norm in every attention)
    and an lm_head of its own, apart from wte."""

    def __init__(self, config):
        super().__init__(config)
        for block in self.transformer.h:
            attn = block.attn
            attn.q_norm, attn.k_norm = (nn.RMSNorm(config.n_embd // config.n_head) for _ in range(2))
            change_qk(attn, lambda q, k, start, attn=attn: (attn.q_norm(q), attn.k_norm(k)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if self.lm_head.weight.device.type != "meta":
            self.lm_head.apply(self._init_weights)


FORKS = {"swiglu_rmsnorm": SwiGLUGPT, "qk_norm_untied": QKNormGPT}
CONFIG = train_gpt2.load_config([*TINY, "--optimizer=muon", "--dtype=float32"])
GPT = train_gpt2.GPT  # the model the forks are made of


def use_fork(monkeypatch, fork):
    """train_gpt2 and scripts/sample.py build `fork` wherever they build a GPT, until the test ends."""
    for module in (train_gpt2, sample_script):
        monkeypatch.setattr(module, "GPT", fork)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("forks_data")
    make_shards(path)
    return path


@pytest.fixture(scope="module", params=list(FORKS))
def fork_runs(request, data_dir, tmp_path_factory):
    """train_gpt2.main in this process with a fork as its GPT and Muon: `whole` trains STEPS steps with
    a checkpoint after each; `resumed` is a copy of it without its last checkpoint, trained again to
    STEPS. Returns (the fork, whole, resumed, the console of each run)."""
    fork, root = FORKS[request.param], tmp_path_factory.mktemp(request.param)
    whole, resumed = root / "whole", root / "resumed"
    args = [*TINY, f"--data_dir={data_dir}", "--optimizer=muon", "--total_batch_size=64",
            f"--max_steps={STEPS}", "--checkpoint_interval=1", "--keep_checkpoints=0",
            f"--sample_interval={STEPS}", "--sample_prompt=ab"]
    consoles = {}
    with pytest.MonkeyPatch.context() as patch:
        use_fork(patch, fork)
        consoles[whole] = train_here([*args, f"--out_dir={whole}"])
        shutil.copytree(whole, resumed)
        checkpoints.path_of(resumed, STEPS).unlink()
        consoles[resumed] = train_here([*args, f"--out_dir={resumed}"])
    return fork, whole, resumed, consoles


def test_a_fork_trains_and_resumes_bit_for_bit(fork_runs, monkeypatch):
    """train() built the fork (its checkpoints hold the fork's keys, not GPT's) and its first step
    moved every tensor; the resumed run says where it resumed, then logs the losses, val losses and
    sample of the uninterrupted run and saves its weights and optimizer state, bitwise."""
    fork, whole, resumed, consoles = fork_runs
    use_fork(monkeypatch, fork)
    initial = train_gpt2.build_model(CONFIG, torch.device("cpu")).state_dict()
    after_one = checkpoints.load(checkpoints.path_of(whole, 1))["model"]
    assert set(after_one) == set(initial) == set(fork(CONFIG).state_dict()) != set(GPT(CONFIG).state_dict())
    assert [k for k, v in initial.items() if torch.equal(after_one[k], v)] == []
    (steps, evals), (steps_resumed, evals_resumed) = read_log(whole), read_log(resumed)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert f"resumed from {checkpoints.path_of(resumed, STEPS - 1)} at step {STEPS - 1}" in consoles[resumed]
    assert [(s["step"], s["loss"]) for s in steps_resumed] == [(s["step"], s["loss"]) for s in steps]
    assert [(e["step"], e["val_loss"]) for e in evals_resumed] == [(e["step"], e["val_loss"]) for e in evals]
    samples = [[line for line in consoles[out].splitlines() if line.startswith(f"sample at step {STEPS}:")]
               for out in (whole, resumed)]
    assert len(samples[0]) == 1 and samples[1] == samples[0]
    final, final_resumed = (checkpoints.load(checkpoints.path_of(out, STEPS)) for out in (whole, resumed))
    assert_same(final_resumed["model"], final["model"])
    assert_same(final_resumed["optimizer"], final["optimizer"])


def assert_same(value, reference, where="state"):
    """value is reference: nested dicts, lists and tuples with the same keys, tensors bitwise equal
    (dtype and shape included), and every other value ==."""
    if torch.is_tensor(reference):
        assert torch.is_tensor(value) and value.dtype == reference.dtype, where
        assert torch.equal(value, reference), where
    elif isinstance(reference, dict):
        assert isinstance(value, dict) and list(value) == list(reference), where
        for key in reference:
            assert_same(value[key], reference[key], f"{where}[{key!r}]")
    elif isinstance(reference, (list, tuple)):
        assert type(value) is type(reference) and len(value) == len(reference), where
        for i, (v, r) in enumerate(zip(value, reference)):
            assert_same(v, r, f"{where}[{i}]")
    else:
        assert value == reference, where


def test_scripts_sample_draws_from_a_forks_out_dir(fork_runs, monkeypatch, capsys):
    """scripts/sample.py on the fork's out_dir prints what sample() draws from the fork's
    from_pretrained of it with the same seed."""
    fork, whole, _, _ = fork_runs
    use_fork(monkeypatch, fork)
    sample_script.main([str(whole), "--prompt", "ab", "--max_new_tokens", "8", "--seed", "3",
                        "--device", "cpu"])
    printed, expected = capsys.readouterr(), io.StringIO()
    assert printed.err == f"sampling from {checkpoints.path_of(whole, STEPS)}\n"
    tokens = sample_script.sample(fork.from_pretrained(whole), gpt2_encoding(), "ab", 8, 1.0, 50,
                                  torch.Generator().manual_seed(3), out=expected)
    assert len(tokens) == 8 and printed.out == expected.getvalue()


def test_a_forks_from_pretrained_holds_its_checkpoint_tied_as_its_init_ties(fork_runs):
    """The fork's from_pretrained, built on the meta device, holds its checkpoint's weights, with
    the ties of the fork's own __init__: QK-norm's lm_head stays apart from wte."""
    fork, whole, _, _ = fork_runs
    model = fork.from_pretrained(whole)
    assert tied_names(model) == tied_names(fork(model.config))
    saved = checkpoints.load(checkpoints.path_of(whole, STEPS))["model"]
    assert model.state_dict().keys() == saved.keys()
    assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("name", list(FORKS))
def test_the_plan_counts_what_a_forks_cpu_step_holds(name, optimizer, monkeypatch):
    """train_gpt2.memory_counts with the fork as GPT plans the bytes of the parameters, gradients and
    optimizer state that one CPU training step of the fork holds, exactly."""
    fork, config = FORKS[name], dataclasses.replace(CONFIG, optimizer=optimizer)
    monkeypatch.setattr(train_gpt2, "GPT", fork)
    planned = memory_plan.plan(config, 1, train_gpt2.memory_counts(config))
    torch.manual_seed(0)
    model = fork(config)
    idx = torch.randint(0, config.vocab_size, (config.micro_batch_size, config.seq_len))
    model(idx, idx)[1].backward()
    optimizer = model.configure_optimizers(config, "cpu")
    optimizer.step()

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    assert planned["parameters"] == size(model.parameters())
    assert planned["gradients"] == size(p.grad for p in model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim()]  # not the step counts
    assert planned["optimizer state"] == size(state)
    assert planned["activations"] > 0


@pytest.mark.parametrize("name", list(FORKS))
def test_muon_splits_a_fork_by_its_modules(name):
    """test_muon.py's check of the split on the fork: its own matrices (SwiGLU's c_gate among them)
    to Muon, its RMSNorm gains and its own lm_head to AdamW."""
    check_muon_split(FORKS[name](CONFIG), CONFIG)
