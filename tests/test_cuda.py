"""Every CUDA path of the training, as tests that take their device from one fixture: the first GPU
where there is one, else the CPU. Where the path exists on CPU and costs seconds (bf16 autocast,
compile, fused AdamW, MFU, Muon, the KV-cache sampler) the test runs there too, so it is known to
work before a GPU sees it; the CUDA-only ones (flash attention, NCCL, deterministic CUDA kernels,
the memory plan against the CUDA allocator, CUDA checkpoints, bf16 against CPU float32) skip
with the reason. On a GPU machine: `python -m pytest -q -rs tests/test_cuda.py`, or
`bash .ci/gpu`, which runs them first.

Tolerances: float32 on CPU agrees to 1e-4 relative; bfloat16 has 8 bits of mantissa (a relative
rounding of 2**-9 = 2e-3 per operation), so bf16 results agree to 2e-2 relative.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import (ROOT, TINY, make_shards, markov_tokens, read_log, run_training,
                      write_hellaswag)
from gpt2_ddp import hellaswag, memory_plan, metrics, muon, precision
from gpt2_ddp.shards import write_shard
from train_gpt2 import GPT, Config, DataLoader, build_model, load_config, memory_counts

BF16_RTOL = 2e-2
FP32_RTOL = 1e-4
# a GPT of the tests' size, in one process: seconds on one CPU core
SMALL = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512)


@pytest.fixture(scope="module")
def device():
    """The device every test here runs on: cuda (the first GPU) where torch sees one, else cpu."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture
def cuda(device, request):
    """device, for the tests of paths that exist on CUDA alone; they skip elsewhere."""
    if device.type != "cuda":
        pytest.skip(f"needs a CUDA GPU: {request.node.originalname} tests a path that exists on "
                    f"CUDA alone (.ci/gpu runs it on a GPU machine)")
    return device


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """float32 matmuls in full precision (not TF32), whatever a test before set, for the float32
    comparisons; restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def auto_dtype(device):
    """The dtype that dtype=auto picks on device: bfloat16 or float16 on CUDA, float32 elsewhere."""
    return precision.resolve(Config(), device)[0].dtype


def training_autocast(device):
    """What train_gpt2.train() runs the forward under with dtype=auto."""
    return precision.autocast(auto_dtype(device), device)


def relative_error(a, b):
    """||a - b|| / ||b||, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def markov_batches(device, n, B=8, T=32, vocab=512, seed=0):
    """n (x, y) batches of conftest's learnable token stream, (B, T) int64 on device."""
    stream = torch.from_numpy(markov_tokens(np.random.default_rng(seed), n * B * T + 1, vocab))
    return [(stream[i * B * T:(i + 1) * B * T].view(B, T).to(device),
             stream[i * B * T + 1:(i + 1) * B * T + 1].view(B, T).to(device)) for i in range(n)]


def train_steps(model, optimizer, batches, autocast):
    """One optimizer step per batch; returns the losses."""
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def small_model(device, **overrides):
    """(the GPT that train_gpt2.build_model makes on device, its Config): SMALL with overrides."""
    config = Config(**{**SMALL, **overrides})
    return build_model(config, device), config


# ---------------------------------------------------------------------------------------------
# on every device


