"""Config parsing, the model's shape and names, the loader, and DDP against one process."""

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.distributed.run import get_args_parser

from conftest import (ROOT, TINY, expected_mfu, make_shards, markov_tokens, matmul_precision_kept, read_log,
                      run_training, train_together)
from gpt2_ddp import metrics
from gpt2_ddp.device import TORCH_FLOOR
from gpt2_ddp.gpt2_weights import CONV1D
from gpt2_ddp.shards import read_tokens, split_paths, write_shard
from train_gpt2 import GPT, Config, DataLoader, UserError, load_config
import train_gpt2


# --- config -------------------------------------------------------------------------------------

def test_overrides_cast_to_field_types(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('n_layer = 3\nmax_lr = 1\ncompile = false\ndata_dir = "d"\n')
    config = load_config([str(toml), "--max_steps=1e4", "--max_lr", "3e-4", "--compile=true", "--seed", "-2"])
    assert config.max_steps == 10000 and isinstance(config.max_steps, int) and config.seed == -2
    assert config.max_lr == 3e-4 and config.compile is True
    assert config.n_layer == 3 and config.data_dir == "d"


@pytest.mark.parametrize("argv, message", [
    (["--max_step=10"], "did you mean 'max_steps'"),
    (["--micro_batchsize=8"], "did you mean 'micro_batch_size'"),
    (["--max_steps=1.5"], "cannot read '1.5' as int"),
    (["--compile=maybe"], "cannot read 'maybe' as bool: pass true or false"),
    (["--max_steps"], "write overrides as --key=value or --key value"),
    (["--max_steps", "10", "20"], "cannot parse argument '20'"),
    (["no_such_config.toml"], "config file no_such_config.toml not found"),
    (["--resume=sometimes"], "'resume' must be auto or never, got 'sometimes'"),
    (["--exact_reduction=true", "--grad_compression=bf16"], "turn one of them off"),
    (["--micro_batch_size=0"], "'micro_batch_size' must be > 0, got 0"),
    (["--seq_len=0"], "'seq_len' must be > 0, got 0"),
    (["--max_steps=-5"], "'max_steps' must be > 0, got -5"),
    (["--dropout=-0.5"], "'dropout' must be in \\[0, 1\\), got -0.5"),
    (["--dropout=1"], "'dropout' must be in \\[0, 1\\), got 1.0"),
    (["--max_lr=-1"], "'max_lr' must be >= 0, got -1.0"),
    (["--eval_interval=-3"], "'eval_interval' must be >= 0, got -3"),
    (["--val_batches=0"], "'val_batches' must be >= 1 when eval_interval > 0, got 0; or pass "
                          "--eval_interval=0"),
    (["--device=tpu"], "'device' must be auto, cpu, mps, cuda or cuda:N, got 'tpu'"),
    (["--sharding=zero3"], "'sharding' must be ddp, zero2 or fsdp, got 'zero3'"),
    (["--dtype=fp8"], "'dtype' must be auto, bfloat16, float16 or float32, got 'fp8'"),
    (["--max_steps=1e30"], "cannot read '1e30' as int"),  # beyond int64: OverflowError mid-run
    (["--collective_timeout_s=1e14"], "'collective_timeout_s' must be > 0 and <= 1e8"),
    (["--collective_timeout_s=0"], "'collective_timeout_s' must be > 0 and <= 1e8 \\(3 years\\), got 0$"),
    (["--peak_flops=-1"], "'peak_flops' must be >= 0, got -1.0"),
    (["--max_lr=inf"], "'max_lr' must be a finite number, got 'inf'"),  # it passed >= 0, then diverged
    (["--max_lr=1e-3", "--min_lr=1e-2"], "min_lr=0.01 exceeds max_lr=0.001"),
    (["--overwrite=true"], "^overwrite=true takes effect only with resume=never: pass --resume=never "
                           "--overwrite=true to start over, or drop --overwrite to continue$"),
    (["--seq_len=33", "--block_size=32"], "^seq_len=33 exceeds block_size=32$"),
    (["."], "config file . is a directory, not a TOML file"),
    (["--seed=9223372036854775808"], "config key 'seed': cannot read '9223372036854775808' as int"),  # 2**63
])
def test_config_errors_say_what_to_fix(argv, message):
    with pytest.raises(UserError, match=message):
        load_config(argv)


def test_every_count_size_rate_and_interval_refuses_a_negative_value():
    """Each numeric key but the seed is a count, size, rate, probability or interval: a negative one is
    refused in one line naming it, before any work, not met mid-run."""
    numeric = [f.name for f in dataclasses.fields(Config) if f.type in (int, float) and f.name != "seed"]
    assert "sample_tokens" in numeric and "collective_timeout_s" in numeric
    for key in numeric:
        with pytest.raises(UserError, match=f"^config key '{key}' must be "):
            load_config([f"--{key}=-1"])


def test_the_closed_ends_of_each_range_load():
    """collective_timeout_s from 1 to 1e8 s, a fraction from 0, a count that must be > 0 from 1 and
    one that must be >= 0 from 0."""
    assert load_config(["--collective_timeout_s=1"]).collective_timeout_s == 1
    assert load_config(["--collective_timeout_s=100000000"]).collective_timeout_s == 10**8
    assert load_config(["--dropout=0", "--beta1=0", "--beta2=0"]).dropout == 0
    assert load_config(["--micro_batch_size=1", "--n_layer=1"]).micro_batch_size == 1
    assert load_config(["--warmup_steps=0", "--keep_checkpoints=0", "--weight_decay=0"]).warmup_steps == 0


def test_min_lr_equal_to_max_lr_is_a_constant_schedule():
    """min_lr may equal max_lr (only above it is refused): after warmup every step's lr is max_lr."""
    config = load_config(["--max_lr=1e-3", "--min_lr=1e-3", "--warmup_steps=2", "--max_steps=10"])
    assert [train_gpt2.get_lr(step, config) for step in range(2, 11)] == [1e-3] * 9


def test_val_batches_0_is_taken_with_evaluation_off():
    """The refusal of val_batches=0 offers --eval_interval=0, which must then run."""
    assert load_config(["--eval_interval=0", "--val_batches=0"]).val_batches == 0


def test_the_defaults_are_the_gpt2_124m_config_but_its_out_dir_prompt_and_hellaswag():
    """The module's docstring promises that the defaults are configs/gpt2_124m.toml's run."""
    defaults, config = Config(), load_config([str(ROOT / "configs" / "gpt2_124m.toml")])
    differ = {key for key in Config.__dataclass_fields__ if getattr(config, key) != getattr(defaults, key)}
    assert differ == {"out_dir", "sample_prompt", "hellaswag_interval"}


def test_a_trace_the_loggers_beside_log_jsonl_and_float64_sums_are_off_unless_asked_for():
    """profile (a torch.profiler trace each rank writes, and its slower steps), tensorboard and
    wandb_log are opt-in: a run with the defaults writes log.jsonl and its checkpoints alone. So is
    exact_reduction: by default gradients are all-reduced in DDP's float32 buckets, the fast path."""
    config = load_config([])
    assert (config.profile, config.tensorboard, config.wandb_log) == (False, False, False)
    assert not config.exact_reduction


def test_a_sample_prompt_token_at_vocab_size_is_refused():
    """The embedding's rows are 0 .. vocab_size - 1: a sample_prompt holding the id vocab_size itself
    ("a" is GPT-2's 64) is refused before any work, and with vocab_size one larger it is taken."""
    config = load_config([*TINY, "--sample_interval=1", "--sample_prompt=a", "--vocab_size=64"])
    with pytest.raises(UserError, match="^sample_prompt 'a' has GPT-2 token id 64, beyond vocab_size=64: "
                                        "pick another prompt, or pass --sample_interval=0$"):
        train_gpt2.sample_prompt(config)
    assert train_gpt2.sample_prompt(dataclasses.replace(config, vocab_size=65)) == [64]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_every_float_key_refuses_what_is_not_a_finite_number(value, tmp_path):
    keys = [f.name for f in dataclasses.fields(train_gpt2.Config) if f.type is float]
    assert "max_lr" in keys and "peak_flops" in keys
    for key in keys:
        with pytest.raises(UserError, match=f"'{key}' must be a finite number"):
            load_config([f"--{key}={value}"])
    toml = tmp_path / "c.toml"  # TOML's own inf and nan
    toml.write_text(f"max_lr = {value.replace('1e999', 'inf')}\n")
    with pytest.raises(UserError, match="'max_lr' must be a finite number"):
        load_config([str(toml)])


@pytest.mark.parametrize("device, message", [
    ("cuda:99", "--device=cuda:99: torch sees \\d+ CUDA device\\(s\\) here; pass --device=cpu"),
    ("mps", "--device=mps: MPS is not available here"),
])
def test_a_device_this_machine_lacks_is_refused_before_any_work(device, message):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(UserError, match=message):
        train_gpt2.main([f"--device={device}"])


@pytest.fixture
def two_gpus(monkeypatch):
    """A made-up machine of two CUDA devices, for the device choice and the process group's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def kept_matmul_precision():
    """setup_distributed sets the float32 matmul precision for the whole process: put it back."""
    with matmul_precision_kept():
        yield


def test_each_torchrun_worker_gets_the_gpu_of_its_local_rank_and_mps_one_process_alone(monkeypatch,
                                                                                     two_gpus):
    """On a machine of two GPUs (made up here) the worker of LOCAL_RANK 1 trains on cuda:1, as all
    ranks on one GPU would run out of its memory; MPS, one device, goes to a plain process alone."""
    from gpt2_ddp.device import choose_device
    for device in ("auto", "cuda"):
        assert choose_device(load_config([f"--device={device}"]), 1, True) == torch.device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    auto = load_config(["--device=auto"])
    assert choose_device(auto, 0, False) == torch.device("mps")
    assert choose_device(auto, 0, True) == torch.device("cpu")


def test_a_gpu_beyond_the_machines_is_refused_naming_those_it_has(two_gpus):
    from gpt2_ddp.device import named_device
    with pytest.raises(UserError, match=r"^--device=cuda:2: torch sees 2 CUDA device\(s\) here; pass "
                                        r"--device=cpu or cuda:0 to cuda:1$"):
        named_device("cuda:2")


def test_exact_reduction_on_a_gpu_turns_on_deterministic_kernels_and_cublas_fixed_workspace(monkeypatch):
    """A branch the CPU never takes: checked with torch's switch recorded rather than set."""
    from gpt2_ddp.device import make_deterministic
    switched = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, **kw: switched.append((on, kw)))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    make_deterministic(torch.device("cuda:0"))
    assert switched == [(True, {"warn_only": True})] and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_a_torchrun_worker_makes_the_gpu_of_its_local_rank_its_current_device(monkeypatch, two_gpus,
                                                                              kept_matmul_precision):
    """NCCL and CUDA calls that name no device use the current one, which must be the worker's own
    (on a made-up machine of two GPUs, as rank 1 of 2); float32 matmuls run in TF32, as nanoGPT's."""
    torch.set_float32_matmul_precision("highest")
    current, joined = [], []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(train_gpt2, "init_process_group",
                        lambda backend, **kwargs: joined.append((backend, kwargs["device_id"])))
    monkeypatch.setattr(train_gpt2, "wait_for_master", lambda timeout: None)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    config = load_config([*TINY, "--device=cuda"])
    assert train_gpt2.setup_distributed(config) == (1, 2, torch.device("cuda:1"))
    assert current == [torch.device("cuda:1")] and joined == [("nccl", torch.device("cuda:1"))]
    assert torch.get_float32_matmul_precision() == "high"


