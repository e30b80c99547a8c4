r"""
Train GPT-2 with data parallelism, in one file: the config, the model, the sharded token loader,
DDP's setup and teardown, and the training loop (gradient accumulation, the all-reduced loss,
clipping, the update). The package gpt2_ddp/ holds what the loop calls besides; docs/architecture.md
maps it.

One process (GPU, Apple MPS or CPU):
    python train_gpt2.py configs/shakespeare_cpu.toml
Two CPU processes (DDP over gloo), the quickstart:
    torchrun --standalone --nproc_per_node=2 train_gpt2.py configs/shakespeare_cpu.toml
GPT-2 124M on 8 GPUs (DDP over NCCL); the defaults are this run:
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml
Two nodes of 8 GPUs each, run on both nodes:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=gpt2 train_gpt2.py configs/gpt2_124m.toml
Finetune OpenAI's GPT-2 (init_from), then sample from it (python -m scripts.sample):
    python train_gpt2.py configs/finetune_shakespeare.toml
Any config key can be overridden after the config file, e.g. --max_steps=1e4 --compile=false.
Muon for the blocks' matrices, AdamW for the rest (docs/muon.md):
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml --optimizer=muon
Swap-ins for DDP (gpt2_ddp/data_parallel.py): ZeRO-2, FSDP2, float64 gradient sums (bitwise runs):
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml --sharding=zero2
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml --sharding=fsdp
    torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml --exact_reduction=true

The promise: a run on N processes is the run on one. The global batch is split into micro-batches
numbered across ranks, micro-batch m of a step goes to rank m % world_size, and dropout draws from
a random state derived from (seed, step, m) alone. So world size changes only the float rounding.
"""

import dataclasses
import errno
import gc
import hashlib
import math
import os
import re
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from gpt2_ddp import (checkpoints, configurator, data_parallel, gpt2_weights, hellaswag, memory_plan,
                      precision)
from gpt2_ddp.collectives import (STOP_SIGNALS, Stopped, agreed, all_reduce_max, catch_stop_signals,
                                  machine_failure, stopped_line, torchrun_env, wait_for_master)
from gpt2_ddp.device import (SDPA_BACKENDS, check_torch_version, choose_attention, choose_device,
                             keep_freed_cpu_memory, make_deterministic)
from gpt2_ddp.configurator import UserError
from gpt2_ddp.gpt2_weights import MODEL_KEYS
from gpt2_ddp.metrics import Metrics, Waiting, log
from gpt2_ddp.muon import Chain, Muon
from gpt2_ddp.sampling import KVCache, training_sample
from gpt2_ddp.shards import DocumentRows, check_token_ids, pread_tokens, read_shard_header, split_paths
from gpt2_ddp.tokenizer import EOT_TOKEN, gpt2_encoding

# -----------------------------------------------------------------------------
# Config


@dataclass
class Config:
    """Every knob of a run. Defaults reproduce GPT-2 124M as in karpathy/build-nanogpt."""

    # Every key's comment is its --help line. "Step N" is the model after N optimizer updates: the
    # train line of the N-th update, the evaluations of its weights, ckpt_N.pt. Intervals count
    # steps; 0 turns the action off, and otherwise the last step always runs it. The last step
    # always saves a checkpoint.
    # data and output
    data_dir: str = "data/fineweb-edu"  # shards made by prepare_data.py
    dataset: str = ""  # the shards' name prefix to train on, where data_dir holds several datasets
    out_dir: str = "out"  # log.jsonl and checkpoints
    # model: GPT-2 124M
    init_from: str = "scratch"  # scratch, gpt2[-medium|-large|-xl], a Hugging Face dir, or our out_dir
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
    data_order: str = "shuffled"  # each epoch new rows packed from documents; sequential: build-nanogpt's
    # optimizer and schedule (linear warmup, cosine decay)
    optimizer: str = "adamw"  # adamw; muon: Muon for the blocks' matrices, AdamW for the rest
    max_steps: int = 19073  # optimizer steps: 10B tokens / 524288 tokens per step
    max_lr: float = 6e-4  # learning rate at the end of warmup (AdamW's)
    muon_lr: float = 0.02  # optimizer=muon: Muon's max_lr, on the same schedule (nanochat's)
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
    sample_prompt: str = ""  # what the samples continue; empty: <|endoftext|>, which suits any data
    sample_tokens: int = 32  # tokens per sample
    hellaswag_interval: int = 0  # HellaSwag accuracy every N steps
    hellaswag_examples: int = 0  # the first N of the file; 0 takes all (10042 in the val split)
    hellaswag_path: str = "data/hellaswag/hellaswag_val.jsonl"  # downloaded there when missing
    checkpoint_interval: int = 5000  # a checkpoint every N steps (and at the last)
    keep_checkpoints: int = 3  # the newest N checkpoints stay on disk; 0 keeps all
    resume: str = "auto"  # auto: continue from the latest checkpoint in out_dir; never: start fresh
    overwrite: bool = False  # with resume=never, delete out_dir's checkpoints instead of refusing
    allow_new_data: bool = False  # resume though the train shards differ from the checkpoint's
    # logging: the console and log.jsonl always; wandb and TensorBoard beside them (docs/logging.md)
    wandb_log: bool = False  # send every log.jsonl record to wandb (pip install wandb)
    wandb_project: str = "gpt2"  # the wandb project the run goes to
    wandb_run_name: str = ""  # the wandb run's name; empty: wandb makes one up (e.g. swift-river-12)
    tensorboard: bool = False  # every log.jsonl record as TensorBoard scalars in {out_dir}/tensorboard
    peak_flops: float = 0.0  # the device's peak FLOP/s, for MFU; 0: by GPU name (H100, H200, A100)
    # system
    seed: int = 1337  # initial weights, dropout masks, samples and the shuffled order derive from it
    device: str = "auto"  # auto: cuda:LOCAL_RANK, else mps (single process), else cpu
    sharding: str = "ddp"  # ddp: replicas; zero2: shard optimizer state; fsdp: shard params too (FSDP2)
    bucket_cap_mb: int = 25  # ddp: gradients are all-reduced in buckets of this size
    gradient_as_bucket_view: bool = False  # ddp: gradients live in the buckets, saving a copy
    grad_compression: str = "none"  # ddp: bf16 all-reduces half the bytes (NCCL only)
    exact_reduction: bool = False  # sum gradients and losses in float64: the same bits at any world size
    dtype: str = "auto"  # bfloat16, float16 (loss-scaled) or float32; auto: by GPU, float32 on CPU
    compile: bool = True  # torch.compile the model
    compile_ddp: bool = False  # torch.compile(DDP(model)) instead of DDP(torch.compile(model))
    sdpa_backend: str = "auto"  # attention's kernel: auto (torch's choice), cudnn, flash, efficient or math
    collective_timeout_s: int = 600  # a dead rank makes the others fail after this, not hang
    profile: bool = False  # each rank writes a torch.profiler trace of 3 steps to out_dir


