"""A fork of the model that swaps the learned positions (transformer.wpe) for rotary embeddings
(conftest.RopeGPT) trains, saves, resumes and samples through train_gpt2.py's own code, with no
change outside the model: nothing there assumes GPT-2's layout."""

import io
import math
import shutil

import pytest
import torch

import train_gpt2
from conftest import TINY, RopeGPT, make_shards, read_log, rope_fork, train_here
from gpt2_ddp import checkpoints
from gpt2_ddp.sampling import KVCache
from gpt2_ddp.tokenizer import gpt2_encoding
from scripts.sample import main as sample_main, sample

STEPS = 4


def test_the_fork_has_no_learned_positions_yet_sees_order_and_decodes_through_the_cache(one_thread):
    """RopeGPT holds GPT's parameters but wpe's and no new one (the names, and the numbers of
    their distinct tensors' elements). With one layer its last logits change when two earlier
    tokens swap places (without positions the last query would attend to the same set of keys:
    1e-7 apart, not 1e-3). With two, a prefill then one token at a time through a KVCache gives the
    logits of running the whole sequence (float32, 1e-5)."""
    models = {}
    for n_layer in (1, 2):
        config = train_gpt2.Config(n_layer=n_layer, n_head=2, n_embd=32, block_size=32, vocab_size=512)
        torch.manual_seed(0)
        models[n_layer] = model = RopeGPT(config).eval()
        gpt = train_gpt2.GPT(config)
        assert set(model.state_dict()) == {k for k in gpt.state_dict() if ".wpe." not in k}
        assert (sum(p.numel() for p in model.parameters()) ==
                sum(p.numel() for p in gpt.parameters()) - gpt.transformer.wpe.weight.numel())
    one, two = models[1], models[2]
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    swapped = idx.clone()
    swapped[:, [3, 7]] = idx[:, [7, 3]]
    with torch.no_grad():
        one.transformer.h[0].attn.c_attn.weight.mul_(10)  # attention far from the init's uniform one
        assert not torch.allclose(one(swapped)[0][:, -1], one(idx)[0][:, -1], rtol=0, atol=1e-3)
        logits = two(idx)[0]
        cache = KVCache(2, idx.size(1))
        steps = [two(idx[:, :8], cache=cache)[0]]
        steps += [two(idx[:, t:t + 1], cache=cache)[0] for t in range(8, idx.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), logits[:, 7:], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def fork_runs(tmp_path_factory):
    """train_gpt2.main in this process with RopeGPT as its GPT: `whole` trains STEPS steps with a
    checkpoint after each; `resumed` is a copy of it whose last two checkpoints are deleted, as if
    it had been killed after logging their steps, trained again to STEPS. Returns (whole, resumed,
    the console of each run)."""
    root = tmp_path_factory.mktemp("fork")
    data, whole, resumed = root / "data", root / "whole", root / "resumed"
    make_shards(data)
    args = [*TINY, f"--data_dir={data}", "--total_batch_size=64", f"--max_steps={STEPS}",
            "--checkpoint_interval=1", "--keep_checkpoints=0", "--sample_interval=2", "--sample_prompt=ab"]
    consoles = {}
    with pytest.MonkeyPatch.context() as patch:
        rope_fork(patch)
        for out in (whole, resumed):
            if out == resumed:
                shutil.copytree(whole, resumed)
                for step in (STEPS - 1, STEPS):
                    checkpoints.path_of(resumed, step).unlink()
            consoles[out] = train_here([*args, f"--out_dir={out}"])
    return whole, resumed, consoles


def test_one_step_of_the_fork_is_finite_and_changes_every_weight(fork_runs, monkeypatch):
    """train() built the fork (build_model's RopeGPT, seeded, is the weights it started from) and
    its checkpoints hold the fork's keys; every step's loss is finite, and the first moved every
    tensor."""
    whole, _, _ = fork_runs
    rope_fork(monkeypatch)
    initial = train_gpt2.build_model(train_gpt2.load_config(TINY), torch.device("cpu")).state_dict()
    after_one = checkpoints.load(checkpoints.path_of(whole, 1))["model"]
    assert set(after_one) == set(initial) and not any(".wpe." in k for k in after_one)
    steps, _ = read_log(whole)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [k for k, v in initial.items() if torch.equal(after_one[k], v)] == []


def test_the_fork_resumes_from_its_checkpoint_as_if_never_stopped(fork_runs):
    """The resumed run says it resumed at step STEPS - 2, then logs the uninterrupted run's losses,
    val losses and sample of the steps after it bitwise (one process, one thread: the same
    kernels), and saves the same weights and optimizer state."""
    whole, resumed, consoles = fork_runs
    checkpoint = checkpoints.path_of(resumed, STEPS - 2)
    assert f"resumed from {checkpoint} at step {STEPS - 2}" in consoles[resumed]
    samples = [[line for line in consoles[out].splitlines() if line.startswith(f"sample at step {STEPS}:")]
               for out in (whole, resumed)]
    assert len(samples[0]) == 1 and samples[1] == samples[0]
    (steps, evals), (steps_resumed, evals_resumed) = read_log(whole), read_log(resumed)
    assert [(s["step"], s["loss"]) for s in steps_resumed] == [(s["step"], s["loss"]) for s in steps]
    assert [(e["step"], e["val_loss"]) for e in evals_resumed] == [(e["step"], e["val_loss"]) for e in evals]
    assert steps[-1]["loss"] < steps[0]["loss"]  # it trained
    final, final_resumed = (checkpoints.load(checkpoints.path_of(out, STEPS)) for out in (whole, resumed))
    assert_same_tensors(final_resumed["model"], final["model"])
    state, state_resumed = final["optimizer"]["state"], final_resumed["optimizer"]["state"]
    assert state_resumed.keys() == state.keys()
    for i in state:
        assert_same_tensors(state_resumed[i], state[i])
    assert final_resumed["optimizer"]["param_groups"] == final["optimizer"]["param_groups"]


def assert_same_tensors(state, reference):
    assert state.keys() == reference.keys()
    assert [k for k in state if not torch.equal(state[k], reference[k])] == []


def test_scripts_sample_draws_from_the_forks_out_dir(fork_runs, monkeypatch, capsys):
    """scripts/sample.py on the fork's out_dir (its newest checkpoint) prints what sample() draws
    from RopeGPT.from_pretrained of it with the same seed."""
    whole, _, _ = fork_runs
    rope_fork(monkeypatch)
    sample_main([str(whole), "--prompt", "ab", "--max_new_tokens", "16", "--seed", "3", "--device", "cpu"])
    printed = capsys.readouterr()
    assert printed.err == f"sampling from {checkpoints.path_of(whole, STEPS)}\n"
    expected = io.StringIO()
    model = RopeGPT.from_pretrained(whole)
    tokens = sample(model, gpt2_encoding(), "ab", 16, 1.0, 50, torch.Generator().manual_seed(3), out=expected)
    assert len(tokens) == 16 and printed.out == expected.getvalue()
