"""GPT.generate's KV cache: the tokens and logits of running the whole window for every token,
across block_size, for a batch, and at GPT-2 124M's shape; the same with sampling.decoding_layout()."""

import pytest
import torch
from torch.nn import functional as F

from gpt2_ddp.sampling import decoding_layout
from train_gpt2 import GPT, Config

SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=512)
GPT2_124M = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
LOGITS_ATOL = 1e-5  # float32 rounding of other matmul shapes; seen: 2e-7 (small), 3e-6 (124M)


def reference_generate(model, idx, max_new_tokens, generator, temperature, top_k):
    """The sampling loop without a cache: the whole window (the last block_size tokens, positions
    from 0) through the model for every token. Returns the tokens (B, max_new_tokens) and each
    step's last-position logits (max_new_tokens, B, vocab_size)."""
    steps = []
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.config.block_size:])[0][:, -1, :]  # (B, vocab_size)
        probs = F.softmax(logits.float() / temperature, dim=-1)
        topk_probs, topk_idx = torch.topk(probs, min(top_k or probs.size(-1), probs.size(-1)))
        token = torch.gather(topk_idx, -1, torch.multinomial(topk_probs, 1, generator=generator))
        idx = torch.cat((idx, token), dim=1)
        steps.append(logits)
    return idx[:, -max_new_tokens:], torch.stack(steps)


def cached_generate(model, idx, max_new_tokens, generator, temperature, top_k):
    """GPT.generate's tokens (B, max_new_tokens), and the logits (max_new_tokens, B, vocab_size)
    its forwards returned, caught by a hook on the model."""
    steps = []
    hook = model.register_forward_hook(lambda module, args, out: steps.append(out[0][:, -1, :]))
    try:
        tokens = torch.cat(list(model.generate(idx, max_new_tokens, generator, temperature, top_k)),
                           dim=1)
    finally:
        hook.remove()
    return tokens, torch.stack(steps)


def shared_names(model):
    """The groups of parameter names that name one tensor (GPT-2's wte and lm_head), as lists."""
    groups = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(names for names in groups.values() if len(names) > 1)


def assert_cache_changes_nothing(shape, batch, prompt_len, max_new_tokens, temperature=1.0,
                                 top_k=50, seed=0):
    torch.manual_seed(seed)
    model = GPT(Config(**shape)).eval()
    idx = torch.randint(0, shape["vocab_size"], (batch, prompt_len))
    with torch.no_grad():
        expected, expected_logits = reference_generate(
            model, idx, max_new_tokens, torch.Generator().manual_seed(seed), temperature, top_k)
    state, shared = {k: v.clone() for k, v in model.state_dict().items()}, shared_names(model)
    # the model as it is trained, then as scripts/sample.py samples it
    for sampler in (model, decoding_layout(model)):
        tokens, logits = cached_generate(sampler, idx, max_new_tokens,
                                         torch.Generator().manual_seed(seed), temperature, top_k)
        assert tokens.shape == (batch, max_new_tokens)
        assert torch.equal(tokens, expected)
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=LOGITS_ATOL)
    weight = model.transformer.h[0].attn.c_attn.weight  # (3 * n_embd, n_embd), stored (in, out)
    assert weight.stride() == (1, weight.size(0))
    assert shared_names(model) == shared  # a tensor that modules share (tied weights) still shared
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())


@pytest.mark.parametrize("batch, prompt_len, temperature, top_k", [
    (1, 10, 1.0, 50),
    (3, 10, 0.8, 0),  # a batch of prompts; top_k 0 samples from the whole vocabulary
    (2, 80, 1.0, 600),  # a prompt longer than block_size; top_k above vocab_size
])
def test_cached_sampling_draws_the_uncached_tokens_across_block_size(
        one_thread, batch, prompt_len, temperature, top_k):
    # 200 tokens after 10: the window starts sliding at token 55 of block_size 64
    assert_cache_changes_nothing(SMALL, batch, prompt_len, 200, temperature, top_k)


def test_cached_sampling_draws_the_uncached_tokens_at_gpt2_124m_shape(one_thread):
    assert_cache_changes_nothing(GPT2_124M, 1, 16, 32)


def test_a_model_trained_with_activation_checkpointing_samples_through_its_cache():
    """Checkpointing recomputes activations for a backward; sampling, with no backward, runs the
    blocks with their KV cache and draws what the same weights draw without checkpointing."""
    torch.manual_seed(0)
    plain = GPT(Config(**SMALL)).eval()
    checkpointed = GPT(Config(**SMALL, activation_checkpointing=True)).eval()
    checkpointed.load_state_dict(plain.state_dict())
    idx = torch.randint(0, SMALL["vocab_size"], (2, 5))
    with torch.no_grad():
        drawn = [cached_generate(model, idx, 20, torch.Generator().manual_seed(0), 1.0, 50)[0]
                 for model in (plain, checkpointed)]
    assert torch.equal(*drawn)