PATH_KEYS = ("data_dir", "out_dir", "init_from", "hellaswag_path")  # ~ is expanded in each
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
                                     "checkpoint_interval", "keep_checkpoints", "muon_lr",
                                     "peak_flops")},
    **{key: FRACTION for key in ("dropout", "beta1", "beta2")},
    **{key: (lambda v: v.strip() != "", "a path, not empty") for key in PATH_KEYS},
    "collective_timeout_s": (lambda v: 0 < v <= 10**8, "> 0 and <= 1e8 (3 years)"),
    "device": (lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) is not None,
               "auto, cpu, mps, cuda or cuda:N"),
    "sharding": (("ddp", "zero2", "fsdp"), "ddp, zero2 or fsdp"),
    "grad_compression": (("none", "bf16"), "none or bf16"),
    "optimizer": (("adamw", "muon"), "adamw or muon"),
    "dtype": (("auto", *precision.DTYPES), "auto, bfloat16, float16 or float32"),
    "resume": (("auto", "never"), "auto or never"),
    "data_order": (("shuffled", "sequential"), "shuffled or sequential"),
    "sdpa_backend": (("auto", *SDPA_BACKENDS), "auto, cudnn, flash, efficient or math"),
}


def load_config(argv):
    """Builds a Config from `[CONFIG.toml] [--key=value ...]` (gpt2_ddp/configurator.py), then
    checks what involves several keys. Raises UserError, in one line, for any bad input."""
    config = configurator.load_config(argv, Config, CONFIG_RULES)
    config = dataclasses.replace(config, **{k: os.path.expanduser(getattr(config, k)) for k in PATH_KEYS})
    if config.eval_interval > 0 and config.val_batches < 1:
        raise UserError(f"config key 'val_batches' must be >= 1 when eval_interval > 0, got "
                        f"{config.val_batches}; or pass --eval_interval=0 to turn eval off")
    if config.exact_reduction and config.grad_compression != "none":
        raise UserError("exact_reduction sums gradients in float64 and grad_compression rounds them "
                        "to bf16: turn one of them off")
    if config.min_lr > config.max_lr:
        raise UserError(f"min_lr={config.min_lr} exceeds max_lr={config.max_lr}: the cosine decays "
                        f"from max_lr down to min_lr")
    if config.resume == "auto" and config.overwrite:
        raise UserError("overwrite=true takes effect only with resume=never: pass --resume=never "
                        "--overwrite=true to start over, or drop --overwrite to continue")
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

    def forward(self, x, cache=None, layer=0):
        """x: (B, T, C). With a KVCache, k and v join this layer's cached ones (`layer` is its
        index) and the queries attend to all of them: T tokens from position 0 (a prefill), or
        one token after the cached ones. Returns (B, T, C)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.store(layer, k, v)  # (B, nh, pos + T, hs)
        dropout_p = self.dropout if self.training else 0.0
        # a single query (decoding) sees every cached key; a branch, as SDPA takes no symbolic bool
        causal = True if T > 1 else False
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)  # flash
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

    def forward(self, x, cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), cache, layer)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 (Radford et al. 2019): pre-LayerNorm transformer, learned positions, tied wte/lm_head.
    Parameter names match Hugging Face's `gpt2` checkpoint, whose Conv1D weights are the transpose
    of these Linear weights. Init as GPT-2: normal(0, 0.02), residual projections (c_proj) scaled
    by 1/sqrt(2 * n_layer), biases zero."""

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
        if self.lm_head.weight.device.type != "meta":  # the memory plan's model has no values
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

    def forward(self, idx, targets=None, cache=None):
        """idx, targets: (B, T) int64 token ids. Returns logits (B, T, vocab_size), loss (mean CE).
        With a KVCache (generate()): idx is T tokens from position 0, or one token at cache.pos;
        their keys and values join the cache and the logits are the last position's, (B, 1, V)."""
        B, T = idx.size()
        start = 0 if cache is None else cache.pos
        assert start + T <= self.config.block_size, f"positions up to {start + T} > block_size"
        assert start == 0 or T == 1, "after a prefill the cache takes one token at a time"
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # (T)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, n_embd)
        x = self.transformer.drop(x)
        for layer, block in enumerate(self.transformer.h):
            if self.config.activation_checkpointing and self.training:
                # keep only the block's input; the backward runs its forward again, restoring
                # the RNG state first so that dropout draws the same masks (preserve_rng_state)
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache, layer)
        x = self.transformer.ln_f(x)
        if cache is not None:
            cache.pos += T
            # sampling reads the last position alone; at GPT-2's size lm_head holds a third of
            # the weights, so a prefill of T tokens saves T - 1 of its matmuls
            x = x[:, -1:, :]  # (B, 1, n_embd)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss

    def flops_per_token(self, T):
        """Training FLOPs per token at sequence length T (PaLM, appendix B, as nanoGPT): 6N for the
        matmuls, N the parameters but the lookups that no matmul shares (wpe), plus 12 * n_layer *
        n_embd * T for attention."""
        N = sum(p.numel() for p in self.parameters()) - sum(m.weight.numel() for m in self.modules()
                                                            if isinstance(m, nn.Embedding)
                                                            and m.weight is not self.lm_head.weight)
        cfg = self.config
        return 6 * N + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * T

    def configure_optimizers(self, config, device_type):
        """The run's optimizer, one object whose step() updates every parameter (nanoGPT's
        configure_optimizers, nanochat's setup_optimizers). AdamW (Loshchilov & Hutter 2019) with
        config's lr and betas, eps 1e-8 as GPT-3, fused (which can skip an update on the device:
        precision.step_unless) but on the meta device; weight decay on the 2-D weights (matmuls and
        embeddings), none on biases and LayerNorm gains, as GPT-2 and nanoGPT.
        optimizer=muon: Muon for the blocks' matmul weights (c_attn's as q, k and v: splits 3),
        AdamW for the rest (the tied wte/lm_head, wpe, biases, gains), stepped as one. Each group's
        lr_scale is what the schedule's learning rate is multiplied by for it."""
        blocks = self.transformer.h
        muon = [p for p in blocks.parameters() if p.dim() == 2] if config.optimizer == "muon" else []
        rest = [p for p in self.parameters() if all(p is not q for q in muon)]
        decay = {"params": [p for p in rest if p.dim() >= 2], "weight_decay": config.weight_decay}
        no_decay = {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}
        adamw = torch.optim.AdamW([{**decay, "lr_scale": 1.0}, {**no_decay, "lr_scale": 1.0}],
                                  lr=config.max_lr, betas=(config.beta1, config.beta2), eps=1e-8,
                                  fused=device_type != "meta")
        if not muon:
            return adamw
        qkv = [block.attn.c_attn.weight for block in blocks]
        lr_scale = config.muon_lr / config.max_lr if config.max_lr else 0.0
        groups = [{"params": [p for p in muon if any(p is q for q in qkv) == (splits == 3)],
                   "splits": splits, "lr_scale": lr_scale} for splits in (1, 3)]
        return Chain(adamw, Muon(groups, lr=config.muon_lr))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, generator, temperature=1.0, top_k=50):
        """Samples max_new_tokens after idx (B, T), yielding each new token (B, 1) as it is drawn:
        softmax(logits / temperature) cut to the top_k most likely tokens (all when top_k is 0 or
        above vocab_size), as nanoGPT's sample.py, from the last block_size tokens. One prefill,
        then a token at a time through a KVCache; once the context outgrows block_size each token
        recomputes the shifted window (learned positions), as running the whole window would."""
        top_k = min(top_k or self.config.vocab_size, self.config.vocab_size)
        temperature = max(temperature, torch.finfo(torch.float32).tiny)  # not 0 in float32
        block_size = self.config.block_size
        idx = idx[:, -block_size:]
        cache = KVCache(self.config.n_layer, min(block_size, idx.size(1) + max_new_tokens))
        x = idx  # what the next forward runs: the window, or the newest token
        for _ in range(max_new_tokens):
            logits, _ = self(x, cache=cache)  # (B, 1, vocab_size)
            logits = logits[:, -1, :].float()
            # the top logit made 0 first, so a tiny temperature gives one-hot probs, not inf / inf
            probs = F.softmax((logits - logits.max(-1, keepdim=True).values) / temperature, dim=-1)
            topk_probs, topk_idx = torch.topk(probs, top_k, dim=-1)  # (B, top_k)
            choice = torch.multinomial(topk_probs, 1, generator=generator)  # (B, 1)
            token = torch.gather(topk_idx, -1, choice)
            yield token
            idx = torch.cat((idx, token), dim=1)[:, -block_size:]
            if cache.pos < block_size:
                x = token
            else:  # the window slides
                cache.pos = 0
                x = idx

    @classmethod
    def from_pretrained(cls, source, device="cpu"):
        """A GPT in eval mode on `device` from `source`, as gpt2_weights.load_weights reads it: a
        checkpoint or out_dir of ours, a Hugging Face GPT-2 directory, or a hub name (gpt2...).
        Built on the meta device, it holds the loaded tensors themselves, views of the memory-mapped
        file on the CPU, and draws no random init. Raises UserError for a source that is none of
        these or cannot be read."""
        shape, state = gpt2_weights.load_weights(source)
        model = meta_model(Config(**shape), cls)
        gpt2_weights.check_weights(state, model.state_dict(), source)
        return model.assign_state_dict(state).to(device).eval()

    def assign_state_dict(self, state):
        """Loads the state dict `state` by taking its tensors as the parameters (load_state_dict
        with assign=True): no copy, so a model built on the meta device gets its weights without
        the random init they would replace, as transformers loads. The parameters that __init__
        ties (wte and lm_head) are tied again. Returns self. Raises RuntimeError, as load_state_dict,
        for keys or shapes that differ."""
        names = {}  # each parameter's names, as assign=True gives every name a Parameter of its own
        for name, param in self.named_parameters(remove_duplicate=False):
            names.setdefault(param, []).append(name)
        self.load_state_dict(state, assign=True)
        for first, *tied in names.values():
            for name in tied:
                module, _, leaf = name.rpartition(".")
                setattr(self.get_submodule(module), leaf, self.get_parameter(first))
        return self


