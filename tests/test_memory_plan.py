"""The memory plan against what a CPU step holds, counted from the model and optimizer built;
activation checkpointing against runs without it (in test_sharding.py's and test_equivalence.py's
runs), and the GPT-2 size configs kept runnable."""

import dataclasses
import gc
import io
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import conftest
import train_gpt2
from conftest import ROOT, TINY, make_shards, read_log, run_training
from gpt2_ddp import memory_plan, precision
from gpt2_ddp.configurator import UserError
from scripts.memory_plan import main as memory_plan_main
from train_gpt2 import GPT, Config, load_config, memory_counts, meta_model

SMALL = Config(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=512, micro_batch_size=4,
               seq_len=128, sharding="ddp", dtype="float32")


def measure(config):
    """Bytes of parameters (and autocast's 16-bit copies of the matmul weights), gradients and
    optimizer state, as a dict, after one training step of `config` on the CPU under its dtype's
    autocast."""
    torch.manual_seed(0)
    model = GPT(config).train()
    idx = torch.randint(0, config.vocab_size, (config.micro_batch_size, config.seq_len))
    with precision.autocast(config.dtype, torch.device("cpu")):
        _, loss = model(idx, idx)
    loss.backward()
    optimizer = model.configure_optimizers(config, "cpu")
    optimizer.step()

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    copies = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return {"parameters": size(model.parameters()) + (copies if config.dtype != "float32" else 0),
            "gradients": size(p.grad for p in model.parameters()), "optimizer state": size(state)}


@pytest.mark.parametrize("checkpointing, optimizer, dtype", [(False, "adamw", "float32"),
                                                             (True, "muon", "float32"),
                                                             (False, "adamw", "bfloat16"),
                                                             (False, "adamw", "float16")])
def test_plan_matches_what_a_cpu_step_holds(checkpointing, optimizer, dtype):
    """Parameters, gradients and optimizer state (AdamW's two moments, or Muon's momentum for the
    blocks' matrices and AdamW's for the rest) exactly, and under bfloat16 and float16 autocast its
    16-bit copies of the matmul weights."""
    config = dataclasses.replace(SMALL, activation_checkpointing=checkpointing, optimizer=optimizer,
                                 dtype=dtype)
    planned = memory_plan.plan(config, 1, memory_counts(config))
    measured = measure(config)
    for part in ("parameters", "gradients", "optimizer state"):
        assert measured[part] == planned[part], part


def test_planning_leaves_the_garbage_collector_on():
    """The activations' trace turns the collector off for itself alone; training needs it on."""
    memory_counts(SMALL)
    assert gc.isenabled()


def test_zero2_and_fsdp_plan_a_world_sizes_share_of_the_optimizer_state():
    """ddp keeps AdamW's whole state (8 bytes a parameter) on each rank; zero2 and fsdp keep
    1/world_size of it (test_sharding.py measures that share in real runs)."""
    model = meta_model(SMALL)  # the activations, which the optimizer state does not involve, untraced
    counts = memory_plan.count(model, model.configure_optimizers(SMALL, "meta")) | {"activations": 0}
    state = 8 * sum(p.numel() for p in model.parameters())
    for world_size in (1, 4):
        for mode, share in (("ddp", 1), ("zero2", world_size), ("fsdp", world_size)):
            planned = memory_plan.plan(dataclasses.replace(SMALL, sharding=mode), world_size, counts)
            assert planned["optimizer state"] == state / share, (mode, world_size)


def test_the_plan_above_one_rank_counts_ddps_buckets_and_fsdps_shards():
    """At world size 4: DDP's buckets add a copy of the gradients unless gradient_as_bucket_view;
    zero2 adds a quarter slice to both parameters and gradients; fsdp keeps a quarter of exact_reduction's float64 sums, and in 16 bits its parameters' quarter
    plus the all-gathered root and two blocks (one rank alone uses no DDP)."""
    model = meta_model(SMALL)
    counts = memory_plan.count(model, model.configure_optimizers(SMALL, "meta")) | {"activations": 0}
    numel = sum(p.numel() for p in model.parameters())
    P = 4 * numel
    root = numel - sum(p.numel() for p in model.transformer.h.parameters())
    block = sum(p.numel() for p in model.transformer.h[0].parameters())

    def part(name, world_size=4, **changes):
        return memory_plan.plan(dataclasses.replace(SMALL, **changes), world_size, counts)[name]

    assert part("gradients", world_size=1) == P
    assert part("gradients") == 2 * P
    assert part("gradients", gradient_as_bucket_view=True) == P
    assert part("gradients", sharding="fsdp", exact_reduction=True) == 3 * P / 4
    assert part("parameters", sharding="zero2") == part("gradients", sharding="zero2") == P + P / 4
    assert part("parameters", sharding="fsdp", dtype="bfloat16") == P / 4 + 2 * (root + 2 * block)


