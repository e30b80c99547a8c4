"""
Train GPT-2 with data parallelism, in one file: config, model, data, distributed setup,
optimizer and schedule, training loop, teardown.

One process (GPU, Apple MPS or CPU):
    python train_gpt2.py configs/shakespeare_cpu.toml
Two CPU processes (DDP over gloo), the quickstart:
    torchrun --standalone --nproc_per_node=2 train_gpt2.py configs/shakespeare_cpu.toml
GPT-2 124M on 8 GPUs (DDP over NCCL); the defaults are this run:
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml
Two nodes of 8 GPUs each, run on both nodes:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=gpt2 train_gpt2.py configs/gpt2_124m.toml
Finetune OpenAI's GPT-2 (init_from), then sample from it (scripts/sample.py):
    python train_gpt2.py configs/finetune_shakespeare.toml
Any config key can be overridden after the config file, e.g. --max_steps=1e4 --compile=false.
Sharded AdamW state (ZeRO-2, written out below) or sharded parameters too (FSDP2):
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml --sharding=zero2
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml --sharding=fsdp

The promise: a run on N processes is the run on one. The global batch is split into micro-batches
numbered across ranks, micro-batch m of a step goes to rank m % world_size, and dropout draws from
a random state derived from (seed, step, m) alone. So world size changes only the float rounding.
"""

import ctypes
import dataclasses
import gc
import hashlib
import math
import os
import re
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function

import checkpoints
import configurator
import memory_plan
from configurator import UserError
from shards import max_token_ids, read_shard_header, read_tokens, split_paths
from prepare_data import EOT_TOKEN, gpt2_encoding  # GPT-2's tokenizer, offline, for samples

# -----------------------------------------------------------------------------
# Config


@dataclass
class Config:
    """Every knob of a run. Defaults reproduce GPT-2 124M as in karpathy/build-nanogpt."""

    # Every key's comment is its --help line. Intervals count optimizer steps; 0 turns the action
    # off, and otherwise the last step always runs it. The last step always saves a checkpoint.
    # data and output
    data_dir: str = "data/fineweb-edu"  # shards made by prepare_data.py
    dataset: str = ""  # the shards' name prefix to train on, where data_dir holds several datasets
    out_dir: str = "out"  # log.jsonl and checkpoints
    # model: GPT-2 124M
    init_from: str = "scratch"  # scratch, gpt2[-medium|-large|-xl] or a Hugging Face GPT-2 directory
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # width of the residual stream
    block_size: int = 1024  # longest sequence the position embedding covers
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128 for faster kernels
    dropout: float = 0.0  # in [0, 1): on embeddings, attention and residual branches
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 has
    activation_checkpointing: bool = False  # recompute each block's activations in the backward
    # batch: one optimizer step sees total_batch_size tokens
    micro_batch_size: int = 64  # B, sequences per forward per process
    seq_len: int = 1024  # T, tokens per sequence
    total_batch_size: int = 524288  # tokens per optimizer step, 2**19 ~ 0.5M as in GPT-3 small
    # optimizer and schedule (AdamW, linear warmup, cosine decay)
    max_steps: int = 19073  # optimizer steps: 10B tokens / 524288 tokens per step
    max_lr: float = 6e-4  # learning rate at the end of warmup
    min_lr: float = 6e-5  # learning rate at max_steps, the end of the cosine decay
    warmup_steps: int = 715  # steps of linear warmup from max_lr / warmup_steps
    weight_decay: float = 0.1  # AdamW's, on matmul and embedding weights only
    beta1: float = 0.9  # AdamW's first-moment decay, in [0, 1)
    beta2: float = 0.95  # AdamW's second-moment decay, in [0, 1)
    grad_clip: float = 1.0  # the gradient's global 2-norm is clipped to this
    # evaluation, sampling, checkpoints
    eval_interval: int = 250  # val loss every N steps
    val_batches: int = 160  # micro-batches of val data per eval, split over ranks (10M tokens)
    sample_interval: int = 250  # a printed sample every N steps
    sample_prompt: str = "Hello, I'm a language model,"  # what the samples continue
    sample_tokens: int = 32  # tokens per sample
    hellaswag_interval: int = 0  # HellaSwag accuracy (hellaswag.py) every N steps
    hellaswag_examples: int = 0  # the first N of the file; 0 takes all (10042 in the val split)
    hellaswag_path: str = "data/hellaswag/hellaswag_val.jsonl"  # downloaded there when missing
    checkpoint_interval: int = 5000  # a checkpoint every N steps (and at the last)
    keep_checkpoints: int = 3  # the newest N checkpoints stay on disk; 0 keeps all
    resume: str = "auto"  # auto: continue from the latest checkpoint in out_dir; never: start fresh
    overwrite: bool = False  # with resume=never, delete out_dir's checkpoints instead of refusing
    # system
    seed: int = 1337  # initial weights, dropout masks and samples derive from it
    device: str = "auto"  # auto: cuda:LOCAL_RANK, else mps (single process), else cpu
    sharding: str = "ddp"  # ddp: replicas; zero2: shard AdamW state; fsdp: shard params too (FSDP2)
    bucket_cap_mb: int = 25  # ddp: gradients are all-reduced in buckets of this size
    gradient_as_bucket_view: bool = False  # ddp: gradients live in the buckets, saving a copy
    grad_compression: str = "none"  # ddp: bf16 all-reduces half the bytes (NCCL only)
    exact_reduction: bool = False  # sum gradients and losses in float64: the same bits at any world size
    compile: bool = True  # torch.compile the model
    compile_ddp: bool = False  # torch.compile(DDP(model)) instead of DDP(torch.compile(model))
    collective_timeout_s: int = 600  # a dead rank makes the others fail after this, not hang
    profile: bool = False  # each rank writes a torch.profiler trace of 3 steps to out_dir