def test_the_default_out_dir_is_one_git_ignores():
    """A run without --out_dir writes its checkpoints to out/, which .gitignore keeps out of commits."""
    assert Config().out_dir == "out" and "/out/" in (ROOT / ".gitignore").read_text().splitlines()


def test_exact_reduction_on_the_cpu_runs_one_thread_unless_omp_num_threads_says(monkeypatch, plain_process,
                                                                               kept_matmul_precision):
    """A plain process sums in one thread, as torchrun's workers do, so its bits are theirs; a
    thread count the user set is kept, and the default mode keeps every thread."""
    threads = torch.get_num_threads()
    try:
        for env, exact, expected in ((None, "true", 1), ("2", "true", 2), (None, "false", 2)):
            torch.set_num_threads(2)
            if env is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", env)
            train_gpt2.setup_distributed(load_config([*TINY, "--device=cpu", f"--exact_reduction={exact}"]))
            assert torch.get_num_threads() == expected, (env, exact)
    finally:
        torch.set_num_threads(threads)


def test_token_ids_come_from_the_manifest_or_one_scan_kept_in_out_dir(tmp_path):
    """prepare_data's manifest is trusted where a shard's name, size and mtime match it; other
    shards are read once, and the result is kept in out_dir keyed by size and mtime: a shard
    rewritten in place (same size and mtime) is not read again, one with a new mtime is."""
    from gpt2_ddp import shards
    data = tmp_path / "data"
    make_shards(data)
    paths = sorted(data.glob("*.bin"))  # train 1, train 2, val
    cache = tmp_path / "token_ids.json"
    reduce_max = lambda values: values  # noqa: E731 (one process)
    assert shards.max_token_ids(paths, cache, 0, 1, reduce_max) == [63, 63, 63]
    assert shards.max_token_ids(paths[1:], cache, 0, 1, reduce_max) == [63, 63]
    stat = paths[0].stat()
    write_shard(paths[0], np.full(2000, 500))  # same size as before
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert shards.max_token_ids(paths, cache, 0, 1, reduce_max)[0] == 63  # from the cache
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert shards.max_token_ids(paths, cache, 0, 1, reduce_max)[0] == 500  # read again
    manifest = {"shards": [{"file": p.name, "bytes": p.stat().st_size, "tokens": 0,
                            "mtime_ns": p.stat().st_mtime_ns, "max_token_id": 7} for p in paths[1:]]}
    (data / "tiny_manifest.json").write_text(json.dumps(manifest))
    cache.unlink()
    assert shards.max_token_ids(paths, cache, 0, 1, reduce_max) == [500, 7, 7]