def test_the_cpus_available_memory_counts_free_swap(monkeypatch):
    """A model that fits in memory and swap together runs (slowly) rather than being refused."""
    meminfo = {"/proc/meminfo": "MemTotal: 4000000 kB\nMemAvailable: 2000000 kB\nSwapFree: 1000000 kB\n"}
    monkeypatch.setattr(memory_plan, "open", lambda path: io.StringIO(meminfo[path]), raising=False)
    assert memory_plan.available_bytes(torch.device("cpu")) == (
        3072000000, "this machine has 2.9 GB available (memory and swap)")


def test_a_gpus_free_memory_is_cudas_and_a_device_without_a_figure_gives_none(monkeypatch):
    """CUDA's free memory on that GPU (asked without one, through a stand-in for mem_get_info); no
    figure for MPS, nor for a CPU whose /proc/meminfo cannot be read."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(5.5 * 2**30), 80 * 2**30) if device ==
                        torch.device("cuda", 1) else (0, 0))
    assert memory_plan.available_bytes(torch.device("cuda", 1)) == (int(5.5 * 2**30), "cuda:1 has 5.5 GB free")
    assert memory_plan.available_bytes(torch.device("mps")) is None

    def unreadable(path):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(memory_plan, "open", unreadable, raising=False)
    assert memory_plan.available_bytes(torch.device("cpu")) is None


def test_a_first_trace_longer_than_the_second_is_traced_again(monkeypatch):
    """One-time work that only the first pass in a process records (torch's lazy setup) must not
    reach the activations: that pass is traced again, and gives what later passes give."""
    config = dataclasses.replace(SMALL, n_layer=1)
    expected = memory_plan.activation_bytes(lambda: GPT(config), config)
    traced = []

    class FirstPassDoesMore(memory_plan.LiveBytes):
        def __exit__(self, *exc):
            if not traced:  # the one-time work: a storage made and kept
                self.trace.append(self.trace[-1] + 4096)
            traced.append(self)
            return super().__exit__(*exc)

    monkeypatch.setattr(memory_plan, "LiveBytes", FirstPassDoesMore)
    assert memory_plan.activation_bytes(lambda: GPT(config), config) == expected > 0
    assert len(traced) == 3


def test_passes_whose_operations_keep_differing_give_the_difference_of_their_peaks(monkeypatch):
    """Where the micro-batch of 2 keeps recording an operation that of 3 does not, the pairs of
    allocations no longer line up: the activations are the difference of the two peaks."""
    config = dataclasses.replace(SMALL, n_layer=1)
    traced = []

    class TwoRowsDoMore(memory_plan.LiveBytes):
        def __exit__(self, *exc):
            if len(traced) != 1:  # the first and the traced-again pass are of 2 rows
                self.trace.insert(0, 0)  # one reading more, before the rest
            traced.append(self.trace)
            return super().__exit__(*exc)

    monkeypatch.setattr(memory_plan, "LiveBytes", TwoRowsDoMore)
    assert memory_plan.activation_bytes(lambda: GPT(config), config) == max(traced[1]) - max(traced[2]) > 0
    assert len(traced) == 3


def profiled_bytes_per_sequence(config):
    """Bytes per sequence of seq_len tokens that one real forward and backward of GPT(config) on the
    CPU, under config.dtype's autocast, allocates at its peak beyond what does not grow with the
    micro-batch: the running sum of every CPU allocation and free that torch's profiler records,
    its peak at micro-batch 3 less its peak at micro-batch 2."""
    def peak(micro_batch_size):
        torch.manual_seed(0)
        model = GPT(config).train()
        idx = torch.randint(0, config.vocab_size, (micro_batch_size, config.seq_len))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with precision.autocast(config.dtype, torch.device("cpu")):
                _, loss = model(idx, idx)
            loss.backward()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        return max(itertools.accumulate(e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())))

    return peak(3) - peak(2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_activations_planned_for_16_bits_are_what_a_16_bit_step_allocates(dtype):
    """A bfloat16 or float16 run's plan counts the activations of its dtype's autocast, not
    float32's: per sequence, the bytes that a real CPU step under that autocast allocates at its
    peak as torch's profiler records them (rtol 5%, for kernels' workspaces), which float32's
    activations exceed by more than that."""
    config = dataclasses.replace(SMALL, dtype=dtype)
    planned = memory_plan.plan(config, 1, memory_counts(config))["activations"] / config.micro_batch_size
    measured = profiled_bytes_per_sequence(config)
    assert planned == pytest.approx(measured, rel=0.05)
    assert profiled_bytes_per_sequence(dataclasses.replace(config, dtype="float32")) > 1.1 * measured


# one training step of a model class per micro-batch size, each after the one before has freed its
# tensors; prints the peak resident bytes each step added (the first only warms torch up)
PEAK_RSS = """
import json, sys
from pathlib import Path
import torch
import conftest, train_gpt2
from gpt2_ddp import precision