POSITIVE = (lambda v: v > 0, "> 0")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
# what each key may be, checked before any work: (a predicate or a tuple of the allowed values, the
# rule in words)
CONFIG_RULES = {
    **{key: POSITIVE for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size",
                                 "micro_batch_size", "seq_len", "total_batch_size", "max_steps",
                                 "grad_clip", "bucket_cap_mb")},
    **{key: NON_NEGATIVE for key in ("max_lr", "min_lr", "warmup_steps", "weight_decay",
                                     "eval_interval", "val_batches", "sample_interval",
                                     "sample_tokens", "hellaswag_interval", "hellaswag_examples",
                                     "checkpoint_interval", "keep_checkpoints")},
    **{key: FRACTION for key in ("dropout", "beta1", "beta2")},
    "collective_timeout_s": (lambda v: 0 < v <= 10**8, "> 0 and <= 1e8 (3 years)"),
    "device": (lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) is not None,
               "auto, cpu, mps, cuda or cuda:N"),
    "sharding": (("ddp", "zero2", "fsdp"), "ddp, zero2 or fsdp"),
    "grad_compression": (("none", "bf16"), "none or bf16"),
    "resume": (("auto", "never"), "auto or never"),
}


def load_config(argv):
    """Builds a Config from `[CONFIG.toml] [--key=value ...]` (configurator.py), then checks what
    involves several keys. Raises UserError, in one line, for any bad input."""
    config = configurator.load_config(argv, Config, CONFIG_RULES)
    if config.eval_interval > 0 and config.val_batches < 1:
        raise UserError(f"config key 'val_batches' must be >= 1 when eval_interval > 0, got "
                        f"{config.val_batches}; or pass --eval_interval=0 to turn eval off")
    if config.exact_reduction and config.grad_compression != "none":
        raise UserError("exact_reduction sums gradients in float64 and grad_compression rounds them "
                        "to bf16: turn one of them off")
    if config.seq_len > config.block_size:
        raise UserError(f"seq_len={config.seq_len} exceeds block_size={config.block_size}")
    if config.n_embd % config.n_head:
        raise UserError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
    return config


# -----------------------------------------------------------------------------
# Model: GPT-2, with the module names of the released checkpoint


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.SCALE_INIT = 1
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # flash
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.SCALE_INIT = 1
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 (Radford et al. 2019): pre-LayerNorm transformer, learned positions, tied wte/lm_head.

    Parameter names match Hugging Face's `gpt2` checkpoint (`transformer.h.0.attn.c_attn.weight`...),
    whose Conv1D weights are the transpose of these Linear weights. Init as GPT-2: normal(0, 0.02),
    residual projections (c_proj) scaled by 1/sqrt(2 * n_layer), biases zero.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, "SCALE_INIT"):
                std *= (2 * self.config.n_layer) ** -0.5  # the residual stream sums 2 per block
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        """idx, targets: (B, T) int64 token ids. Returns logits (B, T, vocab_size), loss (mean CE)."""
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, n_embd)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            if self.config.activation_checkpointing and self.training:
                # keep only the block's input; the backward runs its forward again, restoring
                # the RNG state first so that dropout draws the same masks (preserve_rng_state)
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss

    def flops_per_token(self, T):
        """Training FLOPs per token at sequence length T, by nanoGPT's convention (PaLM, appendix
        B): 6N for the forward and backward matmuls, N the parameters without wpe (a lookup), plus
        12 * n_layer * n_head * head_dim * T for attention's QK^T and AV."""
        N = sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()
        cfg = self.config
        return 6 * N + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * T

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, generator, temperature=1.0, top_k=50):
        """Samples max_new_tokens after idx (B, T), yielding each new token (B, 1) as it is drawn:
        softmax(logits / temperature) cut to the top_k most likely tokens (all when top_k is 0 or
        above vocab_size), as nanoGPT's sample.py. The context is the last block_size tokens."""
        top_k = min(top_k or self.config.vocab_size, self.config.vocab_size)
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            probs = F.softmax(logits[:, -1, :].float() / temperature, dim=-1)  # (B, vocab_size)
            topk_probs, topk_idx = torch.topk(probs, top_k, dim=-1)  # (B, top_k)
            choice = torch.multinomial(topk_probs, 1, generator=generator)  # (B, 1)
            token = torch.gather(topk_idx, -1, choice)
            idx = torch.cat((idx, token), dim=1)
            yield token


# -----------------------------------------------------------------------------
# Data: memory-mapped token shards, micro-batches numbered globally across ranks