def init_from(config, weights=True):
    """(config with init_from's model shape, its state dict): (config, None) for scratch, and no
    state dict without `weights`: a run that resumes takes its shape (and later its weights) from its
    own out_dir's checkpoint. Model keys left at their defaults take the checkpoint's values; raises
    UserError for one set otherwise, or for seq_len > block_size."""
    if config.init_from == "scratch":
        return config, None
    if weights:
        shape, state = gpt2_weights.load_weights(config.init_from)
    else:  # whatever init_from names now, or if it is gone
        log(f"init_from={config.init_from} is not used on a resume: {config.out_dir}'s checkpoint holds "
            f"the model")
        saved, state = checkpoints.newest_config(config.out_dir), None
        shape = {k: saved[k] for k in MODEL_KEYS if k in saved}
    defaults = Config()
    conflicts = [f"{k}={getattr(config, k)} (the checkpoint has {v})" for k, v in shape.items()
                 if getattr(config, k) not in (v, getattr(defaults, k))]
    if conflicts:
        raise UserError(f"init_from={config.init_from} fixes the model's shape, but this run sets "
                        f"{', '.join(conflicts)}: drop those keys from the config")
    config = dataclasses.replace(config, **shape)
    if config.seq_len > config.block_size:
        raise UserError(f"seq_len={config.seq_len} exceeds init_from={config.init_from}'s "
                        f"block_size={config.block_size}: pass --seq_len={config.block_size}")
    if state is not None:
        gpt2_weights.check_weights(state, meta_model(config).state_dict(), config.init_from)
        log(f"init_from {config.init_from}: {config.n_layer} layers, n_embd {config.n_embd}")
    return config, state


def meta_model(config, cls=None):
    """cls(config), GPT(config) by default, on the meta device: its names and shapes, without memory
    or initial values."""
    # on the meta device nn.Embedding's own init (normal_) imports torch._dynamo, which is slow to import
    with torch.device("meta"), mock.patch.object(nn.Embedding, "reset_parameters"):
        return (cls or GPT)(config)


def memory_counts(config):
    """memory_plan.count() of config's GPT and optimizer, built on the meta device, and "activations",
    memory_plan.activation_bytes() of its GPT."""
    model = meta_model(config)
    counts = memory_plan.count(model, model.configure_optimizers(config, "meta"))
    return counts | {"activations": memory_plan.activation_bytes(lambda: GPT(config), config)}


