"""
Sampling speed of train_gpt2.py's GPT.generate (KV cache) against transformers' GPT2LMHeadModel's.

    python -m tests.bench_sample                                  # 124M, 200 and 1000 tokens
    python -m tests.bench_sample --new_tokens 200 --repeats 3
    python -m tests.bench_sample --devices cuda                   # the GPU alone
    python -m tests.bench_sample --n_layer 2 --n_head 2 --n_embd 32 --new_tokens 8

Both hold the same random weights (GPT-2 124M's shape by default), so the first line's largest logits
difference should be tiny. Each samples --new_tokens after one random 16-token prompt, batch 1, top_k 50,
never stopping at <|endoftext|>; tok/s counts the whole call, prefill included, after a warm-up. Needs
transformers (pip install transformers).
"""

import copy
import statistics
import sys
import time

import torch

from gpt2_ddp import configurator
from gpt2_ddp.configurator import UserError
from gpt2_ddp.gpt2_weights import CONV1D
from gpt2_ddp.sampling import decoding_layout
from train_gpt2 import GPT, Config

PROMPT_TOKENS = 16
TOP_K = 50


def hf_twin(model):
    """transformers' GPT2LMHeadModel holding model's weights. Raises UserError without transformers."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise UserError("transformers is not installed: pip install transformers") from None
    cfg = model.config
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    state = {k: v.t() if k.endswith(CONV1D) else v for k, v in model.state_dict().items()}
    hf.load_state_dict(state)  # strict: every tensor of theirs is one of ours
    return hf.to(next(model.parameters()).device).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def ours(model, prompt, new_tokens, seed):
    """Seconds that GPT.generate takes to draw new_tokens after prompt (1, T)."""
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    sync(prompt.device)
    t0 = time.perf_counter()
    tokens = list(model.generate(prompt, new_tokens, generator, 1.0, TOP_K))
    sync(prompt.device)
    assert len(tokens) == new_tokens
    return time.perf_counter() - t0


def theirs(hf, prompt, new_tokens, seed):
    """Seconds that GPT2LMHeadModel.generate takes to sample new_tokens after prompt (1, T)."""
    torch.manual_seed(seed)
    sync(prompt.device)
    t0 = time.perf_counter()
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=TOP_K,
                      temperature=1.0, top_p=1.0, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, pad_token_id=50256)
    sync(prompt.device)
    assert out.size(1) == prompt.size(1) + new_tokens
    return time.perf_counter() - t0


def settings(cpu_threads, devices):
    """(name, device, threads) of each setting: CPU at 1 and at cpu_threads threads, then CUDA."""
    rows = [(f"cpu, {n} thread{'s' * (n > 1)}", torch.device("cpu"), n)
            for n in sorted({1, cpu_threads}) if "cpu" in devices]
    if "cuda" in devices:
        rows.append((f"cuda ({torch.cuda.get_device_name()})", torch.device("cuda"), cpu_threads))
    return rows


def spread(tok_per_s):
    return f"{statistics.median(tok_per_s):.1f} ({min(tok_per_s):.1f}-{max(tok_per_s):.1f})"


def time_setting(name, model, hf, prompt, args):
    """The table's rows of one setting, one per --new_tokens, timed after a warm-up call."""
    ours(model, prompt, 8, args.seed)
    theirs(hf, prompt, 8, args.seed)
    rows = []
    for new_tokens in args.new_tokens:
        print(f"timing {name}, {new_tokens} tokens ...", file=sys.stderr, flush=True)
        rate = {"ours": [], "theirs": []}  # tokens per second
        for repeat in range(args.repeats):
            rate["ours"].append(new_tokens / ours(model, prompt, new_tokens, args.seed + repeat))
            rate["theirs"].append(new_tokens / theirs(hf, prompt, new_tokens, args.seed + repeat))
        ratio = statistics.median(rate["ours"]) / statistics.median(rate["theirs"])
        rows.append(f"| {name}, {new_tokens} new tokens | {spread(rate['ours'])} | "
                    f"{spread(rate['theirs'])} | {ratio:.2f}x |")
    return rows


def main(argv):
    parser = configurator.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]))
    parser.add_argument("--new_tokens", type=int, nargs="+", default=[200, 1000],
                        help="tokens to draw per call, one row per count and setting")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each, alternating")
    parser.add_argument("--n_layer", type=int, default=12, help="the GPT's shape, GPT-2 124M's by "
                        "default; a smaller one for a quick check")
    parser.add_argument("--n_head", type=int, default=12, help="attention heads, as --n_layer")
    parser.add_argument("--n_embd", type=int, default=768, help="width of the residual stream, as --n_layer")
    parser.add_argument("--seed", type=int, default=1337, help="weights, prompt and samples")
    parser.add_argument("--devices", nargs="+", choices=["cpu", "cuda"],
                        default=["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"],
                        help="where to time: cpu (1 thread and all), cuda (default: both where "
                             "there is a GPU)")
    args = parser.parse_args(argv)
    if "cuda" in args.devices and not torch.cuda.is_available():
        raise UserError("--devices cuda: torch sees no CUDA device here; pass --devices cpu")
    if args.repeats < 1 or min(args.new_tokens) < 1 or min(args.n_layer, args.n_head) < 1:
        raise UserError("--repeats, --new_tokens, --n_layer and --n_head must be >= 1")
    if not 0 <= args.seed < 2**63:  # seed + repeat stays in torch's range, below 2**64
        raise UserError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.n_embd < 1 or args.n_embd % args.n_head:
        raise UserError(f"--n_embd must be a positive multiple of --n_head={args.n_head}, got "
                        f"{args.n_embd}")
    config = Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    if PROMPT_TOKENS + max(args.new_tokens) > config.block_size:
        raise UserError(f"--new_tokens at most {config.block_size - PROMPT_TOKENS}: transformers' "
                        f"GPT-2 has no position beyond block_size={config.block_size}")
    cpu_threads = torch.get_num_threads()
    torch.manual_seed(args.seed)
    model = GPT(config).eval()
    hf = hf_twin(model)
    import transformers  # hf_twin found it
    prompt = torch.randint(0, 50257, (1, PROMPT_TOKENS))  # GPT-2's vocabulary, no padding ids
    with torch.no_grad():
        ours_logits = decoding_layout(copy.deepcopy(model))(prompt)[0]
        diff = (ours_logits - hf(prompt).logits).abs().max().item()
    print(f"{config.n_layer} layers, n_embd {config.n_embd}, {PROMPT_TOKENS}-token prompt, top_k "
          f"{TOP_K}; max |logits ours - transformers| on the prompt: {diff:.1e}; torch "
          f"{torch.__version__}, transformers {transformers.__version__}\n")
    rows = []
    try:
        for name, device, threads in settings(cpu_threads, args.devices):
            torch.set_num_threads(threads)
            sampler = decoding_layout(copy.deepcopy(model).to(device))
            rows += time_setting(name, sampler, hf.to(device), prompt.to(device), args)
            del sampler
    finally:  # main() also runs in the tests' process
        torch.set_num_threads(cpu_threads)
    print(f"| setting | ours tok/s, median (min-max) of {args.repeats} | transformers tok/s | ratio |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    configurator.run(main, "bench_sample.py")