def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
    return int(line.split()[1]) * 1024

model_class = getattr(conftest if sys.argv[1] != "GPT" else train_gpt2, sys.argv[1])
peaks = []
for micro_batch_size in [1] + json.loads(sys.argv[3]):
    config = train_gpt2.Config(**json.loads(sys.argv[2]), micro_batch_size=micro_batch_size)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    before = status("VmRSS")
    model = model_class(config).train()
    optimizer = model.configure_optimizers(config, "cpu")
    idx = torch.randint(0, config.vocab_size, (micro_batch_size, config.seq_len))
    with precision.autocast(config.dtype, torch.device("cpu")):
        _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    peaks.append(status("VmHWM") - before)
    del model, optimizer, idx, loss
print(json.dumps(peaks[1:]))
"""


def test_the_plan_is_within_15_percent_of_a_cpu_steps_peak(monkeypatch):
    """The plan's total for GPT and for the RoPE fork (conftest.RopeGPT, in train_gpt2.GPT's place as a
    fork would put it) is within 15% of the resident memory that one training step adds at its peak
    on the CPU (Linux's VmHWM less VmRSS before the model is built), at micro-batch 8 and 16: each
    model in a process of its own, where glibc maps every block of 64 KB or more apart, so that a
    freed tensor leaves the process."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    sizes = dict(n_layer=2, n_head=4, n_embd=128, block_size=512, vocab_size=512, seq_len=512,
                 dtype="float32", dropout=0.0)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    procs = {name: subprocess.Popen([sys.executable, "-c", PEAK_RSS, name, json.dumps(sizes), "[8, 16]"],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
             for name in ("GPT", "RopeGPT")}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        monkeypatch.setattr(train_gpt2, "GPT", getattr(conftest, name, train_gpt2.GPT))
        for micro_batch_size, measured in zip((8, 16), json.loads(stdout)):
            config = Config(**sizes, micro_batch_size=micro_batch_size)
            planned = memory_plan.plan(config, 1, memory_counts(config))["total"]
            assert abs(planned - measured) / measured < 0.15, (name, micro_batch_size, planned, measured)


def test_the_plan_counts_the_model_and_optimizer_that_training_builds(monkeypatch):
    """GPT-2 124M (vocab padded to 50304) and AdamW's 8 bytes a parameter; the same model without
    learned positions (a fork to RoPE, say) and with Muon's 4 bytes for the blocks' matrices are
    counted as they are built, with no change to the plan. Each figure is the model's own: its
    parameters (a tied tensor once), wpe's, and the weights of the blocks' nn.Linear modules."""
    def count(config):  # memory_counts without the activations, which this test does not need
        model = meta_model(config)
        return memory_plan.count(model, model.configure_optimizers(config, "meta"))

    config = load_config([str(ROOT / "configs" / "gpt2_124m.toml")])
    model = meta_model(config)
    params = sum(p.numel() for p in model.parameters())
    matrices = sum(m.weight.numel() for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear))
    counts = count(config)
    assert counts["params"] == params and counts["optimizer_bytes"] == 8 * params
    with monkeypatch.context() as patch:  # the RoPE fork: learned positions gone, no parameter added
        patch.setattr(train_gpt2, "GPT", conftest.RopeGPT)
        fork = count(config)
    assert fork["params"] == params - model.transformer.wpe.weight.numel()
    assert fork["optimizer_bytes"] == 8 * fork["params"]
    muon = count(dataclasses.replace(config, optimizer="muon"))
    assert muon["optimizer_bytes"] == 8 * params - 4 * matrices