def build_model(config, device, pretrained_state=None):
    """GPT(config) on `device`, initialized from config.seed (the same weights on every rank), or
    built on the meta device to hold contiguous copies of pretrained_state, with no random init."""
    torch.manual_seed(config.seed)
    if pretrained_state is None:
        model = GPT(config).to(device)
    else:  # training writes the weights: contiguous copies on the device, not views of a file
        state = {k: v.to(device, memory_format=torch.contiguous_format, copy=True)
                 for k, v in pretrained_state.items()}
        model = meta_model(config).assign_state_dict(state)
    if config.compile and config.dropout > 0:
        # compiled dropout draws other masks than eager unless it falls back to eager's RNG
        torch._inductor.config.fallback_random = True
    return model


# -----------------------------------------------------------------------------
# Data: token shards, micro-batches numbered globally across ranks

def identity(st):
    """What tells a shard's file from another or a rewrite of it: (inode, size, mtime) of os.stat's."""
    return st.st_ino, st.st_size, st.st_mtime_ns


class DataLoader:
    """Yields (x, y) micro-batches of shape (B, T), int64, on `device`, from one split's shards.
    The shards of a split, in name order, form one token stream. In the sequential order, global
    micro-batch g covers tokens [g*B*T, g*B*T + B*T + 1) of it, wrapping at the end of an epoch. In
    the shuffled order, it is rows g*B .. g*B + B - 1 of T + 1 tokens packed from the documents
    (shards.DocumentRows), row r being row r % N of epoch r // N's permutation of the N rows, drawn
    from (seed, epoch) alone. Each next_batch advances every rank by world_size
    micro-batches and rank r gets g + r, so the data each step sees does not depend on world_size.
    Each read checks that its shard is the file it was at the start (inode, size, mtime);
    `changed` names one that is not."""

    def __init__(self, data_dir, split, B, T, rank, world_size, device, dataset="", order="sequential",
                 seed=0):
        self.B, self.T, self.rank, self.world_size, self.device = B, T, rank, world_size, device
        self.paths = split_paths(data_dir, split, dataset)
        sizes = [read_shard_header(p) for p in self.paths]
        self.files, self.opened, self.changed = [identity(os.stat(p)) for p in self.paths], {}, None
        self.starts = np.cumsum([0] + sizes)  # stream offset of each shard's first token
        self.batches_per_epoch = (int(self.starts[-1]) - 1) // (B * T)
        if self.batches_per_epoch == 0:
            raise UserError(f"{split} split in {data_dir} has {self.starts[-1]} tokens, fewer than "
                             f"one micro-batch of B*T+1 = {B * T + 1}; lower micro_batch_size or seq_len")
        self.order = order
        self.rows = DocumentRows(self.paths, sizes, T + 1, EOT_TOKEN, derived_seed(seed, "data_order"),
                                 f"{split} split in {data_dir}") if order == "shuffled" else None
        self.batch_index = 0  # global micro-batches consumed so far, the same on every rank
        self.ahead = None  # (batch_index, micro-batch) that prefetch() read

    def read(self, starts, n):
        """Tokens [s, s + n) of the stream for each s of `starts`, crossing shard boundaries, as a
        (len(starts), n) uint16 array, each row read with one preadv (per shard it crosses), so nothing
        stays memory-mapped (nanoGPT #287), once its shard is seen to be the file it was at the start:
        its open file when opened, its path once a call. One that is not (replaced, rewritten, cut
        short, gone or unreadable) gives zeros, and `changed` names it."""
        out, checked, bounds = np.zeros((len(starts), n), dtype="<u2"), {}, self.starts.tolist()
        shards = (np.searchsorted(self.starts, starts, side="right") - 1).tolist()
        for row, start, i in zip(out, np.asarray(starts).tolist(), shards):
            done = 0
            while done < n:
                i += start + done == bounds[i + 1]  # the row goes on in the next shard
                take = min(n - done, bounds[i + 1] - start - done)
                try:
                    if i not in checked:
                        f = self.opened.get(i) or open(self.paths[i], "rb", buffering=0)
                        now = [os.stat(self.paths[i])] + ([] if i in self.opened else [os.fstat(f.fileno())])
                        if any(identity(st) != self.files[i] for st in now):
                            raise OSError(errno.ESTALE, "replaced or rewritten")
                        self.opened[i] = checked[i] = f
                    if pread_tokens(checked[i], start + done - bounds[i], row[done:done + take]) < take:
                        raise OSError(errno.EIO, "cut short")
                except OSError as e:  # every rank learns of it from the step's all-reduce
                    row[done:done + take] = 0  # a short read leaves what it read there
                    self.changed = self.changed or (
                        f"shard {self.paths[i]} changed while this run read it ({e.strerror}): the run "
                        f"stopped at its last step, saved, untrained on the change; restore the shard and "
                        f"rerun to resume, or rerun with --allow_new_data=true to go on in the new shards")
                done += take
        return out

    def raise_changed(self):
        """Raises UserError saying which shard changed, if one did."""
        if self.changed:
            raise UserError(self.changed)

    def next_batch(self):
        """This rank's next micro-batch: global micro-batch batch_index + rank."""
        ahead, self.ahead = self.ahead, None
        x, y = ahead[1] if ahead and ahead[0] == self.batch_index else self.get_batch(
            self.batch_index + self.rank)
        self.batch_index += self.world_size
        return x, y

    def prefetch(self):
        """Reads the micro-batch next_batch() gives next and queues its copy to the device now, leaving
        the position (batch_index, which checkpoints save) where it is."""
        self.ahead = self.batch_index, self.get_batch(self.batch_index + self.rank)

    def get_batch(self, g):
        """Global micro-batch g (wrapping at the end of the epoch) as (x, y)."""
        B, T = self.B, self.T
        if self.order == "shuffled":
            buf = self.read(self.rows.starts(g * B, B), T + 1)
            x, y = (torch.from_numpy(buf[:, i:i + T].astype(np.int64)) for i in (0, 1))
        else:
            buf = self.read([g % self.batches_per_epoch * B * T], B * T + 1)[0].astype(np.int64)
            x, y = torch.from_numpy(buf[:-1]).view(B, T), torch.from_numpy(buf[1:]).view(B, T)
        if self.device.type == "cuda":  # pinned memory lets the copy overlap the GPU's work
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(
                self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self):
        """The position in the stream, in tokens, the [name, tokens] of each shard it counts in and
        the order, with the shuffled order's epoch and row in it: a run resumed with another
        micro_batch_size (same seq_len) reads the same sequences in each step."""
        rows = self.batch_index * self.B
        epoch = {} if self.rows is None else {"epoch": rows // len(self.rows), "row": rows % len(self.rows),
                                              "packing": DocumentRows.PACKING}
        return {"tokens": rows * self.T, "data_order": self.order, **epoch,
                "shards": [[p.name, int(n)] for p, n in zip(self.paths, np.diff(self.starts))]}

    def load_state_dict(self, state):
        tokens = state["tokens"]
        if tokens % (self.B * self.T):
            raise UserError(f"the checkpoint's loader stopped at token {tokens}, not a whole number "
                            f"of this run's micro-batches of {self.B}*{self.T} tokens: resume with "
                            f"the checkpoint's seq_len and total_batch_size")
        self.batch_index = tokens // (self.B * self.T)