def test_bf16_autocast_trains(device):
    """Under bf16 autocast the matmuls run in bf16 (the logits are bf16), the loss is float32,
    and 40 AdamW steps bring the loss from ln(512) = 6.24 to under 3/4 of it: the step at which it
    leaves its plateau near 4.2 varies with the CPU's or GPU's kernels."""
    model, config = small_model(device)
    optimizer = model.configure_optimizers(config, device.type)
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    x, y = markov_batches(device, 1)[0]
    with autocast:
        logits, loss = model(x, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    losses = train_steps(model, optimizer, markov_batches(device, 40), autocast)
    assert all(map(math.isfinite, losses))
    assert losses[0] > 5.5 and losses[-1] < losses[0] * 3 / 4, losses


def test_compile_agrees_with_eager_and_draws_its_dropout_masks(device):
    """torch.compile's forward and backward give eager's loss and gradients under training's
    autocast (to bf16 tolerance on CUDA, to float32's on CPU), with dropout on: a model that
    train_gpt2.build_model sets up for compile (fallback_random) draws eager's masks for the same
    seed, so compile changes no run's randomness (the equivalence across world sizes seeds
    dropout per micro-batch). Other masks move the gradients by 30-80% (measured on CPU), far
    beyond either tolerance."""
    # inductor's config.patch restores the setting after (pytest's monkeypatch deleted it on 2.11)
    with torch._inductor.config.patch(fallback_random=False):
        torch._dynamo.reset()
        model = build_model(Config(**{**SMALL, "n_embd": 32, "block_size": 32}, dropout=0.1,
                                   compile=True), device).train()
        assert torch._inductor.config.fallback_random
        compiled = torch.compile(model)
        x, y = markov_batches(device, 1, B=2, T=16)[0]
        results = []
        for m in (model, compiled):
            model.zero_grad()
            torch.manual_seed(2)
            with training_autocast(device):
                _, loss = m(x, y)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results.append((loss.detach(), grads))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    rtol = BF16_RTOL if device.type == "cuda" else FP32_RTOL
    assert relative_error(compiled_loss, eager_loss) < rtol
    for name, grad in eager_grads.items():
        assert relative_error(compiled_grads[name], grad) < rtol, name


def test_inductor_draws_other_dropout_masks_without_fallback_random(device):
    """Why build_model sets fallback_random: without it inductor's dropout draws other masks than
    eager's for the same seed (and the test above could tell)."""
    with torch._inductor.config.patch(fallback_random=False):
        torch._dynamo.reset()
        dropout = torch.compile(lambda t: F.dropout(t, 0.5, training=True))
        ones = torch.ones(4096, device=device)
        torch.manual_seed(1)
        inductors = dropout(ones)
    torch.manual_seed(1)
    assert not torch.equal(inductors, F.dropout(ones, 0.5, training=True))


def test_fused_adamw_agrees_with_unfused(device):
    """configure_optimizers takes the fused AdamW kernel, which can skip an update on the device;
    fused and unfused take the same steps from the same gradients, to float32 rounding, on the
    device."""
    model, config = small_model(device)
    chosen = model.configure_optimizers(config, device.type)
    assert chosen.defaults["fused"] is True
    # no biases: the key bias's gradient is 0 but for rounding noise, which Adam scales up to
    # +-lr, so any rounding difference shows there in full (softmax ignores a shift of the keys)
    models = [small_model(device, bias=False)[0] for _ in range(2)]
    groups = [[{"params": g["params"], "weight_decay": g["weight_decay"]}
               for g in m.configure_optimizers(config, "cpu").param_groups] for m in models]
    adamws = [torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused,
                                foreach=False if not fused else None)
              for g, fused in zip(groups, (True, False))]
    for x, y in markov_batches(device, 5):
        for m, adamw in zip(models, adamws):
            adamw.zero_grad()
            m(x, y)[1].backward()
            adamw.step()
    for (name, fused), unfused in zip(models[0].named_parameters(), models[1].parameters()):
        assert relative_error(fused.detach(), unfused.detach()) < FP32_RTOL, name