def test_sharding_and_checkpointing_fit_larger_micro_batches():
    config = load_config([str(ROOT / "configs" / "gpt2_774m.toml"), "--dtype=bfloat16"])
    gb80 = 80 * memory_plan.GB
    counts = {ckpt: memory_counts(dataclasses.replace(config, activation_checkpointing=ckpt))
              for ckpt in (False, True)}
    fits = {(mode, ckpt): memory_plan.max_micro_batch(
        dataclasses.replace(config, sharding=mode, activation_checkpointing=ckpt), 8, counts[ckpt],
        gb80) for mode in ("ddp", "zero2", "fsdp") for ckpt in (False, True)}
    for ckpt in (False, True):
        assert fits[("ddp", ckpt)] < fits[("zero2", ckpt)] < fits[("fsdp", ckpt)]
    for mode in ("ddp", "zero2", "fsdp"):
        assert fits[(mode, False)] < fits[(mode, True)]
    # the largest fits 90% of the memory, one more does not; the shipped config is among those
    largest = dataclasses.replace(config, micro_batch_size=fits[("zero2", False)])
    assert memory_plan.plan(largest, 8, counts[False])["total"] <= 0.9 * gb80
    one_more = dataclasses.replace(largest, micro_batch_size=largest.micro_batch_size + 1)
    assert memory_plan.plan(one_more, 8, counts[False])["total"] > 0.9 * gb80
    assert config.sharding == "zero2" and config.micro_batch_size <= fits[("zero2", False)]


def test_script_prints_the_plan_and_what_fits():
    proc = subprocess.run([sys.executable, "-m", "scripts.memory_plan", "configs/gpt2_124m.toml",
                           "--gpu_memory", "80"], cwd=ROOT, capture_output=True,
                          text=True, check=True)  # 8 ranks by default, as on one 8-GPU node
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("12 layers, n_embd 768: 124M parameters; 8 ranks, bfloat16")
    assert lines[1].split()[-1] == "total" and lines[2].startswith("planned GB")
    assert lines[1].split()[3:6] == ["gradients", "optimizer", "state"]  # the headers kept apart
    assert [line.split()[0] for line in lines[-3:]] == ["ddp", "zero2", "fsdp"]


def test_script_plans_the_configs_activation_checkpointing_and_world_size(capsys):
    """The plan printed for a config with activation checkpointing on, over 4 ranks, is memory_plan's
    for that config and world size, not the defaults'."""
    argv = ["configs/gpt2_124m.toml", "--activation_checkpointing=true", "--dtype=bfloat16", "--n_layer=2",
            "--micro_batch_size=4", "--seq_len=256"]
    memory_plan_main([*argv, "--world_size", "4", "--gpu_memory", "40"])
    config = load_config(argv)
    parts = memory_plan.plan(config, 4, memory_counts(config))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("; 4 ranks, bfloat16, micro_batch_size 4, seq_len 256")
    planned = lines[2].split()[2:]
    assert [float(v) for v in planned] == [round(v / memory_plan.GB, 2) for v in parts.values()]
    # what fits is sized to --gpu_memory, with and without checkpointing
    assert lines[4].startswith("largest micro_batch_size in 40 GB (90% usable)")
    fits = [memory_plan.max_micro_batch(
        dataclasses.replace(config, sharding="zero2", activation_checkpointing=ckpt), 4,
        memory_counts(dataclasses.replace(config, activation_checkpointing=ckpt)), 40 * memory_plan.GB)
        for ckpt in (False, True)]
    assert lines[-2].split() == ["zero2", *map(str, fits)]


def test_script_prints_a_plan_under_a_gigabyte_in_megabytes(capsys):
    argv = [*TINY, "--dtype=float32", "--micro_batch_size=2"]
    memory_plan_main([*argv, "--world_size", "1"])
    config = load_config(argv)
    parts = memory_plan.plan(config, 1, memory_counts(config))
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:2] == ["planned", "MB"]
    assert [float(v) for v in lines[2].split()[2:]] == [round(v / 2**20, 2) for v in parts.values()]


@pytest.mark.parametrize("option, value, rule", [
    ("--world_size", "0", "--world_size must be >= 1, got 0"),
    ("--world_size", "-8", "--world_size must be >= 1, got -8"),
    ("--gpu_memory", "0", "--gpu_memory must be a finite number of GB > 0, got 0"),
    ("--gpu_memory", "-80", "--gpu_memory must be a finite number of GB > 0, got -80"),
    ("--gpu_memory", "nan", "--gpu_memory must be a finite number of GB > 0, got nan"),
])
def test_a_world_size_or_gpu_memory_out_of_range_is_refused(capsys, option, value, rule):
    with pytest.raises(SystemExit) as excinfo:
        memory_plan_main(["configs/gpt2_124m.toml", option, value])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.endswith(f": error: {rule}\n")