# -----------------------------------------------------------------------------
# Distributed setup: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; plain python runs one process

def setup_distributed(config):
    """Chooses the device and joins the process group of torchrun's workers (gloo on CPU, NCCL on
    CUDA); a plain python run of zero2 or fsdp, which need collectives, gets a group of one.
    Returns (rank, world_size, device). Raises UserError for a device this machine lacks, a bad
    launch (collectives.torchrun_env) or a peer that does not join within collective_timeout_s."""
    launched, rank, local_rank, world_size = torchrun_env()
    device = choose_device(config, local_rank, launched)
    if config.grad_compression == "bf16" and launched and device.type != "cuda":
        raise UserError("grad_compression=bf16 needs NCCL (CUDA devices); gloo cannot reduce bf16: "
                        "use grad_compression=none on CPU")
    if config.exact_reduction:
        make_deterministic(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later
    if device.type == "cpu":
        keep_freed_cpu_memory()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.collective_timeout_s)
    if launched:
        store = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # restarted workers would read the dead ones' keys in torchrun's store (pytorch#135712);
            # the count is per node: restarts across nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
            store = dist.PrefixStore(
                f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}",
                dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timeout))
        elif rank > 0:
            wait_for_master(config.collective_timeout_s)
        try:
            init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                               device_id=device if device.type == "cuda" else None)
        except dist.DistError as e:  # a peer that never joined, or an unreachable MASTER_ADDR
            raise UserError(f"rank {rank} could not join the process group within collective_timeout_s="
                            f"{config.collective_timeout_s} s ({str(e).splitlines()[0]}): start every "
                            f"rank, check MASTER_ADDR and MASTER_PORT") from None
    elif config.sharding != "ddp":
        init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return rank, world_size, device


# -----------------------------------------------------------------------------
# What the loop calls: batch arithmetic, out_dir, resume, schedule, evaluation, sampling, saving


def grad_accum_steps(config, world_size):
    """Micro-steps per optimizer step on each rank: total_batch_size / (B * T * world_size).
    Raises UserError unless that is a whole number."""
    B, T = config.micro_batch_size, config.seq_len
    if config.total_batch_size % (B * T * world_size):
        raise UserError(
            f"total_batch_size={config.total_batch_size} is not divisible by micro_batch_size * "
            f"seq_len * world_size = {B}*{T}*{world_size} = {B * T * world_size}; change "
            f"total_batch_size or micro_batch_size")
    return config.total_batch_size // (B * T * world_size)


def sample_prompt(config):
    """config.sample_prompt's GPT-2 tokens; an empty prompt starts from <|endoftext|>, as GPT-2's
    unconditional samples. Raises UserError for a token the model's vocab_size lacks."""
    prompt = gpt2_encoding().encode_ordinary(config.sample_prompt) or [EOT_TOKEN]
    if config.sample_interval > 0 and max(prompt) >= config.vocab_size:
        raise UserError(f"sample_prompt {config.sample_prompt!r} has GPT-2 token id {max(prompt)}, "
                        f"beyond vocab_size={config.vocab_size}: pick another prompt, or pass "
                        f"--sample_interval=0")
    return prompt