class DataLoader:
    """Yields (x, y) micro-batches of shape (B, T), int64, on `device`, from one split's shards.

    The shards of a split, in name order, form one token stream (no token is lost at a shard
    boundary). Global micro-batch g covers tokens [g*B*T, g*B*T + B*T + 1) of the stream, wrapping
    at the end of an epoch. Each call to next_batch advances every rank by world_size micro-batches
    and rank r gets micro-batch g + r, so the data each step sees does not depend on world_size.
    Shards are memory-mapped anew per batch, so host memory stays flat (nanoGPT #287).
    """

    def __init__(self, data_dir, split, B, T, rank, world_size, device, vocab_size, dataset=""):
        self.B, self.T, self.rank, self.world_size, self.device = B, T, rank, world_size, device
        self.vocab_size = vocab_size
        self.paths = split_paths(data_dir, split, dataset)
        if not self.paths:
            makers = {"fineweb-edu": "bash scripts/prepare_fineweb_edu.sh",
                      "tinyshakespeare": "python prepare_data.py"}
            maker = makers.get(Path(data_dir).name, f"python prepare_data.py --input FILES "
                               f"--name {Path(data_dir).name} --output-dir {data_dir}")
            raise UserError(f"no {split} shards ({dataset or '*'}_{split}_*.bin) in {data_dir}; make "
                            f"them with `{maker}`, or try the small CPU config: python "
                            f"prepare_data.py && python train_gpt2.py configs/shakespeare_cpu.toml")
        sizes = [read_shard_header(p) for p in self.paths]
        self.starts = np.cumsum([0] + sizes)  # stream offset of each shard's first token
        self.batches_per_epoch = (int(self.starts[-1]) - 1) // (B * T)
        if self.batches_per_epoch == 0:
            raise UserError(f"{split} split in {data_dir} has {self.starts[-1]} tokens, fewer than "
                             f"one micro-batch of B*T+1 = {B * T + 1}; lower micro_batch_size or seq_len")
        self.batch_index = 0  # global micro-batches consumed so far, the same on every rank

    def check_token_ids(self, cache_path, reduce_max):
        """Raises UserError, on every rank, when a shard holds a token id the embedding lacks
        (another tokenizer's shards): before the first step, not mid-run on the one rank that read
        it (shards.max_token_ids; a collective)."""
        maxima = max_token_ids(self.paths, cache_path, self.rank, self.world_size, reduce_max)
        for path, largest in zip(self.paths, maxima):
            if largest >= self.vocab_size:
                raise UserError(f"shard {path} holds token id {largest}, beyond vocab_size="
                                f"{self.vocab_size}: it was made with another tokenizer; remake it "
                                f"with prepare_data.py or raise vocab_size")

    def read(self, start, n):
        """Tokens [start, start + n) of the stream, crossing shard boundaries, as int64."""
        out = []
        while n > 0:
            i = int(np.searchsorted(self.starts, start, side="right")) - 1
            offset = start - int(self.starts[i])
            take = min(n, int(self.starts[i + 1]) - start)
            shard = read_tokens(self.paths[i])
            out.append(np.array(shard[offset:offset + take], dtype=np.int64))
            start, n = start + take, n - take
        return np.concatenate(out)

    def next_batch(self):
        """This rank's next micro-batch: global micro-batch batch_index + rank."""
        x, y = self.get_batch(self.batch_index + self.rank)
        self.batch_index += self.world_size
        return x, y

    def get_batch(self, g):
        """Global micro-batch g (wrapping at the end of the epoch) as (x, y)."""
        g %= self.batches_per_epoch
        buf = torch.from_numpy(self.read(g * self.B * self.T, self.B * self.T + 1))
        x = buf[:-1].view(self.B, self.T)
        y = buf[1:].view(self.B, self.T)
        if self.device.type == "cuda":  # pinned memory lets the copy overlap the GPU's work
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(
                self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self):
        """The position in the stream, in tokens: a run resumed with another micro_batch_size
        (same seq_len) reads the same sequences in each step."""
        return {"tokens": self.batch_index * self.B * self.T}

    def load_state_dict(self, state):
        tokens = state["tokens"] if "tokens" in state else (  # checkpoints of before 2026-11-22
            state["batch_index"] * state["tokens_per_batch"])
        if tokens % (self.B * self.T):
            raise UserError(f"the checkpoint's loader stopped at token {tokens}, not a whole number "
                            f"of this run's micro-batches of {self.B}*{self.T} tokens: resume with "
                            f"the checkpoint's seq_len and total_batch_size")
        self.batch_index = tokens // (self.B * self.T)


# dense bf16 tensor-core peak FLOP/s by device name, from NVIDIA's datasheets (SXM unless named)
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]


def peak_flops(device):
    """Peak bf16 FLOP/s of a CUDA device, or None for a device not in PEAK_BF16_FLOPS or a CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def optimizer_state_bytes(optimizer):
    """Bytes of optimizer state this rank holds (of a DTensor, its local shard)."""
    inner = optimizer.optimizer if isinstance(optimizer, ZeRO2AdamW) else optimizer
    tensors = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def derived_seed(*parts):
    """A 63-bit seed that depends on `parts` alone (e.g. seed, step, micro-batch)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def clip_grad_norm(grads, max_norm, sharded):
    """Scales grads in place so that their total 2-norm is at most max_norm, as
    torch.nn.utils.clip_grad_norm_ does (coefficient max_norm / (norm + 1e-6), capped at 1);
    returns the norm before clipping, a float32 scalar tensor.

    The squares are summed in float64, and `sharded` grads (this rank's slices of the gradient)
    over ranks too, so the norm comes out the same however the gradient is split into tensors,
    slices and ranks: the sharding modes and world sizes clip alike.
    """
    dtype = torch.float32 if grads[0].device.type == "mps" else torch.float64  # MPS has no float64
    norms = [torch.linalg.vector_norm(g, dtype=dtype) for g in grads]
    norm_sq = torch.stack(norms).pow(2).sum()
    if sharded:
        dist.all_reduce(norm_sq)
    norm = norm_sq.sqrt().float()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


# -----------------------------------------------------------------------------
# Sharded optimizer: AdamW with state and update split over ranks (ZeRO-2)

