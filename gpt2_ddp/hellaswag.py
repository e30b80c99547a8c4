"""HellaSwag (Zellers et al. 2019, https://rowanzellers.com/hellaswag/): pick the sensible ending of 4.
Scored as build-nanogpt's and llm.c's hellaswag.py, so numbers compare: a candidate is the context's
tokens then those of " " + ending, scored by the model's cross-entropy on the ending's tokens alone;
acc_norm picks the lowest mean loss per token, acc the lowest sum. The official validation jsonl is
downloaded once to data/hellaswag/ (`python -m scripts.hellaswag gpt2`, --hellaswag_interval=250)."""

import json
import math
import urllib.request
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.collectives import agreed
from gpt2_ddp.configurator import UserError
from gpt2_ddp.metrics import Waiting
from gpt2_ddp.tokenizer import gpt2_encoding

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
VAL_EXAMPLES = 10042


def download(path):
    """Downloads the validation split to `path`, atomically, and checks it holds VAL_EXAMPLES
    lines. Raises UserError when that fails, naming the URL and where to put the file by hand."""
    path = Path(path)

    def write(f):
        with urllib.request.urlopen(URL, timeout=30) as response:
            total = int(response.headers.get("Content-Length", 0)) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {path.name}") as bar:
                chunks = []  # about 11 MB
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
                    chunks.append(chunk)
        if (lines := sum(1 for line in b"".join(chunks).splitlines() if line.strip())) != VAL_EXAMPLES:
            raise UserError(f"{URL} gave {lines} lines, not the {VAL_EXAMPLES} examples of HellaSwag's "
                            f"validation split: try again, or download it by hand to {path}")

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write)
    except OSError as e:
        raise UserError(f"{path} is missing and downloading it from {URL} failed ({e}); download "
                        f"that file on a machine with a network and put it at {path}") from e


def load_examples(path, limit=0):
    """The first `limit` (0: all) examples of a jsonl file in the official schema, as dicts of "ctx"
    (str), "endings" (4 str) and "label" (0-3, or a digit string). Raises UserError, naming the file
    and line, for a missing or empty file, a line not complete UTF-8 JSON, or a bad example."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"HellaSwag file {path} not found (it is downloaded from {URL} when missing)")
    examples = []
    fix = f"delete {path} to download it again, or repair it"
    with open(path, "rb") as f:  # bytes: json.loads decodes each line, so bad UTF-8 names its line
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise UserError(f"{path} line {number} is not complete JSON (a truncated or "
                                f"corrupted file?): {fix}") from None
            try:
                label = int(raw["label"])
                example = {"ctx": raw["ctx"], "endings": list(raw["endings"]), "label": label}
                valid = (isinstance(example["ctx"], str) and len(example["endings"]) == 4
                         and all(isinstance(e, str) for e in example["endings"]) and 0 <= label < 4)
            except (KeyError, TypeError, ValueError):
                valid = False
            if not valid:
                raise UserError(f"{path} line {number} is not a HellaSwag example (ctx: str, "
                                f"endings: 4 str, label: 0-3): {fix}")
            examples.append(example)
            if len(examples) == limit:
                break
    if not examples:
        raise UserError(f"{path} holds no examples: {fix}")
    return examples


def examples_for_training(config):
    """train_gpt2.py's rendered examples (None for hellaswag_interval=0), which the master downloads
    if missing. A collective. Raises UserError as download(), load_examples() and render_all() do."""
    if config.hellaswag_interval == 0:
        return None
    path = Path(config.hellaswag_path)
    agreed(lambda: path.exists() or download(path), master_only=True)
    examples = load_examples(config.hellaswag_path, config.hellaswag_examples)
    return render_all(examples, config.block_size, config.vocab_size)


def render(example, enc, block_size):
    """An example's 4 candidates as tokens (4, L) int64, context then ending, zero-padded to the longest
    but at most block_size (cutting the context's start), and mask (4, L), 1 on the ending's tokens."""
    ctx = enc.encode_ordinary(example["ctx"])
    ends = [enc.encode_ordinary(" " + e) for e in example["endings"]]
    length = min(block_size, len(ctx) + max(map(len, ends)))
    tokens = [torch.tensor((ctx + end)[-length:]) for end in ends]
    mask = [torch.tensor(([0] * len(ctx) + [1] * len(end))[-length:]) for end in ends]
    return pad_sequence(tokens, batch_first=True), pad_sequence(mask, batch_first=True)


def render_all(examples, block_size, vocab_size):
    """A list of (tokens, mask, label) as render() makes them, once for all evaluations. Raises
    UserError for a token id >= vocab_size: a model of a smaller vocabulary than GPT-2's cannot score."""
    enc = gpt2_encoding()
    rendered = []
    for number, example in enumerate(examples, 1):
        tokens, mask = render(example, enc, block_size)
        if tokens.max() >= vocab_size:
            raise UserError(f"HellaSwag example {number} has GPT-2 token id {int(tokens.max())}, "
                            f"beyond the model's vocab_size={vocab_size}: HellaSwag needs GPT-2's "
                            f"vocabulary (vocab_size >= 50257), or set hellaswag_interval=0")
        rendered.append((tokens, mask, example["label"]))
    return rendered


@torch.no_grad()
def ending_losses(model, tokens, mask, autocast=None):
    """(sum, mean) of each candidate's ending's cross-entropy over its tokens, (4,) float32 nats each,
    from tokens, mask (4, L) of render(). `model(idx)` returns (logits, _) as train_gpt2.GPT does."""
    with autocast or nullcontext():
        logits, _ = model(tokens)  # (4, L, vocab_size)
    logits, targets = logits[:, :-1].float(), tokens[:, 1:]  # position t predicts token t + 1
    losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (4, L - 1)
    mask = mask[:, 1:].float()
    total = (losses * mask).sum(dim=1)
    return total, total / mask.sum(dim=1)


def evaluate(model, examples, device, rank=0, world_size=1, autocast=None, check_stop=None):
    """{hellaswag_acc_norm, hellaswag_acc (in [0, 1]), hellaswag_examples} of `model` on render_all()'s
    `examples`. A collective: example i runs on rank i % world_size, and a rank out of examples repeats its
    last, uncounted, so FSDP's all-gathers pair up. Leaves the model in eval mode."""
    model.eval()
    counts = torch.zeros(3, dtype=torch.long, device=device)  # correct by mean, by sum, examples
    indices = range(rank, math.ceil(len(examples) / world_size) * world_size, world_size)
    with Waiting(f"HellaSwag on {len(examples)} examples"):
        for i in tqdm(indices, "hellaswag", leave=False, disable=rank > 0 or None):  # rank 0's terminal
            if check_stop:
                check_stop()
            tokens, mask, label = examples[min(i, len(examples) - 1)]
            total, mean = ending_losses(model, tokens.to(device), mask.to(device), autocast)
            if i < len(examples):
                counts += torch.tensor([int(mean.argmin()) == label, int(total.argmin()) == label, 1],
                                       device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    correct_norm, correct, n = counts.tolist()
    return {"hellaswag_acc_norm": correct_norm / n, "hellaswag_acc": correct / n, "hellaswag_examples": n}


def summary(result):
    """One line of an evaluate() result, for the console."""
    return (f"hellaswag acc_norm {result['hellaswag_acc_norm']:.4f} | acc "
            f"{result['hellaswag_acc']:.4f} | {result['hellaswag_examples']} examples")