def make_loaders(config, rank, world_size, device):
    """(config, train DataLoader, {log key: val DataLoader}), every shard's token ids known to fit
    vocab_size. The val split is read in order (val_loss) and, in a shuffled run, also in rows as its
    training reads (val_loss_rows). A val_batches beyond what either holds is lowered to it, with a
    line saying so, as is the run's length in epochs (of rows in a shuffled run, with the shares of
    the train tokens an epoch reads and reads twice, and a warning below half). Raises UserError on
    every rank (a data_dir missing on one node stops all at once), and for a shard that holds a
    token id the embedding lacks (another tokenizer's shards) before the first step, not mid-run on
    the one rank that read it. A collective."""
    shuffled = config.data_order == "shuffled"  # its runs are also evaluated on val rows, as they train
    loaders = agreed(lambda: [
        DataLoader(config.data_dir, split, config.micro_batch_size, config.seq_len, rank, world_size,
                   device, config.dataset, order, config.seed)
        for split, order in [("train", config.data_order), ("val", "sequential"), ("val", "shuffled")][
            :2 + shuffled]])
    # an evaluation that wrapped would count batches twice
    fits = min(v.batches_per_epoch if v.rows is None else len(v.rows) // v.B for v in loaders[1:])
    if config.eval_interval > 0 and config.val_batches > fits:
        log(f"val_batches={config.val_batches} is more than the val split holds: evaluating on all "
            f"{fits} micro-batches")
        config = dataclasses.replace(config, val_batches=fits)
    tokens, train_tokens = config.max_steps * config.total_batch_size, int(loaders[0].starts[-1])
    rows = loaders[0].rows
    epoch = f"{tokens / train_tokens:.1f} epochs of the {train_tokens:,} train tokens"
    if shuffled:
        epoch = (f"{tokens / len(rows) / config.seq_len:.1f} epochs of {len(rows):,} rows, each epoch "
                 f"reading {rows.reads / train_tokens:.1%} of the {train_tokens:,} train tokens "
                 f"({rows.twice / train_tokens:.1%} twice)")
    log(f"max_steps={config.max_steps} x {config.total_batch_size} tokens a step = {tokens:,} tokens: "
        f"{epoch}")
    if shuffled and rows.reads < train_tokens / 2:
        log(f"warning: data_order=shuffled leaves most train tokens unread: its rows must each fit in "
            f"a shard, and these shards are short for seq_len+1; pass --data_order=sequential")
    paths = [path for loader in loaders[:2] for path in loader.paths]  # both splits in one scan
    check_token_ids(paths, config.vocab_size, Path(config.out_dir) / "token_ids.json", rank,
                    world_size, lambda values: all_reduce_max(values, device))
    return config, loaders[0], dict(zip(("val_loss", "val_loss_rows"), loaders[1:]))


def resume(config, raw_model, optimizer, scaler, train_loader, out, existing):
    """Loads out_dir's newest checkpoint (checkpoints.load_newest) into the model, optimizer, loss
    scaler (unless the dtype changed: a line says so) and train loader, and starts out_dir's log at
    its step (OutDir.start: with overwrite, the old checkpoints and log stay until this run's first
    checkpoint). No RNG state is needed: every random draw after init is seeded from (seed, step).
    Returns (the step resumed at, whether its evaluations ran before it was saved): (0, False) for a
    fresh start; (None, None), with a line saying so, when the run is complete. Raises UserError, on
    every rank and before anything loads, for a checkpoint of another format (load_newest), model
    (its state's keys and shapes), optimizer or data_order. A collective."""
    path, ckpt = checkpoints.load_newest(config.out_dir, log) if config.resume == "auto" else (None, None)
    if path is not None:
        new_run = f"start a new run from its weights with --out_dir=NEW_DIR --init_from={config.out_dir}"
        saved, groups = ckpt["config"], [len(g["params"]) for g in ckpt["optimizer"]["param_groups"]]
        diff = [f"{k}={saved[k]} in the checkpoint, {getattr(config, k)} in this run"
                for k in MODEL_KEYS if saved[k] != getattr(config, k)]
        expected = meta_model(config).state_dict()
        problems = ", ".join(diff) or gpt2_weights.state_mismatch(ckpt["model"], expected)
        if problems:
            raise UserError(f"checkpoint {path} is of another model: {problems}; to train this model, "
                            f"start a new run with --out_dir=NEW_DIR, or start over in {config.out_dir} "
                            f"with --resume=never --overwrite=true (deletes its checkpoints)")
        if saved["optimizer"] != config.optimizer or groups != [
                len(g["params"]) for g in optimizer.param_groups]:
            raise UserError(f"checkpoint {path} was trained with optimizer={saved['optimizer']} and "
                            f"parameter groups of {groups} tensors, which this run's optimizer cannot "
                            f"continue: keep its optimizer, or {new_run}")
        if saved["data_order"] != config.data_order or (  # the shuffled order's rows depend on seq_len
                config.data_order == "shuffled" and saved["seq_len"] != config.seq_len):
            raise UserError(f"checkpoint {path} read its data in data_order={saved['data_order']} at "
                            f"seq_len={saved['seq_len']}: resume with --data_order={saved['data_order']} "
                            f"--seq_len={saved['seq_len']}, or {new_run}")
        if config.data_order == "shuffled" and ckpt["loader"].get("packing") != DocumentRows.PACKING:
            raise UserError(f"checkpoint {path} read rows packed the way of an older version of this "
                            f"repository, not packing {DocumentRows.PACKING}'s: {new_run}")
        then, now = ckpt["loader"]["shards"], train_loader.state_dict()["shards"]
        if then != now and not config.allow_new_data:  # the saved position would point elsewhere
            was, is_now = next((a, b) for a, b in zip(then + [None], now + [None]) if a != b)
            raise UserError(f"the train shards in {config.data_dir} are not those checkpoint {path} "
                            f"was trained on (as [name, tokens]: {was} then, {is_now} now): "
                            f"{new_run}, or pass --allow_new_data=true to go on at the same token "
                            f"offset in these")
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])  # after the weights: zero2 slices them
        train_loader.load_state_dict(ckpt["loader"])
        if saved["dtype"] == config.dtype:
            scaler.load_state_dict(ckpt["scaler"])  # float16's scale goes on; the others have none
        else:
            log(f"the dtype changes from the checkpoint's {saved['dtype']} to {config.dtype}"
                + ("; the loss scaler starts anew" if config.dtype == "float16" else ""))
        log(f"resumed from {path} at step {ckpt['step']}")
    start_step, evaluated = (ckpt["step"], ckpt["evaluated"]) if path else (0, False)
    if start_step >= config.max_steps:
        log(f"the run in {config.out_dir} is complete: step {start_step} of max_steps="
            f"{config.max_steps}. Raise --max_steps to train on, or start over with --resume=never "
            f"--overwrite=true or another --out_dir")
        return None, None
    note_schedule(config, ckpt["config"] if path else None, start_step)
    agreed(lambda: out.start(start_step, path, existing if config.resume == "never" else []),
           master_only=True)
    return start_step, evaluated


def get_lr(step, config):
    """Linear warmup to max_lr, then cosine decay to min_lr at max_steps (GPT-3 paper, B.1)."""
    if step < config.warmup_steps:
        return config.max_lr * (step + 1) / config.warmup_steps
    if step >= config.max_steps:
        return config.min_lr
    ratio = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (config.max_lr - config.min_lr)


SCHEDULE_KEYS = ("max_steps", "warmup_steps", "max_lr", "min_lr", "muon_lr")


def note_schedule(config, saved, step):
    """Logs a warning when warmup does not end before max_steps, and on a resume (`saved`: the
    checkpoint's config) one line naming the schedule keys that change and the next lr before and
    after, since get_lr() reshapes the whole schedule from them."""
    if config.warmup_steps >= config.max_steps:
        log(f"warning: warmup_steps={config.warmup_steps} is not below max_steps={config.max_steps}, "
            f"so the lr never decays; lower --warmup_steps")
    changed = [k for k in SCHEDULE_KEYS if saved and saved[k] != getattr(config, k)]
    if changed:
        before, now = (f"{get_lr(step, c):.4e}" for c in (
            dataclasses.replace(config, **{k: saved[k] for k in changed}), config))
        log("the schedule changes from the checkpoint's: "
            + ", ".join(f"{k} {saved[k]} -> {getattr(config, k)}" for k in changed)
            + f"; the lr of step {step + 1} is {now}"
            + (f", not {before}" if now != before else ", as before; later steps follow the new schedule"))


def every(interval, step, config):
    """Whether an action of this interval runs at `step` (the updates done): 0 turns it off, the
    last step (max_steps) runs it."""
    return interval > 0 and (step % interval == 0 or step == config.max_steps)