def test_a_model_whose_state_exceeds_the_available_memory_is_refused(monkeypatch):
    """GPT-2 124M is refused one byte short of its parameters, gradients and AdamW's two moments (16
    bytes a parameter), not for the activations, autocast's bf16 copies or exact_reduction's float64
    sums that the plan adds; nor where the memory is unknown (MPS)."""
    config = dataclasses.replace(load_config([str(ROOT / "configs" / "gpt2_124m.toml")]),
                                 exact_reduction=True)
    for device, dtype in ((torch.device("cpu"), "float32"), (torch.device("cuda:1"), "bfloat16")):
        config = dataclasses.replace(config, dtype=dtype)
        counts = memory_counts(config)
        held, GB = 16 * counts["params"], memory_plan.GB
        total = memory_plan.plan(config, 1, counts)["total"]  # this dtype's, with the float64 sums
        assert memory_plan.plan(config, 1, counts)["total"] > 20 * held
        monkeypatch.setattr(memory_plan, "available_bytes", lambda d: (held, f"{d} has enough"))
        assert memory_plan.checked_summary(config, 1, device, counts).startswith("memory plan per rank")
        monkeypatch.setattr(memory_plan, "available_bytes", lambda d: (held - 1, f"{d} has too little"))
        with pytest.raises(UserError) as excinfo:
            memory_plan.checked_summary(config, 1, device, counts)
        four = 4 * counts["params"] / GB  # float32 parameters or gradients, or one of AdamW's moments
        assert str(excinfo.value) == (
            f"the model needs at least {held / GB:.1f} GB per rank (parameters {four:.1f} GB, gradients "
            f"{four:.1f} GB, optimizer state {2 * four:.1f} GB; memory_plan's total with activations "
            f"{total / GB:.1f} GB) but {device} has too little; lower n_layer, n_embd or vocab_size, or "
            "shard it over more ranks (--sharding=fsdp)")
    monkeypatch.setattr(memory_plan, "available_bytes", lambda d: None)
    assert memory_plan.checked_summary(config, 1, torch.device("mps"), counts)


def test_the_summary_of_a_plan_under_a_gb_gives_each_part_in_mb():
    """Under a GB the console line's parts are MB of 2**20 bytes, each the plan's, then the config."""
    counts = {"params": 10**6, "param_bytes": 4 * 10**6, "optimizer_bytes": 8 * 10**6, "matmul": 9 * 10**5,
              "root": 10**5, "block": 4 * 10**5, "activations": 3 * 10**6}  # made up: the plan's inputs
    parts = memory_plan.plan(SMALL, 1, counts)
    assert parts["total"] < memory_plan.GB
    line = memory_plan.checked_summary(SMALL, 1, torch.device("cpu"), counts)
    sizes, config = line.removeprefix("memory plan per rank: ").split(" (")
    assert [size.rsplit(" ", 2) for size in sizes.split(", ")] == \
        [[part, f"{size / 2**20:.2f}", "MB"] for part, size in parts.items()]
    assert config == "micro_batch_size 4, ddp, float32, activation checkpointing off)"


def test_train_refuses_a_model_larger_than_this_machine_before_building_it(tmp_path):
    """A 10**9-token vocabulary at n_embd 1024 (16 TB of parameters, gradients and AdamW state) is
    refused in one line that names the plan and this machine's memory, before anything allocates."""
    make_shards(tmp_path / "data")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "train_gpt2.py", *TINY, "--vocab_size=1000000000",
                           "--n_embd=1024", f"--data_dir={tmp_path / 'data'}",
                           f"--out_dir={tmp_path / 'out'}", "--hellaswag_interval=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_gpt2.py: error: the model needs at least "
                                                   "15259.2 GB per rank (parameters 3814.8 GB"), proc.stderr
    assert " but this machine has " in lines[0] and " GB available (memory and swap); " in lines[0]
    assert time.monotonic() - started < 30


def test_gpt2_1558m_config_runs_on_cpu_with_tiny_sizes(tmp_path, tiny_data):
    """The 1.5B config with its sizes overridden: its sharding (zero2) and schedule keys run, with
    activation checkpointing, and the plan is printed before the first step."""
    out = run_training(["configs/gpt2_1558m.toml", *TINY, f"--data_dir={tiny_data}",
                        f"--out_dir={tmp_path}", "--total_batch_size=64", "--max_steps=3",
                        "--hellaswag_interval=0", "--val_batches=2", "--activation_checkpointing=true",
                        "--warmup_steps=1"]).stdout
    assert "memory plan per rank: parameters" in out and "zero2, float32, activation checkpointing on" in out
    steps, _ = read_log(tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3]