def test_mfu_and_memory_are_logged(device, tmp_path):
    """A run logs MFU each step: the training FLOPs of a step (6N + 12 L H Q T per token, counted
    here from GPT-2's parameter count) over dt and the peak, by GPU name where it is known
    (metrics.PEAK_FLOPS, for dtype=auto's dtype) or from --peak_flops; on CUDA the peak of allocated
    memory too."""
    make_shards(tmp_path / "data")
    peak = (metrics.peak_flops(torch.cuda.get_device_name(device), auto_dtype(device))
            if device.type == "cuda" else None)
    args = [*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}",
            "--max_steps=3", "--total_batch_size=64", f"--device={device.type}",
            *([] if peak else ["--peak_flops=1e12"])]
    run_training(args)
    steps, _ = read_log(tmp_path / "out")
    config = load_config(args)
    h = config.n_embd  # wte (tied to lm_head); per block 4 matmuls, their biases and 2 LayerNorms; ln_f
    n = config.vocab_size * h + config.n_layer * (12 * h * h + 13 * h) + 2 * h  # no wpe: a lookup
    head_dim = config.n_embd // config.n_head
    flops_per_step = (6 * n + 12 * config.n_layer * config.n_head * head_dim * config.seq_len) * \
        config.total_batch_size
    for record in steps:
        expected = flops_per_step / (record["dt_ms"] / 1000) / (peak or 1e12)
        assert record["mfu"] == pytest.approx(expected, rel=1e-6)
        assert ("mem_gb" in record) == (device.type == "cuda")
    if device.type == "cuda":
        assert 0 < steps[-1]["mem_gb"] < torch.cuda.get_device_properties(device).total_memory / 2**30


def test_muon_trains_on_the_device(device):
    """Muon (bf16 Newton-Schulz) for the blocks' matrices and AdamW for the rest, one process:
    its orthogonalization on the device agrees with the CPU's to bf16 tolerance, and 40 steps
    under training's autocast halve the loss."""
    G = torch.randn(3, 64, 192, generator=torch.Generator().manual_seed(0))
    on_device = muon.orthogonalize(G.to(device)).float().cpu()
    assert relative_error(on_device, muon.orthogonalize(G).float()) < BF16_RTOL
    model, config = small_model(device, optimizer="muon")
    optimizer = model.configure_optimizers(config, device.type)
    for group in optimizer.param_groups:
        group["lr"] = 1e-2 * group["lr_scale"]
    losses = train_steps(model, optimizer, markov_batches(device, 40), training_autocast(device))
    assert losses[0] > 5.5 and losses[-1] < losses[0] * 3 / 4, losses


def test_kv_cache_sampler_on_the_device(device):
    """GPT.generate with its KV cache draws, greedily, the tokens of running the whole window for
    every token, on the device in float32, past block_size; under bf16 autocast it samples too."""
    model, config = small_model(device)
    model.eval()
    prompt = torch.randint(0, config.vocab_size, (2, 10), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    n = config.block_size + 20  # the window slides for the last tokens
    generator = torch.Generator(device).manual_seed(0)
    cached = torch.cat(list(model.generate(prompt, n, generator, top_k=1)), dim=1)
    idx = prompt
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -config.block_size:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, idx[:, prompt.size(1):])
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        tokens = torch.cat(list(model.generate(prompt, 8, generator)), dim=1)
    assert tokens.shape == (2, 8) and int(tokens.max()) < config.vocab_size


# ---------------------------------------------------------------------------------------------
# on CUDA alone


def test_flash_attention_agrees_with_math(cuda):
    """The model's attention runs with flash attention alone enabled (at GPT-2's head size 64 and
    this test's 32), forward and backward, and agrees with the math backend to bf16 tolerance."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    results = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        for n_embd, n_head in ((768, 12), (64, 2)):
            model, _ = small_model(cuda, n_embd=n_embd, n_head=n_head, block_size=1024)
            x = torch.randint(0, 512, (4, 1024), device=cuda, generator=torch.Generator(cuda).manual_seed(0))
            with sdpa_kernel(backend), training_autocast(cuda):
                _, loss = model(x, x)
            loss.backward()
            results.append((loss.detach(), model.transformer.h[0].attn.c_attn.weight.grad))
    for (flash_loss, flash_grad), (math_loss, math_grad) in zip(results[:2], results[2:]):
        assert relative_error(flash_loss, math_loss) < BF16_RTOL
        assert relative_error(flash_grad, math_grad) < BF16_RTOL


def test_the_loader_copies_pinned_batches_to_the_gpu(cuda, tiny_data):
    """On CUDA the loader pins each batch and copies it without blocking: the same tokens as the
    CPU loader's, on the GPU."""
    loaders = [DataLoader(tiny_data, "train", 4, 16, 0, 1, d, "tiny")
               for d in (cuda, torch.device("cpu"))]
    for _ in range(3):
        (x, y), (cpu_x, cpu_y) = (loader.next_batch() for loader in loaders)
        assert x.device.type == "cuda" and torch.equal(x.cpu(), cpu_x) and torch.equal(y.cpu(), cpu_y)


