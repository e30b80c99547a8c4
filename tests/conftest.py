"""Shared helpers: the repo root on sys.path, tiny shards, launching real training runs, and a
fork of the model with rotary position embeddings (RopeGPT)."""

import contextlib
import gc
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train_gpt2
from gpt2_ddp import runs
from gpt2_ddp.shards import write_shard
from scripts import check_equivalence


def pytest_configure(config):
    config.addinivalue_line("markers", "compat: also run on the oldest torch that requirements.txt "
                                       "allows, by .ci/compat (`pytest -m compat`)")


# A GPT small enough that a few steps take seconds on one CPU core.
TINY = [
    "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=512",
    "--micro_batch_size=2", "--seq_len=16", "--warmup_steps=2", "--max_lr=1e-2", "--min_lr=1e-3",
    "--eval_interval=2", "--val_batches=4", "--sample_interval=0", "--checkpoint_interval=0",
    "--compile=false", "--collective_timeout_s=60", "--data_order=sequential",  # markov_tokens has no documents
]


def markov_tokens(rng, n, vocab):
    """A learnable stream over the first vocab // 8 ids: each token is the previous one plus 0..3,
    so a model's loss falls fast from ln(vocab) (unigram) and then towards ln(4) (bigram)."""
    return np.cumsum(rng.integers(0, 4, n)) % (vocab // 8)


def make_shards(data_dir, n_train=4000, n_val=1000, vocab=512, seed=0, train_shards=2):
    """Writes val and train shards (the train split over several files) of a learnable token
    stream; returns the concatenated train stream."""
    rng = np.random.default_rng(seed)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    write_shard(data_dir / "tiny_val_000000.bin", markov_tokens(rng, n_val, vocab))
    train = markov_tokens(rng, n_train, vocab)
    for i, part in enumerate(np.array_split(train, train_shards)):
        write_shard(data_dir / f"tiny_train_{i + 1:06d}.bin", part)
    return train


# letters whose GPT-2 tokens, alone or after a space, are ids below TINY's vocab_size of 512
LOW_ID_LETTERS = "abcdefghjklmnoprstuvwy"


def write_hellaswag(path, n, seed=0):
    """Writes n HellaSwag examples in the official jsonl schema (ctx, endings, label and the other
    fields), made of one-letter words so that every GPT-2 token id is below 512."""
    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(rng.choice(list(LOW_ID_LETTERS), k))

    with open(path, "w") as f:
        for i in range(n):
            ctx = words(int(rng.integers(2, 6)))
            example = {"ind": i, "activity_label": "test", "ctx_a": ctx, "ctx_b": "", "ctx": ctx,
                       "split": "val", "split_type": "indomain", "source_id": f"test~{i}",
                       "endings": [words(int(rng.integers(1, 5))) for _ in range(4)],
                       "label": int(rng.integers(0, 4))}
            f.write(json.dumps(example) + "\n")


def ctrl_c_reaches():
    """Popen's preexec_fn for a child that a test sends Ctrl-C (SIGINT): the default action, as a
    terminal's job has it, though a shell that started the tests in the background ignores SIGINT,
    and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def tiny_data(tmp_path):
    data_dir = tmp_path / "data"
    make_shards(data_dir)
    return data_dir


@contextlib.contextmanager
def one_torch_thread():
    """One torch thread in this process, as OMP_NUM_THREADS=1 gives run_training's processes and
    torchrun's workers: the same kernels, so the same rounding, on any machine; and on a busy one
    more threads make a tiny model's steps several times slower."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture
def plain_process(monkeypatch):
    """This process as `python train_gpt2.py` runs it: none of torchrun's variables set."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def recording(events, what, function):
    """`function`, appending `what` to the list `events` at each call."""
    def record(*args, **kwargs):
        events.append(what)
        return function(*args, **kwargs)
    return record


def record_host_reads(monkeypatch, events):
    """Appends "read" to `events` whenever a tensor's value reaches Python (every way: item, tolist,
    bool, float, int), until the test ends."""
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, recording(events, "read", getattr(torch.Tensor, name)))


def run_training(args, nproc=1, timeout=300, torchrun=None):
    """Runs train_gpt2.py: `nproc` workers under torchrun (runs.train: gloo's on CPU, NCCL's on GPUs;
    torchrun for one process too with torchrun=True) with OMP_NUM_THREADS=1, or one process in this
    one (train_here), where a process of its own would add nothing but the start of one. The tests
    of what a process does (its exit code, its one-line errors, signals) launch it themselves.

    Returns the CompletedProcess (for one process here: the console as stdout); raises UserError
    with the output if the run failed, or what main() raised for one here.
    """
    if nproc == 1 and not torchrun:
        return subprocess.CompletedProcess(["train_gpt2.py", *args], 0, train_here(args), "")
    return runs.train(args, nproc, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"),
                      torchrun=torchrun)


def compare(train_args, world_sizes, out_root):
    """check_equivalence.compare with its world size 1 run in this process, as run_training runs it."""
    launch = runs.train

    def train(args, nproc=1, python=sys.executable, **kwargs):
        if nproc == 1 and python == sys.executable:
            return run_training(args)
        return launch(args, nproc, python, **kwargs)

    runs.train = train
    try:
        return check_equivalence.compare(train_args, world_sizes, out_root)
    finally:
        runs.train = launch


def train_together(arg_lists, nproc, script="many_runs.py", timeout=900):
    """Trains each of `arg_lists` in turn, all in one torchrun launch of `nproc` workers running
    tests/{script} (many_runs.py, or a script that takes its JSON list of runs as many_runs.py does),
    which start and import torch once for them all. Returns the launch's stdout; raises UserError
    with the output if a run failed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as listed:
        json.dump(arg_lists, listed)
        listed.flush()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "tests" / script), listed.name]
        code, stdout, stderr = runs.stream(cmd, lambda line, from_stdout: None, timeout,
                                           dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    if code != 0:
        raise runs.UserError(f"{' '.join(cmd)} failed ({code}):\n{stdout}\n{stderr}")
    return stdout


def compare_together(calls):
    """compare(train_args, world_sizes, out_root) for each (train_args, world_sizes, out_root) of
    `calls`, in a list; the runs of each world size above 1, of every call, in one launch
    (train_together)."""
    for n in sorted({n for _, world_sizes, _ in calls for n in world_sizes} - {1}):
        train_together([[*args, f"--out_dir={Path(out) / f'world_size_{n}'}", "--resume=never",
                         "--overwrite=true"] for args, world_sizes, out in calls if n in world_sizes], n)
    launch = runs.train

    def trained(args, nproc=1, python=sys.executable, **kwargs):
        return run_training(args) if nproc == 1 else None

    runs.train = trained
    try:
        return [check_equivalence.compare(*call) for call in calls]
    finally:
        runs.train = launch


def read_log(out_dir):
    """The records of {out_dir}/log.jsonl, split into train steps and evals."""
    steps, evals, _ = runs.split_records(runs.read_log(out_dir))
    return steps, evals


def expected_mfu(step, args, tokens_per_step, peak):
    """The mfu a logged step should hold: the model of args' FLOPs per token of T=16 (flops_per_token,
    itself checked against torch's FLOP counter) times the step's tokens, over its dt_ms and peak
    (FLOP/s of all ranks together)."""
    with torch.device("meta"):
        flops_per_step = train_gpt2.GPT(train_gpt2.load_config(args)).flops_per_token(16) * tokens_per_step
    return flops_per_step / (step["dt_ms"] / 1000) / peak


def free_port():
    """A TCP port of 127.0.0.1 that the OS found free, for a rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_bitwise_same_run(result, reference):
    """`result` logged bitwise the losses, val losses and HellaSwag results of `reference` (runs
    as check_equivalence.compare returns them), and ended with the weights of the first world size
    of its own compare call."""
    assert result["loss"] == reference["loss"]
    assert result["val_loss"] == reference["val_loss"]
    assert result["hellaswag"] == reference["hellaswag"]
    assert result["max_param_diff"] == 0.0


# The equivalence config: GPT-2's biases, dropout on, exact_reduction (float64 gradient sums, so
# every world size gives the same bits); B*T = 32 tokens and 256 tokens per step = 8 micro-batches:
# 8, 4 and 2 micro-steps at world size 1, 2 and 4. 100 steps at lr 1e-2: long enough that the
# default mode's rounding differences grow into the weights (test_equivalence.py shows it). One
# layer: zero2 and fsdp communicate per tensor, and 4 ranks on 2 cores make each collective slow.
STEPS = 100
EQUIV = [*TINY, "--n_layer=1", "--dropout=0.1", "--bias=true", "--exact_reduction=true",
         "--total_batch_size=256", f"--max_steps={STEPS}", "--eval_interval=25"]
EVALS = 5  # steps 0, 25, 50, 75 and the last
HELLASWAG_EVALS = 3  # steps 0, 50 and the last, of 7 examples: uneven over 2 and 4 ranks


def hellaswag_args(data_dir):
    return ["--hellaswag_interval=50", f"--hellaswag_path={Path(data_dir) / 'hellaswag.jsonl'}"]


@pytest.fixture(scope="session")
def equiv_data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("equiv_data")
    make_shards(path, n_train=20000)
    write_hellaswag(path / "hellaswag.jsonl", 7)
    return path


@pytest.fixture(scope="session")
def equiv_runs_dir(tmp_path_factory):
    """Where equiv_runs trains: world_size_{n}/ holds each run's log and checkpoint."""
    return tmp_path_factory.mktemp("equiv_runs")


@pytest.fixture(scope="session")
def equiv_and_default_mode_runs(equiv_data_dir, equiv_runs_dir, tmp_path_factory):
    """compare's runs of the EQUIV config, with HellaSwag, in ddp mode at world sizes 1, 2 and 4; and
    of the EQUIV config without exact_reduction at world sizes 1 and 2 (one launch a world size)."""
    return compare_together([
        ([*EQUIV, f"--data_dir={equiv_data_dir}", *hellaswag_args(equiv_data_dir)], [1, 2, 4],
         equiv_runs_dir),
        ([*EQUIV, f"--data_dir={equiv_data_dir}", "--exact_reduction=false"], [1, 2],
         tmp_path_factory.mktemp("default_mode_runs"))])


@pytest.fixture(scope="session")
def equiv_runs(equiv_and_default_mode_runs):
    """The EQUIV config, with HellaSwag, trained in ddp mode at world sizes 1 (in this process), 2
    and 4."""
    return equiv_and_default_mode_runs[0]


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory):
    """A directory holding a small GPT2LMHeadModel saved by `transformers` (config.json,
    model.safetensors): GPT-2's vocabulary, 2 layers, n_embd 32, 64 positions, every weight random
    (LayerNorm gains and biases included, so no tensor is left at its init)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    path = tmp_path_factory.mktemp("hf_tiny")
    config = GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def tied_names(model):
    """The names of each of model's parameters, sorted: a list per Parameter object, so the names
    that share one (GPT's wte and lm_head) are one list."""
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return sorted(names.values())


@contextlib.contextmanager
def matmul_precision_kept():
    """The float32 matmul precision put back on exit: main() and setup_distributed set it for the
    whole process."""
    precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


def train_here(args):
    """train_gpt2.main(args) in this process on one torch thread, as run_training's process would run
    it, its console captured; the float32 matmul precision that main() sets for the whole process
    restored after. Returns the console (str); raises what main() raises, or AssertionError for a
    non-zero exit code."""
    console = io.StringIO()
    try:
        with matmul_precision_kept(), one_torch_thread(), contextlib.redirect_stdout(console):
            code = train_gpt2.main(args)
    finally:
        gc.collect()  # the run's objects in reference cycles hold its out_dir lock until collected
    assert code == 0, console.getvalue()
    return console.getvalue()


@pytest.fixture(scope="session")
def gpt_tiny(tmp_path_factory):
    """An out_dir of train_gpt2.py holding ckpt_0000001.pt, a TINY model (vocab_size 512) after one
    step: the model of the tests of scripts (export, HellaSwag) and of init_from that are not about
    GPT-2's weights."""
    root = tmp_path_factory.mktemp("gpt_tiny")
    make_shards(root / "data")
    train_here([*TINY, f"--data_dir={root / 'data'}", f"--out_dir={root / 'out'}", "--total_batch_size=32",
                "--max_steps=1", "--eval_interval=0", "--hellaswag_interval=0"])
    return root / "out"


# --- a fork of the model: rotary position embeddings (RoPE) instead of learned ones ---------------

def rotary(x, start, base=10000.0):
    """x (B, T, nh, hs) at positions start..start+T-1 with RoPE (Su et al. 2021) applied: each pair
    (i, i + hs/2) of a head's channels rotated by the angle position * base**(-2i/hs)."""
    T, hs = x.size(1), x.size(-1)
    inv_freq = base ** (-torch.arange(0, hs, 2, device=x.device, dtype=torch.float32) / hs)
    positions = torch.arange(start, start + T, device=x.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)[:, None, :]  # (T, 1, hs/2): one angle for every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def change_qk(attn, fn):
    """Makes `attn`, an attention module as train_gpt2's Block holds it, attend with fn(q, k, start)
    in place of its q and k: each (B, T, nh, hs), of the tokens at positions start.. (the KV cache's
    pos, 0 without one). Hooks apply it to the output of attn.c_attn (B, T, 3 * n_embd), so the
    attention's own forward runs, with whatever a fork changed there."""
    n_head, start = attn.n_head, [0]

    def remember_start(module, args, kwargs):
        cache = args[1] if len(args) > 1 else kwargs.get("cache")
        start[0] = 0 if cache is None else cache.pos  # GPT.forward advances pos after the blocks

    def changed(module, args, qkv):
        B, T, C = qkv.size(0), qkv.size(1), qkv.size(2) // 3
        q, k, v = qkv.split(C, dim=2)
        q, k = fn(q.view(B, T, n_head, C // n_head), k.view(B, T, n_head, C // n_head), start[0])
        return torch.cat([q.reshape(B, T, C), k.reshape(B, T, C), v], dim=2)

    attn.register_forward_pre_hook(remember_start, with_kwargs=True)
    attn.c_attn.register_forward_hook(changed)


class NoPositions(nn.Module):
    """In transformer.wpe's place: no parameter, and 0 for every position, so that GPT.forward's
    wte(idx) + wpe(pos) is wte(idx) bit for bit."""

    def forward(self, pos):
        return torch.zeros((), device=pos.device)


class RopeGPT(train_gpt2.GPT):
    """The fork a researcher makes of train_gpt2.GPT: the learned positions (transformer.wpe) gone,
    RoPE on q and k in every attention, nothing else changed: GPT's own forward, attention, init and
    optimizer groups run as they are. A subclass of whatever train_gpt2.GPT is, so it is the same
    fork on a repository already forked."""

    def __init__(self, config):
        super().__init__(config)
        self.transformer.wpe = NoPositions()
        for block in self.transformer.h:
            change_qk(block.attn, lambda q, k, start: (rotary(q, start), rotary(k, start)))


def rope_fork(monkeypatch):
    """Makes train_gpt2 (train(), resume, the memory plan, from_pretrained) and scripts/sample.py
    build RopeGPT wherever they build a GPT, until the test ends; returns RopeGPT."""
    from scripts import sample
    for module in (train_gpt2, sample):
        monkeypatch.setattr(module, "GPT", RopeGPT)
    return RopeGPT