class ReachedConfig(Exception):
    """Raised in place of reading the config: main() got past its torch version check."""


def reach_config(argv):
    raise ReachedConfig


@pytest.mark.parametrize("version, refused", [
    ("2.7.1+cu126", True), ("2.8.0a0+5228986c39.nv25.06", False), ("2.8.0+cu128", False),
    ("2.10.0", False),
])
def test_a_torch_older_than_requirements_floor_is_refused_in_one_line(monkeypatch, version, refused):
    floor = re.search(r"^torch>=([0-9.]+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert "%d.%d" % TORCH_FLOOR == floor
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(train_gpt2, "load_config", reach_config)
    message = f"torch {re.escape(version)} is older than 2.8, the oldest .*: pip install 'torch>=2.8'"
    with pytest.raises(UserError, match=message) if refused else pytest.raises(ReachedConfig):
        train_gpt2.main([])


@pytest.mark.parametrize("toml, message", [
    ("n_layer = 3\nmax_lr = \n", "config file .*c.toml is not valid TOML: .*at line 2"),
    ("n_layer = [1, 2]\n", "config key 'n_layer': cannot read \\[1, 2\\] as int"),
    ("n_layer = true\n", "config key 'n_layer': cannot read True as int"),
    ('data_dir = ["a"]\n', "config key 'data_dir': cannot read \\['a'\\] as str"),
])
def test_toml_errors_name_the_file_line_or_key(tmp_path, toml, message):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(UserError, match=message):
        load_config([str(path)])


def test_unknown_key_in_toml_is_refused(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("n_layers = 3\n")
    with pytest.raises(UserError, match="unknown config key 'n_layers'; did you mean 'n_layer'"):
        load_config([str(toml)])


def test_every_config_key_passes_through_torchrun():
    """torchrun rejects script flags that are its own or ambiguous prefixes of its own."""
    parser = get_args_parser()
    for field in Config.__dataclass_fields__:
        arg = f"--{field}=1"
        args = parser.parse_args(["--standalone", "train_gpt2.py", arg])
        assert args.training_script_args == [arg], field


def test_help_lists_every_key():
    out = subprocess.run([sys.executable, "train_gpt2.py", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    # the launch commands of the module's docstring as written, a blank line, then the keys
    assert out.startswith(f"usage: python train_gpt2.py [CONFIG.toml] [--key=value ...]\n"
                          f"{train_gpt2.__doc__}\nConfig keys, their defaults and what they do:\n  --")
    assert train_gpt2.__doc__.endswith("\n")
    # each key's line, with its description there or on the lines below (a long default)
    entries = re.split(r"^  (?=--)", out.split("what they do:\n")[1], flags=re.M)[1:]
    keys = [re.fullmatch(r'--(\w+)=("(?:[^"\\]|\\.)*"|\S+)\s+(.+)', entry, re.S) for entry in entries]
    assert [key[1] for key in keys] == list(Config.__dataclass_fields__)
    for key in keys:  # a default, then a description
        assert len(key[3].split()) >= 2, key[0]


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.toml")):
        load_config([str(path)])


def test_batch_size_that_does_not_divide_fails_before_training(tiny_data, tmp_path):
    proc = subprocess.run(
        [sys.executable, "train_gpt2.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}/o",
         "--total_batch_size=100"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert "total_batch_size=100 is not divisible by micro_batch_size * seq_len * world_size" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_total_batch_size_that_divides_over_one_rank_but_not_two_is_refused():
    """grad_accum_steps divides total_batch_size by micro_batch_size * seq_len * world_size: 3
    micro-batches a step are 3 micro-steps on one rank, and refused in one line at world size 2."""
    config = load_config([*TINY, "--total_batch_size=96"])  # TINY's micro-batch: 2 x 16 tokens
    assert train_gpt2.grad_accum_steps(config, 1) == 3
    with pytest.raises(UserError) as refused:
        train_gpt2.grad_accum_steps(config, 2)
    assert str(refused.value) == ("total_batch_size=96 is not divisible by micro_batch_size * seq_len * "
                                  "world_size = 2*16*2 = 64; change total_batch_size or micro_batch_size")


# --- model --------------------------------------------------------------------------------------

def test_gpt2_124m_names_shapes_and_size_are_transformers_gpt2s():
    """GPT at its default config, GPT-2 124M with the vocabulary padded to 50304, holds the tensors
    of transformers' GPT2LMHeadModel (an independent implementation) of that config: the same names
    and shapes (Conv1D's weights the transpose of our Linear's) and as many parameters, wte and
    lm_head one tensor counted once, as GPT-2 ties them."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = Config()
    with torch.device("meta"):
        model = GPT(config)
        reference = GPT2LMHeadModel(GPT2Config(vocab_size=config.vocab_size, n_positions=config.block_size,
                                               n_embd=config.n_embd, n_layer=config.n_layer,
                                               n_head=config.n_head))
    ours, theirs = model.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        expected = theirs[name].t() if name.endswith(CONV1D) else theirs[name]
        assert tensor.shape == expected.shape, name
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(Config(n_layer=8, n_embd=256, n_head=4, vocab_size=1024, block_size=64))
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 1e-3
    assert abs(model.transformer.h[0].mlp.c_proj.weight.std().item() - 0.02 / 4) < 2e-4


def test_initial_loss_is_log_vocab():
    torch.manual_seed(0)
    model = GPT(Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1024, block_size=32))
    x, y = torch.randint(0, 1024, (2, 4, 32))
    _, loss = model(x, y)
    assert abs(loss.item() - np.log(1024)) < 0.1


# --- data loader --------------------------------------------------------------------------------

def loader(data_dir, rank=0, world_size=1, B=2, T=16, split="train"):
    return DataLoader(data_dir, split, B, T, rank, world_size, torch.device("cpu"))


@pytest.mark.parametrize("n_train, batches", [(100, 6), (96, 5), (97, 6), (21, 1)])
def test_loader_crosses_shard_boundaries_and_wraps(tmp_path, n_train, batches):
    """Micro-batches of the stream across its shards, each needing B*T+1 tokens, so a stream of an
    exact multiple of B*T (96 = 6 * 16) holds one micro-batch fewer than it has B*T's in it, and one
    of 97 ends its last micro-batch at the stream's last token; the epoch then wraps to the first token.
    Shards of 7 tokens, shorter than a row of 17, have a row that runs through all three."""
    stream = make_shards(tmp_path, n_train=n_train, train_shards=3)  # shards of about n_train / 3
    dl = loader(tmp_path, B=1, T=16)
    assert dl.batches_per_epoch == batches
    for g in range(dl.batches_per_epoch):
        x, y = dl.next_batch()
        assert x.dtype == torch.int64 and x.shape == (1, 16)
        assert x.flatten().tolist() == stream[g * 16:g * 16 + 16].tolist()
        assert y.flatten().tolist() == stream[g * 16 + 1:g * 16 + 17].tolist()
    x, _ = dl.next_batch()  # a new epoch starts from the first token
    assert x.flatten().tolist() == stream[:16].tolist()


def test_a_split_one_token_short_of_a_micro_batch_is_refused_in_one_line(tmp_path):
    """A micro-batch reads B*T+1 tokens: a split of B*T+1 holds one, a split of B*T none."""
    make_shards(tmp_path, n_train=17, train_shards=1)
    assert loader(tmp_path, B=1, T=16).batches_per_epoch == 1
    make_shards(tmp_path, n_train=16, train_shards=1)
    with pytest.raises(UserError, match=f"^train split in {tmp_path} has 16 tokens, fewer than one "
                                        f"micro-batch of B\\*T\\+1 = 17; lower micro_batch_size or seq_len$"):
        loader(tmp_path, B=1, T=16)


def write_llm_c_shard(path, tokens):
    """A shard as llm.c's dev/data/data_common.py write_datafile writes it (GPT-2 tokens)."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(tokens, dtype=np.uint16).tobytes())


def test_llm_c_shards_without_an_index_are_a_split_of_their_dataset(tmp_path):
    """llm.c's dev/data/tinyshakespeare.py writes tiny_shakespeare_val.bin and
    tiny_shakespeare_train.bin, one shard a split with no index."""
    rng = np.random.default_rng(0)
    streams = {"val": markov_tokens(rng, 100, 512), "train": markov_tokens(rng, 200, 512)}
    for split, stream in streams.items():
        write_llm_c_shard(tmp_path / f"tiny_shakespeare_{split}.bin", stream)
    for split, stream in streams.items():
        dl = loader(tmp_path, B=2, T=16, split=split)
        x, y = dl.next_batch()
        assert x.flatten().tolist() == stream[:32].tolist() and y.flatten().tolist() == stream[1:33].tolist()

    # beside llm.c's fineweb names, which carry an index, they are another dataset to choose
    write_llm_c_shard(tmp_path / "fineweb_val_000000.bin", streams["val"])
    write_llm_c_shard(tmp_path / "fineweb_train_000001.bin", streams["train"])
    with pytest.raises(UserError, match=r"holds the shards of 2 datasets \(fineweb, tiny_shakespeare\): "
                                        r"pass --dataset=NAME"):
        loader(tmp_path)
    assert split_paths(tmp_path, "train", "tiny_shakespeare") == [tmp_path / "tiny_shakespeare_train.bin"]
    assert split_paths(tmp_path, "val", "fineweb") == [tmp_path / "fineweb_val_000000.bin"]
    # the two forms of one dataset's names are one stream, in name order
    write_llm_c_shard(tmp_path / "tiny_shakespeare_train_000002.bin", streams["val"])
    assert split_paths(tmp_path, "train", "tiny_shakespeare") == [
        tmp_path / "tiny_shakespeare_train.bin", tmp_path / "tiny_shakespeare_train_000002.bin"]
    with pytest.raises(UserError, match=r"no val shards \(books_val_NNNNNN.bin or llm.c's books_val.bin\)"):
        DataLoader(tmp_path, "val", 2, 16, 0, 1, torch.device("cpu"), dataset="books")


def test_loader_world_sizes_1_and_2_deliver_the_same_micro_batches(tmp_path):
    make_shards(tmp_path, n_train=3000)
    single = loader(tmp_path)
    ranks = [loader(tmp_path, rank=r, world_size=2) for r in range(2)]
    for _ in range(20):  # one step of 4 micro-batches: 4 calls on one process, 2 on each rank
        for r in range(2):
            x1, y1 = single.next_batch()
            x2, y2 = ranks[r].next_batch()
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert single.state_dict() == ranks[0].state_dict() == ranks[1].state_dict()


def test_loader_state_dict_resumes_position(tmp_path):
    make_shards(tmp_path)
    a = loader(tmp_path)
    for _ in range(5):
        a.next_batch()
    b = loader(tmp_path)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    # another micro_batch_size reads on from the same token: the next 2 sequences of B=1 are
    # the next micro-batch of B=2
    c = loader(tmp_path, B=1)
    c.load_state_dict(b.state_dict())
    assert torch.equal(torch.cat([c.next_batch()[0], c.next_batch()[0]]), b.next_batch()[0])
    with pytest.raises(UserError, match="stopped at token .*, not a whole number of this run's "
                                        "micro-batches of 5\\*16 tokens: resume with the "
                                        "checkpoint's seq_len and total_batch_size"):
        loader(tmp_path, B=5).load_state_dict(a.state_dict())  # 192 tokens read
    with pytest.raises(UserError, match="micro-batches of 2\\*20 tokens"):  # B divides 192, B*T does not
        loader(tmp_path, B=2, T=20).load_state_dict(a.state_dict())



def test_a_prefetched_micro_batch_is_the_next_one_and_moves_no_position(tmp_path):
    """prefetch() reads what next_batch() gives next without moving batch_index (a checkpoint saved
    after it resumes at the same place); after the position moves back or on, a stale prefetch is
    not used."""
    make_shards(tmp_path)
    a, b = loader(tmp_path, rank=1, world_size=2), loader(tmp_path, rank=1, world_size=2)
    a.next_batch()
    b.next_batch()
    state = a.state_dict()
    a.prefetch()
    assert a.state_dict() == state
    assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))
    a.prefetch()
    a.batch_index -= 2  # as a step that met a changed shard rolls back
    b.batch_index -= 2
    assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))
    assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))