def evaluate(model, val_loader, val_batches, autocast, sum_dtype, check_stop=None):
    """Mean loss over the first val_batches micro-batches of the val split, whatever world_size:
    micro-batch g on rank g % world_size, the sums all-reduced. A collective. check_stop() runs
    before each micro-batch (StopSignals.check raises Stopped); Stopped after a val shard changed."""
    rank, world_size, device = val_loader.rank, val_loader.world_size, val_loader.device
    model.eval()
    total = torch.zeros(3, device=device, dtype=sum_dtype)  # sum of losses, batches, shards changed
    # every rank runs as many batches (FSDP's all-gathers pair up); those past val_batches weigh 0
    batches = range(rank, math.ceil(val_batches / world_size) * world_size, world_size)
    with torch.no_grad(), Waiting(f"the val loss of {val_batches} micro-batches"):
        for g in tqdm(batches, "val loss", leave=False, disable=rank > 0 or None):  # rank 0's terminal
            if check_stop:
                check_stop()
            x, y = val_loader.get_batch(g)
            with autocast:
                _, loss = model(x, y)
            weight = torch.tensor(float(g < val_batches), device=device, dtype=sum_dtype)
            total[:2] += torch.stack([loss.to(sum_dtype) * weight, weight])
    total[2] = val_loader.changed is not None
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    if total[2] > 0:  # every rank stops; val_loader.raise_changed names the shard
        raise Stopped
    return (total[0] / total[1]).float().item()


def save_checkpoint(out, step, raw_model, optimizer, scaler, config, train_loader, evaluated):
    """Saves the checkpoint of `step` (OutDir.save) and returns its step. A collective: the sharded
    swap-ins gather whole tensors, and every rank stops if the save fails."""
    state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict(), "config": dataclasses.asdict(config), "step": step,
             "loader": train_loader.state_dict(), "evaluated": evaluated}
    path = agreed(lambda: out.save(step, state, config.keep_checkpoints), master_only=True)
    log(f"saved {path}")
    return step


def derived_seed(*parts):
    """A 63-bit seed that depends on `parts` alone (e.g. seed, step, micro-batch)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


MAX_SKIPPED_STEPS = 3  # updates skipped for a non-finite loss or gradient, in a row, end the run

# -----------------------------------------------------------------------------
# Data parallelism: DDP, or a swap-in for it


def parallelize(raw_model, config, device):
    """(model, optimizer, clip_grad_norm_): raw_model compiled and wrapped in DDP under torchrun,
    its optimizer and torch's clipping; or for zero2, fsdp or exact_reduction the swap-ins of
    gpt2_ddp/data_parallel.py, which present DDP's and torch.optim's interfaces and clip by their
    own norm where torch's would be wrong (sliced gradients, float64 sums)."""
    optimizer = raw_model.configure_optimizers(config, device.type)
    if config.compile:
        log("torch.compile: the first step waits while the model compiles")
    if config.sharding != "ddp" or config.exact_reduction:
        model, optimizer = data_parallel.wrap(raw_model, optimizer, config, device)
        return model, optimizer, model.clip_grad_norm_
    model = torch.compile(raw_model) if config.compile and not config.compile_ddp else raw_model
    if dist.is_initialized():  # launched by torchrun
        model = DDP(model, device_ids=[device] if device.type == "cuda" else None,
                    bucket_cap_mb=config.bucket_cap_mb,
                    gradient_as_bucket_view=config.gradient_as_bucket_view)
        if config.grad_compression == "bf16":
            model.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
    if config.compile and config.compile_ddp:  # DDPOptimizer splits the graph at the buckets
        model = torch.compile(model)
    return model, optimizer, torch.nn.utils.clip_grad_norm_


