"""
Sampling speed of train_gpt2.py's GPT.generate (KV cache) against transformers' GPT2LMHeadModel's.

    python -m tests.bench_sample                                  # 124M, 200 and 1000 tokens
    python -m tests.bench_sample --new_tokens 200 --repeats 3
    python -m tests.bench_sample --devices cuda                   # the GPU alone
    python -m tests.bench_sample --n_layer 2 --n_head 2 --n_embd 32 --new_tokens 8
    python -m tests.bench_sample --load DIR [DIR ...] --sample_from DIR [DIR ...] --new_tokens 200

Both hold the same random weights (GPT-2 124M's shape by default), so the first line's largest logits
difference should be tiny. Each samples --new_tokens after one random 16-token prompt, batch 1, top_k 50,
never stopping at <|endoftext|>; tok/s counts the whole call, prefill included, after a warm-up. Needs
transformers (pip install transformers).

With --load or --sample_from, the rows are fresh processes at one CPU thread instead, ours then
transformers', alternating, the best of --repeats each: --load times GPT.from_pretrained against
GPT2LMHeadModel.from_pretrained of each Hugging Face GPT-2 directory, the first call in a process and
a second one; --sample_from times the whole `python -m scripts.sample DIR` of the first --new_tokens
tokens against a script that loads the directory with transformers and generates as many, loading
and imports included.
"""

import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpt2_ddp import configurator
from gpt2_ddp.configurator import UserError
from gpt2_ddp.gpt2_weights import CONV1D
from gpt2_ddp.sampling import decoding_layout
from train_gpt2 import GPT, Config

PROMPT_TOKENS = 16
TOP_K = 50
ROOT = Path(__file__).resolve().parent.parent
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
# a child that imports the model class, then prints its import time and two from_pretrained times
# (the first model freed in between, untimed)
LOAD = """import gc, sys, time
t0 = time.perf_counter()
import torch
if sys.argv[1] == "ours":
    from train_gpt2 import GPT as Model
else:
    from transformers import GPT2LMHeadModel as Model
times = [time.perf_counter() - t0]
for _ in range(2):
    t0 = time.perf_counter()
    model = Model.from_pretrained(sys.argv[2])
    times.append(time.perf_counter() - t0)
    del model
    gc.collect()
print(*times)
"""
# what scripts.sample does, with transformers: load, then print a sample of argv[2] tokens
HF_SAMPLE = """import sys
import torch
from transformers import GPT2LMHeadModel
from gpt2_ddp.tokenizer import gpt2_encoding
torch.manual_seed(int(sys.argv[3]))
model, enc = GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval(), gpt2_encoding()
prompt = torch.tensor([enc.encode(sys.argv[4])])
out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=50,
                     temperature=1.0, top_p=1.0, max_new_tokens=int(sys.argv[2]),
                     min_new_tokens=int(sys.argv[2]), pad_token_id=50256)
print(enc.decode(out[0].tolist()))
"""


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


def child(name, args):
    """(seconds, stdout) of a fresh python process with argv `args` at one CPU thread, run from the
    repository root. Raises UserError naming it `name`, with its last stderr line, if it fails."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=ONE_THREAD, capture_output=True,
                          text=True)
    if done.returncode:
        raise UserError(f"{name} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return time.perf_counter() - t0, done.stdout


def best_of(repeats, time_ours, time_theirs):
    """(best of ours, best of theirs) over `repeats` alternating calls of each, each a list of
    figures; the minimum per position."""
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(time_ours())
        theirs.append(time_theirs())
    return [min(column) for column in zip(*ours)], [min(column) for column in zip(*theirs)]


def load_times(who, source):
    """[import, first from_pretrained, second from_pretrained] in seconds, in a fresh process, of
    `who`'s model class: ours or transformers'."""
    return [float(t) for t in child(f"{who} loading {source}", ["-c", LOAD, who, source])[1].split()]


def sample_time(who, source, new_tokens, seed, prompt="ROMEO:"):
    """Seconds of `who`'s whole process that loads `source` and prints a sample of new_tokens."""
    if who == "ours":
        return child("python -m scripts.sample", [
            "-m", "scripts.sample", source, "--prompt", prompt, "--max_new_tokens", str(new_tokens),
            "--seed", str(seed), "--device", "cpu"])[0]
    return child("transformers' sample", ["-c", HF_SAMPLE, source, str(new_tokens), str(seed), prompt])[0]


def process_rows(args):
    """The table's rows of --load and --sample_from: seconds, ours against transformers'."""
    rows = []
    for source in args.load:
        ours, theirs = best_of(args.repeats, lambda: load_times("ours", source),
                               lambda: load_times("transformers", source))
        for i, what in enumerate(["import", "from_pretrained, the first in a process",
                                  "from_pretrained again"]):
            rows.append((f"{Path(source).name}: {what}", ours[i], theirs[i]))
    n = args.new_tokens[0]
    for source in args.sample_from:
        ours, theirs = best_of(args.repeats, lambda: [sample_time("ours", source, n, args.seed)],
                               lambda: [sample_time("transformers", source, n, args.seed)])
        rows.append((f"{Path(source).name}: python -m scripts.sample, {n} new tokens, loading included",
                     ours[0], theirs[0]))
    return [f"| {what} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |"
            for what, ours, theirs in rows]


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
    parser.add_argument("--load", nargs="+", default=[], metavar="DIR",
                        help="Hugging Face GPT-2 directories whose loading to time")
    parser.add_argument("--sample_from", nargs="+", default=[], metavar="DIR",
                        help="Hugging Face GPT-2 directories to time scripts.sample from, loading "
                             "included, against transformers (the first --new_tokens)")
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
    if args.load or args.sample_from:
        rows = process_rows(args)
        print(f"fresh processes at one CPU thread, seconds, best of {args.repeats}; torch "
              f"{torch.__version__}\n\n| what | ours | transformers | speedup |\n|---|---|---|---|")
        print("\n".join(rows))
        return
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