def test_a_shard_rewritten_in_place_under_the_loader_is_named_and_not_read(tmp_path):
    """A shard rewritten in place (the same inode and size, a new mtime) after the loader opened it
    gives zeros, not its new tokens, and raise_changed names it in one line."""
    stream = make_shards(tmp_path, n_train=128, train_shards=2)
    dl = loader(tmp_path, B=1, T=16)
    assert dl.next_batch()[0].flatten().tolist() == stream[:16].tolist()
    shard, before = tmp_path / "tiny_train_000001.bin", (tmp_path / "tiny_train_000001.bin").stat()
    with open(shard, "r+b") as f:
        f.seek(1024 + 2 * 16)  # the tokens of the next micro-batch
        f.write(np.full(16, 7, dtype="<u2").tobytes())
    # a rewrite within the clock's tick keeps the old mtime: the test moves it on itself
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    after = shard.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    x, y = dl.next_batch()
    assert x.flatten().tolist() == [0] * 16 and y.flatten().tolist() == [0] * 16
    with pytest.raises(UserError, match=f"^shard {shard} changed while this run read it \\(replaced or "
                                        f"rewritten\\): the run stopped at its last step, saved"):
        dl.raise_changed()


def test_a_shard_replaced_by_a_new_file_after_the_loader_opened_it_is_named_and_not_read(tmp_path):
    """The loader keeps a shard open: a new file renamed over it (as write_shard does) is seen at
    its path, where the open file still looks unchanged, and gives zeros, not the old tokens."""
    stream = make_shards(tmp_path, n_train=128, train_shards=2)
    dl = loader(tmp_path, B=1, T=16)
    assert dl.next_batch()[0].flatten().tolist() == stream[:16].tolist()
    shard = tmp_path / "tiny_train_000001.bin"
    write_shard(shard, np.full(64, 7))
    x, y = dl.next_batch()
    assert x.flatten().tolist() == [0] * 16 and y.flatten().tolist() == [0] * 16
    with pytest.raises(UserError, match="^" + re.escape(
            f"shard {shard} changed while this run read it (replaced or rewritten): the run stopped at "
            f"its last step, saved, untrained on the change; restore the shard and rerun to resume, or "
            f"rerun with --allow_new_data=true to go on in the new shards") + "$"):
        dl.raise_changed()