def update(optimizer, scaler, clip_grad_norm_, raw_model, lr, config, loss_and_flags, micro_batches):
    """Queues the step's update, reading nothing on the host: lr set, the gradient unscaled (float16)
    and clipped, the optimizer stepped unless the loss or the gradient norm is not finite or a rank
    met a changed shard, and the loss scaler updated. loss_and_flags: the all-reduced (loss sum,
    stops, changes, then the sum of each of a fork's extra_metrics). Returns (mean loss, stops, norm,
    changes, loss scale, then each extra metric's mean over the micro-batches) as one float32 tensor,
    for the step's one host read."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]
    scaler.unscale_(optimizer)  # clipping sees the unscaled gradient
    norm = clip_grad_norm_(raw_model.parameters(), config.grad_clip)
    loss_sum, stops, changes = loss_and_flags[:3]
    loss = loss_sum / micro_batches
    precision.step_unless(optimizer, ~(torch.isfinite(loss) & torch.isfinite(norm)) | (changes > 0))
    scaler.update()  # halves the scale after an overflow, doubles it after 2000 clean steps
    return torch.cat([torch.stack([loss, stops, norm, changes, precision.scale(scaler, norm.device)]),
                      loss_and_flags[3:] / micro_batches]).float()


# -----------------------------------------------------------------------------
# Training


def train(config, rank, world_size, device):
    """Trains `config` on this rank of world_size, a collective from start to end. Returns the exit
    code: 0, or 128 + the signal that stopped it. Raises UserError, on every rank."""
    grad_accum = grad_accum_steps(config, world_size)
    micro_batches_per_step = grad_accum * world_size
    log(f"world_size {world_size} | device {device} | total batch {config.total_batch_size} tokens = "
        f"{config.micro_batch_size} x {config.seq_len} x {world_size} x {grad_accum} grad accum steps")
    config, why = agreed(lambda: precision.resolve(config, device))  # auto no more
    log(why)
    # the gradients sum to the step's mean: DDP averages over ranks, exact_reduction sums in float64
    loss_divisor = micro_batches_per_step if config.exact_reduction else grad_accum
    sum_dtype = torch.float64 if config.exact_reduction else torch.float32
    out, existing = checkpoints.open_out_dir(config)
    # a run that will resume takes its weights from its checkpoint: GPT-2's shape is enough
    config, pretrained_state = agreed(lambda: init_from(config, config.resume == "never" or not existing))
    # rank 0 alone traces the plan, for ranks on alike devices; its refusal stops every rank
    log(agreed(lambda: memory_plan.checked_summary(config, world_size, device, memory_counts(config)),
               master_only=True))
    prompt = sample_prompt(config)
    hellaswag_examples = agreed(lambda: hellaswag.examples_for_training(config))
    config, train_loader, val_loaders = make_loaders(config, rank, world_size, device)

    autocast = precision.autocast(config.dtype, device)
    log(choose_attention(config, device, precision.DTYPES[config.dtype]))
    scaler = precision.grad_scaler(config.dtype, config.sharding, device)  # off but for float16
    raw_model = build_model(config, device, pretrained_state)
    model, optimizer, clip_grad_norm_ = parallelize(raw_model, config, device)
    start_step, evaluated = resume(config, raw_model, optimizer, scaler, train_loader, out, existing)
    if start_step is None:  # the run is complete
        return 0
    metrics = Metrics(out if rank == 0 else None, config, rank, world_size, device, raw_model, start_step)

    # -------------------------------------------------------------------------
    # Training loop
    skipped, last_saved = 0, start_step  # updates skipped in a row; out_dir's newest checkpoint, or 0
    stop, stop_signals = False, catch_stop_signals(device)
    flags = torch.zeros(2, device=device, dtype=sum_dtype)  # a stop signal, a shard that changed
    for step in range(start_step, config.max_steps + 1):  # step: the optimizer updates done
        last_step = step == config.max_steps
        # a stop leaves the evaluations to the run that resumes, unless it is the last step
        measure = (not stop or last_step) and (step > start_step or not evaluated)
        try:
            if measure and every(config.eval_interval, step, config):
                val = {key: evaluate(raw_model, loader, config.val_batches, autocast, sum_dtype,
                                     stop_signals.check) for key, loader in val_loaders.items()}
                metrics.evaluation(step, val, " | ".join(f"{key.replace('_', ' ')} {v:.4f}"
                                                         for key, v in val.items()))
            if measure and every(config.hellaswag_interval, step, config):
                result = hellaswag.evaluate(raw_model, hellaswag_examples, device, rank, world_size,
                                            autocast, stop_signals.check)
                raw_model.train()
                metrics.evaluation(step, result, hellaswag.summary(result))
            if measure and every(config.sample_interval, step, config) and step > 0:
                text = training_sample(raw_model, prompt, config.sample_tokens, derived_seed(
                    config.seed, "sample", step), device, autocast, stop_signals.check)
                log(f"sample at step {step}: {text!r}")
        except Stopped:  # the checkpoint says this step's evaluations did not run
            stop, measure = True, False
        # a stop and the last step always save (a skipped update left the weights as they were);
        # the interval does not in a run of skipped updates, which may be a divergence
        if step > start_step and (stop or last_step or (
                not skipped and every(config.checkpoint_interval, step, config))):
            last_saved = save_checkpoint(out, step, raw_model, optimizer, scaler, config, train_loader,
                                         measure)
        if stop:
            agreed(lambda: [v.raise_changed() for v in val_loaders.values()])  # a val shard may have changed
            log(stopped_line(stop_signals.first(), step, start_step))
        if stop or last_step:
            break

        t0 = metrics.step_begins()
        optimizer.zero_grad(set_to_none=True)
        loss_accum, extras = torch.zeros((), device=device, dtype=sum_dtype), {}
        for micro_step in range(grad_accum):
            last_micro_step = micro_step == grad_accum - 1
            with record_function("data"):
                x, y = train_loader.next_batch()
            # sync on the last micro-step only; DDP reads the flag in its forward too (build-nanogpt #30)
            model.require_backward_grad_sync = last_micro_step
            m = micro_step * world_size + rank  # this micro-batch's number within the step
            # dropout masks depend on (seed, step, m) alone, so on no world size
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    record_function("forward_backward_sync" if last_micro_step else "forward_backward"):
                torch.manual_seed(derived_seed(config.seed, step, m))
                with autocast, record_function("forward"):
                    _, loss = model(x, y)
                loss_accum += loss.detach()
                # a fork's own scalars (0-d tensors its forward puts in extra_metrics), summed as the loss
                extras = {k: v.detach().to(sum_dtype) + extras.get(k, 0)
                          for k, v in getattr(raw_model, "extra_metrics", {}).items()}
                loss = loss / loss_divisor
                with record_function("backward"):
                    scaler.scale(loss).backward()
        # the loss summed over ranks, and how many ranks were asked to stop or met a changed shard,
        # in one all-reduce (setting an element takes the host's value without a sync)
        flags[0], flags[1] = len(stop_signals), train_loader.changed is not None
        loss_and_flags = torch.cat([loss_accum[None], flags, *(v[None] for v in extras.values())])
        if dist.is_initialized():
            dist.all_reduce(loss_and_flags, op=dist.ReduceOp.SUM)
        lr = get_lr(step, config)
        with record_function("optimizer"):
            results = update(optimizer, scaler, clip_grad_norm_, raw_model, lr, config, loss_and_flags,
                             micro_batches_per_step)
        if step + 1 < config.max_steps:  # the next step's first micro-batch, read while the GPU works
            train_loader.prefetch()
        loss_value, stops, norm, changes, loss_scale, *extra_values = results.tolist()  # the one host read
        # no rank updated: each saves the weights of `step`, which no changed token reached (float16's
        # loss scaler has counted the step)
        if changes:
            train_loader.batch_index -= micro_batches_per_step
            save_checkpoint(out, step, raw_model, optimizer, scaler, config, train_loader, measure)
            agreed(train_loader.raise_changed)
        finite = math.isfinite(loss_value) and math.isfinite(norm)
        # float16's overflows are normal, the scaler's to handle; a non-finite loss is not
        overflow = precision.overflowed(scaler, loss_value, norm, loss_scale)
        skipped = 0 if finite else skipped + (not overflow)
        metrics.train_step(step + 1, loss_value, lr, norm, t0, optimizer,
                           loss_scale if scaler.is_enabled() else None, not finite, overflow,
                           dict(zip(extras, extra_values)))
        if skipped == MAX_SKIPPED_STEPS:  # every rank sees the same all-reduced values
            raise precision.diverged(step + 1, skipped, loss_value, norm, last_saved, config)
        stop = stops > 0
    metrics.close()
    if dist.is_initialized():
        dist.barrier()  # gloo aborts a rank that tears down while rank 0 still saves
    return 128 + stop_signals.first() if stop else 0  # the shell's code for "ended by that signal"


def main(argv):
    """Sets up the device and process group from torchrun's variables, runs train() and tears the
    group down; returns the exit code (non-zero when a signal stopped the run)."""
    check_torch_version()
    config = load_config(argv)
    rank, world_size, device = setup_distributed(config)
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        return train(config, rank, world_size, device)
    except RuntimeError as e:  # a peer gone, or no C++ compiler for torch.compile: one line, not a bug
        raise machine_failure(e, rank, world_size, config.collective_timeout_s) or e
    finally:
        # the loop's handlers end with it: a process that goes on after main() (a test) would
        # ignore its first SIGTERM, and so would the workers it forks
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if dist.is_initialized():
            gc.collect()  # gloo aborts at exit if its work objects, in reference cycles, outlive the group
            destroy_process_group()


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        configurator.print_quietly("usage: python train_gpt2.py [CONFIG.toml] [--key=value ...]\n" + __doc__
                                   + "\nConfig keys, their defaults and what they do:\n"
                                   + "\n".join(configurator.help_lines(Config)))
        sys.exit(0)
    # torchrun's summary shows a crash's traceback; the training loop handles Ctrl-C itself
    configurator.run(record(main), "train_gpt2.py", "interrupted before training began; nothing to save")