@pytest.mark.parametrize("mode,optimizer,world_size,dtype", [
    ("ddp", "adamw", 1, "auto"), ("zero2", "adamw", 1, "auto"), ("fsdp", "adamw", 1, "auto"),
    ("ddp", "muon", 1, "auto"), ("zero2", "muon", 1, "auto"), ("fsdp", "muon", 1, "auto"),
    ("ddp", "adamw", 2, "auto"), ("zero2", "adamw", 2, "auto"), ("fsdp", "adamw", 2, "auto"),
    ("ddp", "adamw", 1, "float16"), ("zero2", "muon", 1, "float16"), ("fsdp", "adamw", 1, "float16"),
    ("ddp", "adamw", 1, "float32"), ("fsdp", "muon", 1, "float32")])
def test_sharding_modes_train_over_nccl(cuda, tmp_path, mode, optimizer, world_size, dtype):
    """Each sharding mode and optimizer trains under torchrun over NCCL, compiled, in dtype=auto's
    dtype and in float16 (loss-scaled) and float32: the loss falls and every step is finite; at
    world size 2 where two GPUs exist."""
    if world_size > torch.cuda.device_count():
        pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    make_shards(tmp_path / "data", n_train=20000)
    run_training([*TINY, "--compile=true", f"--sharding={mode}", f"--optimizer={optimizer}",
                  f"--dtype={dtype}", f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}",
                  "--max_steps=30", "--total_batch_size=128"], world_size, torchrun=True)
    steps, evals = read_log(tmp_path / "out")
    assert len(steps) == 30 and all(math.isfinite(r["loss"]) for r in steps)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1


def test_exact_mode_gives_the_same_bits_twice(cuda, tmp_path):
    """exact_reduction on CUDA (deterministic algorithms, float64 sums), compiled, dropout on: two
    runs log the same losses and save the same weights, bit for bit."""
    make_shards(tmp_path / "data", n_train=20000)
    for run in ("a", "b"):
        run_training([*TINY, "--compile=true", "--exact_reduction=true", "--dropout=0.1",
                    f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / run}",
                    "--max_steps=20", "--total_batch_size=128"])
    logs = [[(r["loss"], r["grad_norm"]) for r in read_log(tmp_path / run)[0]] for run in "ab"]
    assert logs[0] == logs[1]
    weights = [torch.load(next((tmp_path / run).glob("ckpt_*.pt")), map_location="cpu",
                          weights_only=False)["model"] for run in "ab"]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_hellaswag_on_cuda_agrees_with_cpu(cuda, tmp_path):
    """HellaSwag's per-ending losses on CUDA equal the CPU's to float32 tolerance, and under the
    training's bf16 autocast to bf16 tolerance; the float32 accuracies are the same."""
    write_hellaswag(tmp_path / "h.jsonl", 20)
    model, config = small_model(torch.device("cpu"))
    model.eval()
    examples = hellaswag.render_all(hellaswag.load_examples(tmp_path / "h.jsonl"),
                                    config.block_size, config.vocab_size)
    on_cuda = GPT(config).to(cuda).eval()
    on_cuda.load_state_dict(model.state_dict())
    for tokens, mask, _ in examples:
        expected = hellaswag.ending_losses(model, tokens, mask)
        got = hellaswag.ending_losses(on_cuda, tokens.to(cuda), mask.to(cuda))
        bf16 = hellaswag.ending_losses(on_cuda, tokens.to(cuda), mask.to(cuda), training_autocast(cuda))
        for e, g, b in zip(expected, got, bf16):
            assert relative_error(g.cpu(), e) < FP32_RTOL and relative_error(b.cpu(), e) < BF16_RTOL
    assert (hellaswag.evaluate(on_cuda, examples, cuda)
            == hellaswag.evaluate(model, examples, torch.device("cpu")))