def test_a_micro_batch_checks_each_shard_it_reads_once_and_an_open_file_when_opened(tmp_path, monkeypatch):
    """A shuffled micro-batch of 8 rows over 2 shards stats each shard's path once, and each open
    file only when it is opened; a sequential one (4 x 16 + 1 tokens) alike, within a shard or across."""
    from gpt2_ddp.tokenizer import EOT_TOKEN
    stream = make_shards(tmp_path, n_train=170, train_shards=2)
    stream[::17] = EOT_TOKEN  # documents of T + 1 tokens: 5 rows a shard
    write_shard(tmp_path / "tiny_train_000001.bin", stream[:85])
    write_shard(tmp_path / "tiny_train_000002.bin", stream[85:])
    calls = []
    for name in ("stat", "fstat"):
        monkeypatch.setattr(os, name, lambda path, _f=getattr(os, name), _name=name, **kwargs: (
            calls.append(_name) if _name == "fstat" or str(path).endswith(".bin") else None)
                            or _f(path, **kwargs))
    shuffled = DataLoader(tmp_path, "train", 8, 16, 0, 1, torch.device("cpu"), order="shuffled")
    assert [{int(s) // 85 for s in shuffled.rows.starts(g * 8, 8)} for g in (0, 1)] == [{0, 1}] * 2
    sequential = DataLoader(tmp_path, "train", 4, 16, 0, 1, torch.device("cpu"))  # 65 tokens from 0, 64
    for dl, counts in ((shuffled, [(2, 2), (2, 0)]), (sequential, [(1, 1), (2, 1), (1, 0)])):
        for expected in counts:
            calls.clear()
            dl.next_batch()
            assert (calls.count("stat"), calls.count("fstat")) == expected and dl.changed is None


def test_a_val_shard_replaced_under_a_run_stops_it_with_one_line_naming_it(tmp_path, monkeypatch):
    """A new file renamed over the val shard after the loaders opened it: the first evaluation stops
    the run, which ends in the one line naming that shard, as for a train shard."""
    from conftest import train_here
    make_shards(tmp_path / "data")
    val, make_loaders = tmp_path / "data" / "tiny_val_000000.bin", train_gpt2.make_loaders
    monkeypatch.setattr(train_gpt2, "make_loaders", lambda *args: (make_loaders(*args), write_shard(
        val, np.full(1000, 7)))[0])
    with pytest.raises(UserError, match=f"^shard {val} changed while this run read it \\(replaced or "
                                        f"rewritten\\): the run stopped at its last step"):
        train_here([*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}",
                    "--total_batch_size=32", "--max_steps=4"])


def test_shards_linked_into_a_data_dir_are_read_through_their_links(tmp_path):
    """A data_dir of symlinks to shards kept elsewhere (a shared disk) is the shards it points to:
    read as they are, not taken for replaced files."""
    stream = make_shards(tmp_path / "kept", n_train=128, train_shards=2)
    (tmp_path / "linked").mkdir()
    for shard in (tmp_path / "kept").glob("*.bin"):
        (tmp_path / "linked" / shard.name).symlink_to(shard)
    dl = loader(tmp_path / "linked", B=1, T=16)
    batches = [dl.next_batch()[0].flatten().tolist() for _ in range(6)]
    assert batches == [stream[16 * i:16 * (i + 1)].tolist() for i in range(6)] and dl.changed is None


def test_a_short_read_of_a_shard_is_named_in_one_line(tmp_path, monkeypatch):
    """preadv reading fewer bytes than asked (a shard cut short under the read, by a token or by
    half of one) gives a whole micro-batch of zeros, not the part it read, in either order, and
    raise_changed names the shard, rather than a micro-batch of the wrong shape or numpy's error."""
    from gpt2_ddp.tokenizer import EOT_TOKEN
    stream = make_shards(tmp_path, n_train=128, train_shards=2)
    for order, short in (("sequential", 2), ("shuffled", 2), ("shuffled", 1)):
        if order == "shuffled":  # documents of T + 1 tokens, each after an <|endoftext|>
            stream[::17] = EOT_TOKEN
            write_shard(tmp_path / "tiny_train_000001.bin", stream[:68])
            write_shard(tmp_path / "tiny_train_000002.bin", stream[68:])
        dl = DataLoader(tmp_path, "train", 2, 16, 0, 1, torch.device("cpu"), order=order)
        with monkeypatch.context() as patch:
            preadv = os.preadv
            patch.setattr(os, "preadv", lambda fd, buffers, offset: preadv(fd, buffers, offset) - short)
            x, y = dl.next_batch()
        assert x.shape == y.shape == (2, 16) and not x.any() and not y.any()
        with pytest.raises(UserError, match=f"^shard {tmp_path}/tiny_train_00000[12].bin changed while "
                                            f"this run read it \\(cut short\\): the run stopped"):
            dl.raise_changed()


# run in a fresh process: the growth of its peak RSS (VmHWM, MiB) over reading 50 micro-batches
# of 8 x 1024 spread over the shard, as a resumed run jumps to them
LOADER_RSS = """
import sys, numpy as np, torch, train_gpt2
def peak():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
before = peak()
loader = train_gpt2.DataLoader(sys.argv[1], "train", 8, 1024, 0, 1, torch.device("cpu"))
for g in np.linspace(0, loader.batches_per_epoch - 1, 50).astype(int):
    loader.load_state_dict({"tokens": int(g) * 8 * 1024})
    loader.next_batch()
print(peak() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM is Linux's")
def test_loader_host_memory_stays_flat_as_the_shard_grows(tmp_path):
    """The loader reads each micro-batch with pread (nanoGPT #287): over a shard of 4e7 tokens
    (76 MiB as uint16, 305 MiB as int64) a fresh process's peak RSS grows by well under a quarter
    of the shard, as over a shard of 1e6; a loader holding the shard in RAM would grow by all of it."""
    rng = np.random.default_rng(0)
    growth = {}
    for size in (10**6, 4 * 10**7):
        data = tmp_path / str(size)
        data.mkdir()
        write_shard(data / "rand_val_000000.bin", rng.integers(0, 50257, size // 10, dtype=np.uint16))
        write_shard(data / "rand_train_000001.bin", rng.integers(0, 50257, size, dtype=np.uint16))
        proc = subprocess.run([sys.executable, "-c", LOADER_RSS, str(data)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        growth[size] = float(proc.stdout)
    assert growth[4 * 10**7] < 0.25 * 76, growth


# run in a fresh process: the page faults of a second 128 MiB array after the first was freed
FREED_MEMORY_FAULTS = """
import resource, numpy as np
from train_gpt2 import Config, setup_distributed
setup_distributed(Config(device="cpu"))
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.ones(1 << 24)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(faults())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_a_cpu_run_keeps_freed_memory_so_a_steps_tensors_fault_in_no_page_again():
    """A CPU run's setup makes glibc keep freed blocks (docs/perf.md): a 128 MiB array allocated
    again after it was freed page-faults in fewer pages than its 64 huge pages of 2 MiB, where
    glibc's defaults unmap it and fault every page in again, each step."""
    proc = subprocess.run([sys.executable, "-c", FREED_MEMORY_FAULTS], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) < 64, proc.stdout


def corrupt_empty(path):
    path.write_bytes(b"")


def corrupt_header(path):
    path.write_bytes(path.read_bytes()[:1023])


def corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:-10])