# torch 2.13 renamed these two collectives (from reduce_scatter_tensor and all_gather_into_tensor)
# and deprecated the old names, the only ones before it: take whichever this torch has, unwarned
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ZeRO2AdamW:
    """AdamW whose state and update are sharded over ranks: ZeRO stage 2 (Rajbhandari et al.
    2020), in the design of the blog "A Thousand Ways to Write ZeRO-2" (modded-nanogpt's DistAdam).

    Each parameter is flattened and zero-padded to a multiple of world_size; rank r owns slice r of
    it and keeps AdamW state for that slice only (1/world_size of DDP's 8 bytes per parameter).
    No DDP wrapper: micro-steps that do not sync accumulate p.grad locally. On the syncing one,
    a post-accumulate-grad hook launches an asynchronous reduce-scatter of each gradient as soon
    as autograd has finished it, so communication overlaps the rest of the backward.
    clip_grad_norm() waits on them in the order the backward made them and clips by the norm of
    the full gradient (summed over ranks); step() updates the slices with torch.optim.AdamW (the
    same arithmetic as ddp mode) and all-gathers the new slices into every rank's full
    parameters. With `exact`, the micro-steps' gradients are summed in float64 and
    reduce-scattered as float64 sums (see DDPMode), then cast to float32 once.

    state_dict()/load_state_dict() use the full, unsharded state in torch.optim.AdamW's format,
    so a checkpoint resumes at any world size. Both are collectives: every rank calls them.
    """

    def __init__(self, param_groups, rank, world_size, exact, **adamw_kwargs):
        self.rank, self.world_size, self.exact = rank, world_size, exact
        self.require_backward_grad_sync = True  # as DDP's flag: set before each forward
        self.shards = {}  # parameter -> this rank's slice of it, which the inner AdamW updates
        shard_groups = []
        for group in param_groups:
            for p in group["params"]:
                self.shards[p] = self.shard_of(p.detach()).clone()
                p.register_post_accumulate_grad_hook(self.reduce_scatter_grad)
            shard_groups.append({**group, "params": [self.shards[p] for p in group["params"]]})
        self.optimizer = torch.optim.AdamW(shard_groups, **adamw_kwargs)
        self.grads64 = {}  # exact: parameter -> float64 sum of this step's earlier micro-steps
        self.pending = []  # (parameter, reduced slice, work), in the order the backward ran

    @property
    def param_groups(self):
        """Where the schedule sets lr; a property, as load_state_dict replaces the list."""
        return self.optimizer.param_groups

    def padded(self, t):
        """t flattened and zero-padded to a multiple of world_size elements."""
        flat = t.reshape(-1)
        return F.pad(flat, (0, -flat.numel() % self.world_size))

    def shard_of(self, t):
        flat = self.padded(t)
        n = flat.numel() // self.world_size
        return flat[self.rank * n:(self.rank + 1) * n]

    def gather(self, shard, like):
        """Launches the all-gather of every rank's `shard` of a tensor shaped as `like`; returns
        the work and the full tensor, which holds the result once the work is waited on."""
        full = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        work = all_gather_single(full, shard, async_op=True)
        return work, full[:like.numel()].view_as(like)

    def reduce_scatter_grad(self, p):
        if self.exact:
            grad = self.grads64.pop(p, 0) + p.grad.double()
            if not self.require_backward_grad_sync:
                self.grads64[p], p.grad = grad, None
                return
        elif not self.require_backward_grad_sync:
            return
        else:
            grad = p.grad / self.world_size  # divide before summing, as DDP does, to round alike
        reduced = torch.empty(self.shards[p].shape, dtype=grad.dtype, device=grad.device)
        work = reduce_scatter_single(reduced, self.padded(grad), async_op=True)
        self.pending.append((p, reduced, work))

    def zero_grad(self):
        for p in self.shards:
            p.grad = None
        self.optimizer.zero_grad()

    def clip_grad_norm(self, max_norm):
        """Waits for the gradients' reduce-scatters and clips them to max_norm; returns the full
        gradient's norm before clipping."""
        for p, reduced, work in self.pending:  # in backward order: the earliest launched finish first
            work.wait()
            self.shards[p].grad = reduced.float()
            p.grad = None  # the full gradient is no longer needed: ZeRO-2's memory saving
        self.pending = []
        return clip_grad_norm([s.grad for s in self.shards.values()], max_norm, sharded=True)

    def step(self):
        """Updates this rank's slices and all-gathers them into every rank's full parameters."""
        self.optimizer.step()
        gathers = [(p, *self.gather(shard, p)) for p, shard in self.shards.items()]
        with torch.no_grad():
            for p, work, full in gathers:
                work.wait()
                p.copy_(full)

    def state_dict(self):
        inner = self.optimizer.state_dict()
        state = {}
        for i, p in enumerate(self.shards):  # in param_groups order, as AdamW numbers them
            if i not in inner["state"]:
                continue
            state[i] = {"step": inner["state"][i]["step"]}
            for key in ("exp_avg", "exp_avg_sq"):
                work, full = self.gather(inner["state"][i][key], p)
                work.wait()
                state[i][key] = full.clone()  # without the padding
        return {"state": state, "param_groups": inner["param_groups"]}

    def load_state_dict(self, full_state):
        """Call it after loading the model's weights: the slices are taken from them."""
        with torch.no_grad():
            for p, shard in self.shards.items():
                shard.copy_(self.shard_of(p))
        state = {i: {"step": s["step"], "exp_avg": self.shard_of(s["exp_avg"]).clone(),
                     "exp_avg_sq": self.shard_of(s["exp_avg_sq"]).clone()}
                 for i, s in full_state["state"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": full_state["param_groups"]})


# -----------------------------------------------------------------------------
# Sharding modes: everything that differs between ddp, zero2 and fsdp, in one place


class DDPMode:
    """sharding=ddp: every rank holds the whole model, gradients and AdamW state; DDP all-reduces
    the gradients in buckets, overlapped with the backward (one process without torchrun: no DDP).

    Every mode gives the loop `model` (to run), `optimizer` (whose lr the schedule sets),
    set_grad_sync(sync) before each micro-step's forward, clip_grad_norm(max_norm) after the last
    backward, then step() unless the loop skips the update, and state_dict()/load_state_dict()
    of the full, unsharded model and optimizer.

    exact_reduction: a post-accumulate-grad hook adds each micro-step's gradient into a float64
    sum; on the syncing micro-step a comm hook sums those over ranks in float64 and casts to
    float32 once. Float32 values summed in float64 are exact, or round to the same float32 in any
    order, so every world size gets the same bits.
    """

    def __init__(self, raw_model, config, rank, world_size, device):
        self.raw_model, self.config, self.sync = raw_model, config, True
        self.ddp_model = None
        self.grads64 = {}  # exact: parameter -> float64 sum of this step's earlier micro-steps
        self.model = self.wrap(raw_model, device)
        # AdamW, weight decay on matmul and embedding weights (2-D), not biases or norms
        params = [p for p in raw_model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        adamw_kwargs = dict(lr=config.max_lr, betas=(config.beta1, config.beta2), eps=1e-8,
                            fused=device.type == "cuda")
        self.optimizer = self.make_optimizer(groups, rank, world_size, adamw_kwargs)

    def wrap(self, model, device):
        config = self.config
        # DDP(compile(model)) compiles one graph for forward and backward; compile(DDP(model)) lets
        # DDPOptimizer split it at bucket boundaries so all-reduces can start during the backward
        if config.compile and not config.compile_ddp:
            model = torch.compile(model)
        if dist.is_initialized():  # launched by torchrun
            model = self.ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None,
                                         bucket_cap_mb=config.bucket_cap_mb,
                                         gradient_as_bucket_view=config.gradient_as_bucket_view)
            if config.grad_compression == "bf16":
                if device.type != "cuda":
                    raise UserError("grad_compression=bf16 needs NCCL (CUDA devices); gloo cannot "
                                    "reduce bf16: use grad_compression=none on CPU")
                self.ddp_model.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
            elif config.exact_reduction:
                self.ddp_model.register_comm_hook(None, self.all_reduce_float64)
        if config.exact_reduction:
            for p in self.raw_model.parameters():
                p.register_post_accumulate_grad_hook(self.accumulate_float64)
        if config.compile and config.compile_ddp:
            model = torch.compile(model)
        return model

    def make_optimizer(self, groups, rank, world_size, adamw_kwargs):
        return torch.optim.AdamW(groups, **adamw_kwargs)

    def set_grad_sync(self, sync):
        self.sync = sync
        if self.ddp_model is not None:
            self.ddp_model.require_backward_grad_sync = sync

    def accumulate_float64(self, p):
        """exact_reduction: adds p.grad to the step's float64 sum. On the syncing micro-step DDP's
        comm hook takes the sum over; one process without DDP casts it to p.grad here."""
        if self.sync and self.ddp_model is not None:
            return
        grad = self.grads64.pop(p, 0) + p.grad.double()
        if self.sync:
            p.grad = grad.float()
        else:
            self.grads64[p], p.grad = grad, None

    def all_reduce_float64(self, _, bucket):
        """DDP comm hook of exact_reduction: the bucket's gradients plus their float64 sums of the
        earlier micro-steps, summed over ranks in float64, cast to float32 once."""
        flat = torch.cat([(self.grads64.pop(p, 0) + g.double()).view(-1)
                          for p, g in zip(bucket.parameters(), bucket.gradients())])
        work = dist.all_reduce(flat, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0].float())

    def clip_grad_norm(self, max_norm):
        """Clips the gradient to max_norm; returns its norm before clipping (a device scalar)."""
        grads = [p.grad for p in self.raw_model.parameters() if p.grad is not None]
        return clip_grad_norm(grads, max_norm, sharded=False)

    def step(self):
        self.optimizer.step()

    def state_dict(self):
        return self.raw_model.state_dict(), self.optimizer.state_dict()

    def load_state_dict(self, model_state, optimizer_state):
        self.raw_model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)  # after the weights: zero2 slices them