@pytest.mark.parametrize("micro_batch_size", [8, 16])
def test_memory_plan_within_10_percent_of_the_allocator(cuda, tmp_path, micro_batch_size):
    """memory_plan.plan's total for GPT-2 124M (eager, one GPU) is within 10% of the peak the
    CUDA allocator saw (torch.cuda.max_memory_allocated, log.jsonl's mem_gb) over 2 steps."""
    tokens = micro_batch_size * 1024
    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    for split in ("train", "val"):
        write_shard(tmp_path / "data" / f"random_{split}_000000.bin", rng.integers(0, 50257, tokens + 1))
    args = [str(ROOT / "configs" / "gpt2_124m.toml"), f"--data_dir={tmp_path / 'data'}",
            f"--out_dir={tmp_path / 'out'}", f"--micro_batch_size={micro_batch_size}",
            f"--total_batch_size={tokens}", "--max_steps=2", "--compile=false", "--eval_interval=0",
            "--sample_interval=0", "--hellaswag_interval=0"]
    run_training(args)
    measured = max(r["mem_gb"] for r in read_log(tmp_path / "out")[0]) * 2**30
    config = precision.resolve(load_config(args), cuda)[0]
    planned = memory_plan.plan(config, 1, memory_counts(config))["total"]
    assert abs(planned - measured) / measured < 0.10, (planned / 2**30, measured / 2**30)


def test_a_cuda_checkpoint_resumes_and_samples_on_cpu(cuda, tmp_path):
    """A checkpoint saved by a CUDA run (bf16 autocast, compiled) resumes on the CPU, which goes
    on from its step, and scripts/sample.py samples from it on the CPU."""
    make_shards(tmp_path / "data")
    common = [*TINY, "--total_batch_size=64", f"--data_dir={tmp_path / 'data'}",
              f"--out_dir={tmp_path / 'out'}"]
    run_training([*common, "--compile=true", "--max_steps=4"])
    run_training([*common, "--device=cpu", "--max_steps=6"])
    steps, _ = read_log(tmp_path / "out")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    proc = subprocess.run([sys.executable, "-m", "scripts.sample", str(tmp_path / "out"), "--device",
                           "cpu", "--max_new_tokens", "5", "--prompt", "ab"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_gpu_run_ends_within_2_percent_of_a_float32_cpu_run(cuda, tmp_path, dtype):
    """The same 200 steps (seed, data, model) on the GPU in bfloat16 or float16 (loss-scaled) and on
    the CPU in float32 end with train and val losses within 2% of each other."""
    if dtype == "bfloat16" and torch.cuda.get_device_capability(cuda) < (8, 0):
        pytest.skip("bfloat16 needs compute capability 8.0")
    make_shards(tmp_path / "data", n_train=100000, n_val=5000)
    common = [*TINY, "--n_layer=2", "--n_embd=64", "--micro_batch_size=8", "--seq_len=32",
              "--total_batch_size=256", "--max_steps=200", "--eval_interval=200", "--val_batches=8",
              "--warmup_steps=20", f"--data_dir={tmp_path / 'data'}"]
    ends = {}
    for name in ("cuda", "cpu"):
        run_training([*common, f"--device={name}", f"--dtype={dtype if name == 'cuda' else 'float32'}",
                      f"--out_dir={tmp_path / name}"])
        steps, evals = read_log(tmp_path / name)
        ends[name] = (steps[-1]["loss"], evals[-1]["val_loss"])
    for gpu, cpu in zip(ends["cuda"], ends["cpu"]):
        assert abs(gpu - cpu) / cpu < 0.02, ends