def corrupt_magic(path):
    data = bytearray(path.read_bytes())
    data[0:4] = np.int32(12345).tobytes()
    path.write_bytes(bytes(data))


def corrupt_count(path):
    data = bytearray(path.read_bytes())
    data[8:12] = np.int32(-3).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt, message", [
    (corrupt_empty, "is truncated or empty \\(0 bytes\\)"),
    (corrupt_header, "is truncated or empty \\(1023 bytes\\)"),  # a byte short of its header
    (corrupt_truncate, "holds 495 tokens but its header says 500"),
    (corrupt_magic, "bad header \\(magic 12345, version 1, expected 20240520, 1\\): not a token shard"),
    (corrupt_count, "has a negative token count in its header \\(-3\\): corrupt"),
])
def test_corrupt_shard_names_the_file_and_the_fix(tmp_path, corrupt, message):
    make_shards(tmp_path, n_train=1000)
    bad = tmp_path / "tiny_train_000001.bin"
    corrupt(bad)
    with pytest.raises(UserError, match=message) as info:
        loader(tmp_path)
    assert str(bad) in str(info.value) and "python prepare_data.py" in str(info.value)


def test_missing_shards_name_the_command_that_makes_them(tmp_path):
    with pytest.raises(UserError, match=f"no train shards .* make them with `python prepare_data.py "
                                        f"--input FILES --name nowhere --output_dir {tmp_path}/nowhere`"):
        loader(tmp_path / "nowhere")
    with pytest.raises(UserError, match=re.escape(
            f"{tmp_path}/data/fineweb-edu, which does not exist; make them with `bash "
            f"scripts/prepare_fineweb_edu.sh --output_dir {tmp_path}/data/fineweb-edu`, then rerun `python "
            f"{shlex.join(sys.argv)}`; or try the small CPU config: python prepare_data.py && python "
            f"train_gpt2.py configs/shakespeare_cpu.toml")):
        loader(tmp_path / "data" / "fineweb-edu")
    write_shard(tmp_path / "x_train_000001.bin", np.arange(100))
    loader(tmp_path)
    with pytest.raises(UserError, match="no val shards"):
        loader(tmp_path, split="val")