class ZeRO2Mode(DDPMode):
    """sharding=zero2: whole weights and gradients on every rank, AdamW state and update sharded
    (ZeRO2AdamW, which reduce-scatters the gradients itself: no DDP wrapper)."""

    def wrap(self, model, device):
        return torch.compile(model) if self.config.compile else model

    def make_optimizer(self, groups, rank, world_size, adamw_kwargs):
        return ZeRO2AdamW(groups, rank, world_size, self.config.exact_reduction, **adamw_kwargs)

    def set_grad_sync(self, sync):
        self.optimizer.require_backward_grad_sync = sync

    def clip_grad_norm(self, max_norm):
        return self.optimizer.clip_grad_norm(max_norm)


class FSDPMode(DDPMode):
    """sharding=fsdp: FSDP2's fully_shard on each block and on the root (wte/lm_head tied, wpe,
    ln_f), bf16 parameters on CUDA: each group's weights are all-gathered just before its forward
    and backward, its gradients reduce-scattered after. exact_reduction: FSDP accumulates the
    unsynced micro-steps' gradients in its reduce dtype, float64, and reduce-scatters sums."""

    def wrap(self, model, device):
        # imported here, not at the top: FSDP2 and its checkpoint helpers add ~1.5 s to every
        # process's start-up (measured on 2 CPU cores), and only this mode uses them
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if device.type == "cuda" else None,
            reduce_dtype=torch.float64 if self.config.exact_reduction else torch.float32)
        for module in [*model.transformer.h, model]:
            fully_shard(module, mp_policy=mp_policy)
            if self.config.exact_reduction:
                module.set_gradient_divide_factor(1.0)  # the loss is divided by all micro-batches
            elif device.type == "cpu":
                # gloo's reduce-scatter returned the sum for ReduceOp.AVG on torch 2.8 (measured,
                # twice the gradient at world size 2); FSDP's sum-then-divide is the mean on all
                module.set_force_sum_reduction_for_comms(True)
        return torch.compile(model) if self.config.compile else model

    def set_grad_sync(self, sync):
        self.raw_model.set_requires_gradient_sync(sync)

    def clip_grad_norm(self, max_norm):
        grads = [p.grad.to_local() for p in self.raw_model.parameters() if p.grad is not None]
        return clip_grad_norm(grads, max_norm, sharded=True)

    def state_dict(self):
        """Full state dicts keyed by parameter name (torch.distributed.checkpoint)."""
        from torch.distributed.checkpoint import state_dict as dcp
        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (dcp.get_model_state_dict(self.raw_model, options=options),
                dcp.get_optimizer_state_dict(self.raw_model, self.optimizer, options=options))

    def load_state_dict(self, model_state, optimizer_state):
        from torch.distributed.checkpoint import state_dict as dcp
        options = dcp.StateDictOptions(full_state_dict=True)
        dcp.set_model_state_dict(self.raw_model, model_state, options=options)
        dcp.set_optimizer_state_dict(self.raw_model, self.optimizer, optimizer_state, options=options)


SHARDING_MODES = {"ddp": DDPMode, "zero2": ZeRO2Mode, "fsdp": FSDPMode}


# -----------------------------------------------------------------------------
# Distributed setup: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; plain python runs one process