# --- training runs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """The runs of the DDP tests below, in out/{one,two,default,view}, the world size 2 ones in one
    launch; returns (out, the console of `one`). one and two: TINY without biases for 6 steps at
    world sizes 1 and 2; default and view: 4 steps at world size 2, with DDP's default buckets (and a
    made-up peak, for MFU) and with gradients as views of 1 MB buckets."""
    out = tmp_path_factory.mktemp("ddp_runs")
    make_shards(out / "data")
    common = [*TINY, f"--data_dir={out / 'data'}", "--total_batch_size=128", "--bias=false"]
    console = run_training([*common, "--max_steps=6", f"--out_dir={out}/one"]).stdout
    train_together([[*common, "--max_steps=6", f"--out_dir={out}/two"],
                    [*common, "--max_steps=4", f"--out_dir={out}/default", "--peak_flops=1e9"],
                    [*common, "--max_steps=4", f"--out_dir={out}/view", "--gradient_as_bucket_view=true",
                     "--bucket_cap_mb=1"]], 2)
    return out, console


@pytest.mark.compat
def test_ddp_two_processes_match_one_process(ddp_runs):
    """2 gloo ranks x 2 micro-steps train the same model as 1 process x 4 micro-steps.

    Default mode (no exact_reduction): float32 sums in another order, so a tolerance; measured
    differences are ~1e-7 relative. The test model has no biases: the key bias of c_attn has a
    gradient that is 0 in exact arithmetic, so its float noise, scaled by AdamW up to +-lr, would
    differ between the runs without changing any output (softmax ignores a shift of the keys).
    """
    tmp_path, console = ddp_runs
    # progress: each step of max_steps, and the time left at the average pace
    assert re.search(r"^step +5/6 \| loss: [\d.]+ \| .* \| tok/sec: [\d.]+ \| eta 0:00:00$", console, re.M)
    (steps1, evals1), (steps2, evals2) = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert [s["step"] for s in steps1] == [s["step"] for s in steps2] == list(range(1, 7))
    np.testing.assert_allclose([s["loss"] for s in steps2], [s["loss"] for s in steps1], rtol=1e-5)
    np.testing.assert_allclose([e["val_loss"] for e in evals2], [e["val_loss"] for e in evals1],
                               rtol=1e-5)
    assert steps1[-1]["loss"] < steps1[0]["loss"]  # it trained
    m1 = torch.load(tmp_path / "one" / "ckpt_0000006.pt", weights_only=True)["model"]
    m2 = torch.load(tmp_path / "two" / "ckpt_0000006.pt", weights_only=True)["model"]
    for name in m1:
        torch.testing.assert_close(m2[name], m1[name], rtol=1e-4, atol=1e-5, msg=name)


# --- speed accounting -----------------------------------------------------------------------------

def test_flops_per_token_against_torchs_flop_counter():
    """flops_per_token(T), PaLM's 6N + 12 * n_layer * n_embd * T, against torch's FlopCounterMode
    on one forward and backward of the model over T tokens (meta device): the counter sees every
    matmul (the Linears' and attention's, whole T x T as PaLM counts it), and 6N adds 6 FLOPs a
    token for each parameter that no matmul or lookup uses (biases, LayerNorm gains)."""
    from torch.utils.flop_counter import FlopCounterMode
    config = Config(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=512, bias=True)
    with torch.device("meta"):
        model = GPT(config)
    held = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    others = sum(p.numel() for p in model.parameters() if id(p) not in held)
    assert others > 0
    for T in (config.block_size, config.block_size // 4):
        idx = torch.zeros(1, T, dtype=torch.long, device="meta")
        with FlopCounterMode(display=False) as counter:
            model(idx, idx)[1].backward()
        assert model.flops_per_token(T) * T == counter.get_total_flops() + 6 * others * T, T


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12), ("NVIDIA H100 80GB HBM3", "float32", 495e12),
    ("NVIDIA H100 PCIe", "float16", 756e12), ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12), ("NVIDIA A100-SXM4-80GB", "float32", 156e12),
    ("Tesla V100-SXM2-16GB", "float16", 125e12), ("Tesla T4", "float16", 65e12),
    ("Tesla T4", "float32", 8.1e12), ("NVIDIA GeForce RTX 4090", "bfloat16", None), ("cpu", "float32", None)])
def test_peak_flops_by_device_name_and_dtype(name, dtype, peak):
    """float32's peak is TF32's from Ampere on (matmul precision "high"), plain float32's before."""
    assert metrics.peak_flops(name, dtype) == peak


def test_mfu_is_logged_where_the_peak_is_known(monkeypatch, tiny_data, tmp_path, capsys):
    """On a GPU in PEAK_FLOPS each step logs mfu = FLOPs per step / dt / peak; here a CPU
    stands in, given a made-up peak, since CI has no GPU."""
    peak = 1e9
    monkeypatch.setattr(metrics, "peak_flops", lambda name, dtype: peak)
    train_gpt2.main([*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
                     "--total_batch_size=64", "--max_steps=3"])
    steps, _ = read_log(tmp_path)
    for s in steps:
        assert s["mfu"] == pytest.approx(expected_mfu(s, TINY, 64, peak), rel=1e-9)
    out = capsys.readouterr().out
    assert out.count("| mfu: ") == 3 and "MFU not reported" not in out
    for s in steps:  # the console shows it in percent
        assert f"step {s['step']:5d}/3 | " in out and f" | mfu: {s['mfu'] * 100:.1f}%" in out