def keep_freed_cpu_memory():
    """Makes glibc keep freed memory in the heap instead of handing it back to the OS.

    glibc serves blocks over its mmap threshold (at most 32 MiB) with mmap and unmaps them on free,
    so each step page-faults its largest tensors (the (B, T, vocab_size) logits) in anew. Measured
    with the CPU quickstart on 2 cores: 2.9x the tokens/s. No-op where libc is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def catch_stop_signals():
    """Makes SIGINT (Ctrl-C) and SIGTERM (what SLURM, Kubernetes and torchrun send before they
    kill) ask the training loop to finish its step, save a checkpoint and exit, instead of dying
    mid-step. Returns the list the handler appends each signal to. The same signal again takes
    its default action: it ends the process at once."""
    received = []

    def handler(signum, frame):
        received.append(signum)
        signal.signal(signum, signal.SIG_DFL)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
    return received


def agreed(fn, master_only=False):
    """Runs fn() on every rank (on rank 0 alone with master_only) and returns its result where it
    ran, None elsewhere. If fn raised UserError on any rank, every rank raises it (the lowest such
    rank's message), so that under torchrun the others stop too instead of waiting for a
    collective until the timeout; configurator.run prints it from rank 0 alone. A collective."""
    result, error = None, None
    if not master_only or not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise UserError(error)
    return result


def broadcast_object(obj):
    """Rank 0's obj (picklable), on every rank. A collective."""
    if dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    return obj


def all_reduce_max(values, device):
    """The element-wise maximum of a list of ints over ranks. A collective."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


MAX_SKIPPED_STEPS = 3  # updates skipped for a non-finite loss or gradient, in a row, end the run
TORCH_FLOOR = (2, 8)  # requirements.txt's: FSDP2's set_gradient_divide_factor, for exact_reduction


def main(argv):
    """Sets up the device and process group from torchrun's variables and runs train(); returns
    the exit code (non-zero when a signal stopped the run)."""
    # major.minor alone: NGC's and source builds of 2.8 call themselves 2.8.0a0+...
    if tuple(map(int, torch.__version__.split(".")[:2])) < TORCH_FLOOR:
        floor = "%d.%d" % TORCH_FLOOR
        raise UserError(f"torch {torch.__version__} is older than {floor}, the oldest that "
                        f"train_gpt2.py runs on: pip install 'torch>={floor}'")
    config = load_config(argv)
    launched = "RANK" in os.environ  # by torchrun
    if launched:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ["LOCAL_RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    else:
        rank, local_rank, world_size = 0, 0, 1
    master_process = rank == 0  # alone prints, logs, samples and saves
    if config.device == "auto":
        if torch.cuda.is_available():
            device = f"cuda:{local_rank}"
        elif torch.backends.mps.is_available() and not launched:
            device = "mps"
        else:
            device = "cpu"
    else:
        device = config.device
    device = torch.device(device)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device={config.device}: this machine has {torch.cuda.device_count()} "
                        f"CUDA device(s) visible to torch; pass --device=auto or cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device=mps: MPS is not available here; pass --device=auto or cpu")
    if config.exact_reduction:  # bitwise runs need kernels that round alike, too
        if device.type == "mps":
            raise UserError("exact_reduction sums in float64, which MPS lacks: pass --device=cpu "
                            "or --exact_reduction=false")
        if device.type == "cuda":  # no atomics; cuBLAS needs a fixed workspace for that
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        elif "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)  # CPU kernels split sums by thread: one, as torchrun's workers
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":
        keep_freed_cpu_memory()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.collective_timeout_s)
    if launched:
        store = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's store outlives a worker restart, keys and all, and restarted workers would
            # read the dead ones' addresses (pytorch#135712): each attempt gets its own prefix. The
            # count is per node, so restarts across nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
            store = dist.PrefixStore(
                f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}",
                dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device if device.type == "cuda" else None)
    elif config.sharding != "ddp":  # the sharded modes' collectives need a group, even of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return train(config, rank, world_size, master_process, device)
    finally:
        if dist.is_initialized():
            # free what still refers to the group (FSDP's and gloo's work objects, in reference
            # cycles) before destroying it: otherwise gloo aborted about 1 in 8 four-rank fsdp
            # runs at exit ("terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()


def resume(config, mode, train_loader, master_process, log):
    """Loads the newest checkpoint of out_dir that loads (chosen on rank 0, which sets damaged
    newer ones aside: checkpoints.newest_loadable) into the model, optimizer and train loader, on
    every rank. No RNG state is needed: every random draw after init is seeded from (seed, step...).

    Returns (its step, its path), or (0, None) when resume=never or out_dir has no checkpoint.
    Raises UserError, on every rank, when none loads, when it is of another model, or when a rank
    cannot read the one rank 0 chose.
    """
    if config.resume == "never":
        return 0, None
    found = agreed(lambda: checkpoints.newest_loadable(config.out_dir, log), master_only=True)
    path = broadcast_object(found[0] if master_process else None)
    if path is None:
        return 0, None

    def load():
        if master_process:
            return found[1]
        try:
            return checkpoints.load(path)
        except checkpoints.Unloadable as e:
            raise UserError(f"checkpoint {path} loads on rank 0 but not on this node ({e}): out_dir "
                            f"must be a directory that every node sees") from None

    ckpt = agreed(load)
    saved = ckpt["config"]
    model_keys = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")
    diff = {k: (saved.get(k), getattr(config, k)) for k in model_keys if saved.get(k) != getattr(config, k)}
    if (saved.get("sharding") == "fsdp") != (config.sharding == "fsdp"):
        diff["sharding"] = (saved.get("sharding"), config.sharding)  # another optimizer format
    if diff:
        raise UserError(
            f"checkpoint {path} is of another model: "
            + ", ".join(f"{k}={a} in the checkpoint, {b} in this run" for k, (a, b) in diff.items())
            + "; use the checkpoint's model config, another out_dir, or resume=never")
    mode.load_state_dict(ckpt["model"], ckpt["optimizer"])
    train_loader.load_state_dict(ckpt["loader"])
    log(f"resumed from {path} at step {ckpt['step']}")
    return ckpt["step"], path


def train(config, rank, world_size, master_process, device):
    def log(*args):
        if master_process:
            print(*args, flush=True)

    B, T = config.micro_batch_size, config.seq_len
    tokens_per_micro_step = B * T * world_size
    if config.total_batch_size % tokens_per_micro_step:
        raise UserError(
            f"total_batch_size={config.total_batch_size} is not divisible by micro_batch_size * "
            f"seq_len * world_size = {B}*{T}*{world_size} = {tokens_per_micro_step}; change "
            f"total_batch_size or micro_batch_size")
    grad_accum_steps = config.total_batch_size // tokens_per_micro_step
    micro_batches_per_step = grad_accum_steps * world_size
    # Gradients sum to the mean over the step's micro-batches. By default each rank divides by its
    # own micro-batches and DDP averages over ranks; exact_reduction sums over ranks in float64 what
    # one process would sum, so every micro-batch's loss is divided alike at every world size.
    loss_divisor = micro_batches_per_step if config.exact_reduction else grad_accum_steps
    sum_dtype = torch.float64 if config.exact_reduction else torch.float32
    log(f"world_size {world_size} | device {device} | total batch {config.total_batch_size} tokens "
        f"= {B} x {T} x {world_size} x {grad_accum_steps} grad accum steps")
    # rank 0's handle on out_dir, taken first: a second run on the same out_dir stops here
    out = agreed(lambda: checkpoints.OutDir(config.out_dir), master_only=True)
    out_dir = Path(config.out_dir)
    existing = sorted(out_dir.glob(checkpoints.PATTERN))
    if config.resume == "never" and existing and not config.overwrite:
        raise UserError(f"{out_dir} has checkpoints and resume=never would overwrite them; pass "
                        f"--resume=auto to continue, --overwrite=true to start over, or another "
                        f"--out_dir")

    # imported only when used (safetensors and huggingface_hub are slow to import); bad weights or
    # data fail here, before any work
    pretrained_state = None
    if config.init_from != "scratch":
        from gpt2_weights import pretrained
        # a run that will resume takes its weights from its checkpoint: GPT-2's shape is enough
        resuming = config.resume == "auto" and bool(existing)
        config, pretrained_state = agreed(lambda: pretrained(config, weights=not resuming))
        log(f"init_from {config.init_from}: {config.n_layer} layers, n_embd {config.n_embd}")
    enc = gpt2_encoding()
    # an empty prompt starts from <|endoftext|>, as GPT-2's unconditional samples
    prompt = enc.encode_ordinary(config.sample_prompt) or [EOT_TOKEN]
    if config.sample_interval > 0 and max(prompt) >= config.vocab_size:
        raise UserError(f"sample_prompt {config.sample_prompt!r} has GPT-2 token id {max(prompt)}, "
                        f"beyond vocab_size={config.vocab_size}: pick another prompt, or pass "
                        f"--sample_interval=0")
    if config.hellaswag_interval > 0:
        import hellaswag
        hellaswag_examples = hellaswag.examples_for_training(config, master_process)
    # agreed: a data_dir missing on one node stops every rank at once
    train_loader, val_loader = agreed(lambda: [
        DataLoader(config.data_dir, split, B, T, rank, world_size, device, config.vocab_size,
                   config.dataset) for split in ("train", "val")])
    for loader in (train_loader, val_loader):
        loader.check_token_ids(out_dir / "token_ids.json", lambda values: all_reduce_max(values, device))

    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later
    autocast = (torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else nullcontext())
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    raw_model = GPT(config).to(device)
    if pretrained_state is not None:
        raw_model.load_state_dict(pretrained_state)
    if config.compile and config.dropout > 0:
        # compiled dropout draws other masks than eager unless it falls back to eager RNG
        torch._inductor.config.fallback_random = True
    mode = SHARDING_MODES[config.sharding](raw_model, config, rank, world_size, device)
    model, optimizer = mode.model, mode.optimizer
    log(memory_plan.summary(config, world_size, device.type))
    flops_per_step = raw_model.flops_per_token(T) * config.total_batch_size
    peak = peak_flops(device)
    if peak is None:
        log(f"MFU not reported: no peak FLOP/s known for {device} (see PEAK_BF16_FLOPS)")

    def get_lr(step):
        """Linear warmup to max_lr, then cosine decay to min_lr at max_steps (GPT-3 paper, B.1)."""
        if step < config.warmup_steps:
            return config.max_lr * (step + 1) / config.warmup_steps
        if step >= config.max_steps:
            return config.min_lr
        ratio = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
        return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (config.max_lr - config.min_lr)

    start_step, resumed_from = resume(config, mode, train_loader, master_process, log)
    if start_step >= config.max_steps:
        log(f"the run in {out_dir} is complete: step {start_step} of max_steps={config.max_steps}. "
            f"Raise --max_steps to train on, or start over with --resume=never --overwrite=true or "
            f"another --out_dir")
        return 0
    # with overwrite, the old checkpoints and log stay until the first checkpoint of this run
    agreed(lambda: out.start(start_step, resumed_from, existing if config.resume == "never" else []),
           master_only=True)

    def log_json(record):
        if master_process:
            out.log(record)

    def save_checkpoint(step):
        """Saves the checkpoint of `step` (checkpoints.OutDir.save). Every rank calls it: the
        sharded modes gather their state into full tensors first, and all ranks stop if it fails."""
        model_state, optimizer_state = mode.state_dict()
        state = {"model": model_state, "optimizer": optimizer_state,
                 "config": dataclasses.asdict(config), "step": step,
                 "loader": train_loader.state_dict()}
        path = agreed(lambda: out.save(step, state, config.keep_checkpoints), master_only=True)
        log(f"saved {path}")

    def evaluate():
        """Mean loss over the first val_batches micro-batches of the val split, whatever world_size."""
        raw_model.eval()
        total = torch.zeros(2, device=device, dtype=sum_dtype)  # sum of losses, number of batches
        # every rank runs as many batches (FSDP's all-gathers must pair up); those past
        # val_batches get weight 0
        padded = math.ceil(config.val_batches / world_size) * world_size
        with torch.no_grad():
            for g in range(rank, padded, world_size):
                x, y = val_loader.get_batch(g)
                with autocast:
                    _, loss = raw_model(x, y)
                weight = torch.tensor(float(g < config.val_batches), device=device, dtype=sum_dtype)
                total += torch.stack([loss.to(sum_dtype) * weight, weight])
        if dist.is_initialized():
            dist.all_reduce(total)
        raw_model.train()
        return (total[0] / total[1]).float().item()

    def sample(step):
        raw_model.eval()
        idx = torch.tensor([prompt], device=device)
        generator = torch.Generator(device=device).manual_seed(derived_seed(config.seed, "sample", step))
        tokens = torch.cat([idx, *raw_model.generate(idx, config.sample_tokens, generator)], dim=1)
        raw_model.train()
        log(f"sample at step {step}: {enc.decode(tokens[0].tolist())!r}")

    def every(interval, step):
        return interval > 0 and (step % interval == 0 or step == config.max_steps - 1)

    profiler = None
    if config.profile:  # steps 3, 4 and 5 of this run, after warm-up; scripts/timeline.py draws them
        trace = out_dir / f"trace_rank{rank}.json"
        profiler = torch.profiler.profile(
            record_shapes=True,  # the collectives' sizes: bytes communicated per step
            schedule=torch.profiler.schedule(wait=2, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(trace)))
        profiler.start()

    # -------------------------------------------------------------------------
    # Training loop
    dt_avg = 0.0  # seconds per step, for the ETA
    skipped = 0  # steps in a row whose update was skipped
    last_saved = start_step  # the step of out_dir's newest checkpoint, 0 for none
    stop, stop_signals = False, catch_stop_signals()
    stop_flag = torch.zeros((), device=device, dtype=sum_dtype)
    for step in range(start_step, config.max_steps):
        if every(config.eval_interval, step):
            val_loss = evaluate()
            log(f"step {step:5d} | val loss {val_loss:.4f}")
            log_json({"step": step, "val_loss": val_loss})
        if every(config.hellaswag_interval, step):
            result = hellaswag.evaluate(raw_model, hellaswag_examples, device, rank, world_size,
                                        autocast)
            raw_model.train()
            log(f"step {step:5d} | {hellaswag.summary(result)}")
            log_json({"step": step, **result})
        if every(config.sample_interval, step) and step > 0:
            sample(step)  # on every rank, for FSDP's all-gathers; the master prints

        t0 = time.time()
        optimizer.zero_grad()
        loss_sum = torch.zeros((), device=device, dtype=sum_dtype)
        for micro_step in range(grad_accum_steps):
            last_micro_step = micro_step == grad_accum_steps - 1
            with record_function("data"):
                x, y = train_loader.next_batch()
            # sync gradients on the last micro-step only; DDP reads its flag in forward as well
            # as backward, so it is set before the forward (build-nanogpt #30)
            mode.set_grad_sync(last_micro_step)
            m = micro_step * world_size + rank  # this micro-batch's number within the step
            # dropout masks depend on (seed, step, m) alone, so on no world size
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    record_function("forward_backward_sync" if last_micro_step else "forward_backward"):
                torch.manual_seed(derived_seed(config.seed, step, m))
                with autocast, record_function("forward"):
                    _, loss = model(x, y)
                with record_function("backward"):
                    (loss / loss_divisor).backward()
            loss_sum += loss.detach()
        # the step's loss sum carries, in the same all-reduce, whether any rank was asked to stop
        # (fill_ takes the host's value without the sync a new device tensor would cost)
        totals = torch.stack([loss_sum, stop_flag.fill_(len(stop_signals))])
        if dist.is_initialized():
            dist.all_reduce(totals)
        loss_sum, stop = totals
        with record_function("optimizer"):
            lr = get_lr(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            norm = mode.clip_grad_norm(config.grad_clip)
            # the step's one host sync, before the update: a non-finite loss or gradient norm
            # (divergence, a bad batch) skips it, leaving weights and optimizer state untouched
            loss_value, stop, norm = torch.stack(
                [(loss_sum / micro_batches_per_step).float(), stop.float(), norm]).tolist()
            finite = math.isfinite(loss_value) and math.isfinite(norm)
            if finite:
                mode.step()
        skipped = 0 if finite else skipped + 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        tokens_per_sec = config.total_batch_size / dt
        record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm,
                  "dt_ms": dt * 1000, "tokens_per_sec": tokens_per_sec}
        if not finite:
            record["skipped"] = True
        if peak:
            record["mfu"] = flops_per_step / dt / (peak * world_size)
        if device.type == "cuda":
            record["mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        if step == start_step:
            record["optimizer_state_bytes"] = optimizer_state_bytes(optimizer)  # rank 0's
        # the ETA averages the step times after the first (compilation, warm-up), evals aside
        dt_avg = dt if step <= start_step + 1 else 0.9 * dt_avg + 0.1 * dt
        eta = timedelta(seconds=round(min(dt_avg * (config.max_steps - step - 1), 1e12)))
        log(f"step {step:5d}/{config.max_steps} | loss: {loss_value:.6f} | lr {lr:.4e} | norm: "
            f"{norm:.4f} | dt: {dt * 1000:.2f}ms | tok/sec: {tokens_per_sec:.2f}"
            + (f" | mfu: {record['mfu'] * 100:.1f}%" if peak else "") + f" | eta {eta}"
            + ("" if finite else " | update skipped: non-finite loss or gradient"))
        if profiler:
            profiler.step()
        log_json(record)
        if skipped == MAX_SKIPPED_STEPS:  # every rank sees the same all-reduced values
            raise UserError(
                f"the loss or gradient norm was not finite in steps {step - skipped + 1}-{step} "
                f"(loss {loss_value}, grad norm {norm}): the run diverged; those updates were "
                f"skipped. Lower --max_lr (now {config.max_lr}) or look for bad data in those "
                f"steps, and rerun to resume from the newest checkpoint "
                + (f"(step {last_saved}" if last_saved else "(none yet")
                + f"), or move the newest out of {config.out_dir} to resume from before the "
                f"divergence began")
        stop = stop > 0
        # a stop or the last step always saves (a skipped update left the weights as they were);
        # the interval does not during a run of skipped updates, which may be a divergence
        if stop or step + 1 == config.max_steps or (not skipped and config.checkpoint_interval > 0
                                                    and (step + 1) % config.checkpoint_interval == 0):
            save_checkpoint(step + 1)
            last_saved = step + 1
        if stop:
            signum = stop_signals[0] if stop_signals else signal.SIGTERM  # another rank's
            log(f"stopped by {signal.Signals(signum).name} after step {step}: the checkpoint of "
                f"step {step + 1} is saved; rerun the same command to resume")
            break
    if profiler:
        profiler.stop()
    if dist.is_initialized():
        dist.barrier()  # gloo aborts a rank that tears down while rank 0 still saves
    return 128 + signum if stop else 0  # the shell's code for "ended by that signal"


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__ + "\nConfig keys, their defaults and what they do:")
        print("\n".join(configurator.help_lines(Config)))
        sys.exit(0)
    try:
        configurator.run(main, "train_gpt2.py")
    except KeyboardInterrupt:  # Ctrl-C before the training loop, which handles it itself
        print("train_gpt2.py: interrupted before training began; nothing to save", file=sys.stderr)
        sys.exit(130)