def test_a_checkpoint_whose_optimizer_groups_this_run_regroups_is_refused(tiny_data, tmp_path, monkeypatch):
    """A fork that regroups the parameters (here: one weight moved into a third AdamW group) cannot
    load the old optimizer state into its groups, though the optimizer is the same: refused."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--total_batch_size=64"]
    train_gpt2.main([*args, "--max_steps=1"])
    configure = train_gpt2.GPT.configure_optimizers

    def three_groups(self, config, device_type):
        optimizer = configure(self, config, device_type)
        first = optimizer.param_groups[0]
        moved = first["params"].pop()
        optimizer.add_param_group({**{k: v for k, v in first.items() if k != "params"}, "params": [moved]})
        return optimizer

    monkeypatch.setattr(train_gpt2.GPT, "configure_optimizers", three_groups)
    ckpt = tmp_path / "ckpt_0000001.pt"
    groups = [len(g["params"]) for g in torch.load(ckpt, weights_only=True)["optimizer"]["param_groups"]]
    with pytest.raises(UserError, match=f"^checkpoint {ckpt} was trained with optimizer=adamw and parameter "
                                        f"groups of {re.escape(str(groups))} tensors, which this run's "
                                        f"optimizer cannot continue"):
        train_gpt2.main([*args, "--max_steps=2"])


def test_a_run_in_this_process_leaves_the_signal_handlers_as_it_found_them(tiny_data, tmp_path):
    """The loop's SIGINT and SIGTERM handlers end with the run: left behind, they made the workers
    of a later multiprocessing.Pool in the same process survive the SIGTERM that ends them, and
    the pool waited for them forever."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    train_gpt2.main([*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
                     "--total_batch_size=64", "--max_steps=1"])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_no_mfu_is_logged_where_the_peak_is_unknown(tiny_data, tmp_path, capsys):
    train_gpt2.main([*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
                     "--total_batch_size=64", "--max_steps=2"])
    steps, _ = read_log(tmp_path)
    assert all("mfu" not in s for s in steps)
    out = capsys.readouterr().out
    assert out.count("MFU not reported on cpu: it is measured against a GPU's peak FLOP/s") == 1
    assert "| mfu: " not in out


def test_token_ids_checked_by_two_ranks_are_each_shards_largest(ddp_runs):
    """At world size 2 each shard is read by one rank, the other contributing -1, and the maxima are
    all-reduced: out_dir's token_ids.json holds each shard's largest token id, as at world size 1."""
    tmp_path, _ = ddp_runs
    largest = {str(p.resolve()): int(read_tokens(p).max()) for p in (tmp_path / "data").glob("*.bin")}
    for run in ("one", "two"):
        kept = json.loads((tmp_path / run / "token_ids.json").read_text())
        assert {path: entry["max_token_id"] for path, entry in kept.items()} == largest, run


def test_ddp_bucket_options_train_the_same_model(ddp_runs):
    tmp_path, _ = ddp_runs
    np.testing.assert_allclose([s["loss"] for s in read_log(tmp_path / "view")[0]],
                               [s["loss"] for s in read_log(tmp_path / "default")[0]], rtol=1e-6)


def test_mfu_at_world_size_2_is_each_gpus_share_of_the_peak(ddp_runs):
    """MFU divides a step's FLOPs over every rank's peak: 2 ranks doing one step's work in dt each
    use half of what one rank would."""
    steps = read_log(ddp_runs[0] / "default")[0]
    assert len(steps) == 4
    for s in steps:
        assert s["mfu"] == pytest.approx(expected_mfu(s, [*TINY, "--bias=false"], 128, 1e9 * 2), rel=1e-9)


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_bf16_gradient_compression_is_refused_on_gloo(monkeypatch, world_size):
    """As torchrun's rank 0 of 2 on the CPU: refused before the process group is joined. Of 1 too:
    torchrun --nproc_per_node=1 sets RANK, so the run is launched and joins a group of one."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="grad_compression=bf16 needs NCCL"):
        train_gpt2.setup_distributed(load_config([*TINY, "--grad_compression=bf16", "--collective_timeout_s=2"]))


def test_bf16_gradient_compression_is_no_error_in_one_plain_process(plain_process, kept_matmul_precision):
    """One process run by plain python all-reduces nothing, so a GPU config's bf16 runs on the CPU."""
    config = load_config([*TINY, "--grad_compression=bf16", "--device=cpu"])
    assert train_gpt2.setup_distributed(config) == (0, 1, torch.device("cpu"))


def test_a_compiled_run_says_that_its_first_step_waits_for_compilation(capsys):
    """torch.compile compiles at the first call, so the wrapping alone is quick, and says so."""
    config = load_config([*TINY, "--compile=true"])
    train_gpt2.parallelize(GPT(config), config, torch.device("cpu"))
    assert "torch.compile: the first step waits while the model compiles" in capsys.readouterr().out
    train_gpt2.parallelize(GPT(config), dataclasses.replace(config, compile=False), torch.device("cpu"))
    assert "torch.compile" not in capsys.readouterr().out


def test_ddp_options_reach_ddp():
    """These options change DDP's memory, buckets or compilation but no logged number, so DDP is asked."""
    config = load_config(TINY)
    x = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    DDP, Compiled = torch.nn.parallel.DistributedDataParallel, type(torch.compile(torch.nn.Identity()))

    def wrapped(**options):
        return train_gpt2.parallelize(GPT(config), dataclasses.replace(config, **options),
                                      torch.device("cpu"))[0]

    def grad_storages(model):
        model(x, x)[1].backward()
        return len({p.grad.untyped_storage().data_ptr() for p in model.parameters()})

    def wrappers(model):  # the modules around the GPT, outermost first
        inner = model.module if isinstance(model, DDP) else getattr(model, "_orig_mod", None)
        return [type(model), *wrappers(inner)] if inner is not None else []

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        views = wrapped(gradient_as_bucket_view=True, bucket_cap_mb=1)
        assert grad_storages(wrapped()) == len(list(views.parameters())) and grad_storages(views) == 1
        assert views.bucket_bytes_cap == 2**20  # one process has one bucket; more split at this size
        assert [wrappers(wrapped(compile=True, compile_ddp=c)) for c in (False, True)] == [
            [DDP, Compiled], [Compiled, DDP]]
        assert wrappers(wrapped(compile=True)) == [DDP, Compiled]  # nanoGPT's order unless compile_ddp
        exact = [wrapped(exact_reduction=True, compile=c, compile_ddp=d).module
                 for c, d in ((False, False), (True, False), (True, True))]  # exact mode's DDP, likewise
        assert [wrappers(model) for model in exact] == [[DDP], [DDP, Compiled], [Compiled, DDP]]
    finally:
        torch.distributed.destroy_process_group()
