"""Memory per rank before anything runs (parameters, gradients, optimizer state, activations) by sharding
mode, for a config, world size and device, and the largest micro-batch that fits (scripts/memory_plan.py).
Activations per layer follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4.1): 34*s*b*h bytes with 16-bit activations, 16 tensors of s*b*h elements
plus two 1-byte dropout masks, less the 5*a*s^2*b attention matrix that flash attention does not store.
Here the two LayerNorm inputs are the float32 residual stream: 14 tensors at the activation width
(2 bytes under bfloat16 or float16 autocast, 4 in float32) and 2 at 4 bytes."""

import dataclasses

import torch
from torch import nn

from gpt2_ddp.configurator import UserError

GB = 2**30


def count(model, optimizer):
    """The plan's counts of a meta-device GPT and its optimizer (stepped once): "params", "param_bytes",
    "optimizer_bytes", and the numels "matmul" (Linear weights), "root" (outside blocks), "block"."""
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    in_blocks = sum(p.numel() for p in model.transformer.h.parameters())
    return {"params": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
            "matmul": sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)),
            "root": sum(p.numel() for p in params) - in_blocks,
            "block": sum(p.numel() for p in model.transformer.h[0].parameters())}


def extra_copies(config, world_size):
    """(parameter, gradient) copies a sharding mode keeps besides the model's own, in units of the
    whole model: zero2's slices of both; DDP's gradient buckets unless gradient_as_bucket_view."""
    if config.sharding == "zero2":
        return 1 / world_size, 1 / world_size
    if config.sharding == "ddp":
        return 0, int(world_size > 1 and not config.gradient_as_bucket_view)
    return 0, 0


def plan(config, world_size, counts):
    """{part: bytes} per rank of a training step of `config` (dtype bfloat16, float16 or float32) on
    `world_size` ranks, `counts` from count(), its last entry "total" their sum. With W = world_size:
      parameters: /W in fsdp, plus zero2's slices, plus in 16 bits the copies kept for the backward
        (autocast's in ddp and zero2; FSDP's all-gathered root and two blocks);
      gradients: as the parameters plus extra_copies; exact_reduction's float64 sums twice that;
      optimizer state: /W in zero2 and fsdp; activations: one micro-batch's; logits: (B, T, vocab)."""
    W, P = world_size, counts["param_bytes"]
    s, b, h = config.seq_len, config.micro_batch_size, config.n_embd
    half = config.dtype != "float32"
    e = 2 if half else 4  # bytes per activation element
    fsdp = config.sharding == "fsdp"
    shard = W if fsdp else 1
    param_copies, grad_copies = extra_copies(config, W)
    parts = {"parameters": P / shard + P * param_copies}
    if half:
        parts["parameters"] += 2 * (counts["root"] + 2 * counts["block"] if fsdp else counts["matmul"])
    parts["gradients"] = P / shard + P * grad_copies + (2 * P / shard if config.exact_reduction else 0)
    parts["optimizer state"] = counts["optimizer_bytes"] / (1 if config.sharding == "ddp" else W)
    sbh = s * b * h
    masks = 2 if config.dropout > 0 else 0
    layer = sbh * (14 * e + 2 * 4 + masks)
    blocks = config.n_layer * layer
    if config.activation_checkpointing:  # the blocks' float32 inputs, and one block recomputed
        blocks = config.n_layer * 4 * sbh + layer
    parts["activations"] = blocks + sbh * (4 + e + (1 if config.dropout > 0 else 0))  # ln_f, drop
    parts["logits"] = s * b * config.vocab_size * ((e + 4 + 4) if half else 8)  # (16-bit), fp32, log-softmax
    parts["total"] = sum(parts.values())
    return parts


def max_micro_batch(config, world_size, counts, memory_bytes, usable=0.9):
    """The largest micro_batch_size whose planned total fits usable * memory_bytes (the rest is for
    the CUDA context, fragmentation and kernel workspaces); 0 if not even one sequence fits."""
    one = plan(dataclasses.replace(config, micro_batch_size=1), world_size, counts)
    per_sequence = one["activations"] + one["logits"]
    room = usable * memory_bytes - (one["total"] - per_sequence)
    return max(0, int(room // per_sequence))


def available_bytes(device):
    """(bytes, words) free on `device`: CUDA's free memory, Linux's MemAvailable + SwapFree, else None."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"{device} has {free / GB:.1f} GB free"
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                kb = {line.split(":")[0]: int(line.split()[1]) for line in f}
        except OSError:
            return None
        available = (kb["MemAvailable"] + kb.get("SwapFree", 0)) * 1024
        return available, f"this machine has {available / GB:.1f} GB available (memory and swap)"
    return None


def checked_summary(config, world_size, device, counts):
    """train_gpt2.py's console line of the plan's parts and total per rank in GB (MB under 1 GB). Raises
    UserError when parameters, gradients and optimizer state exceed available_bytes(device)."""
    parts = plan(config, world_size, counts)
    # refused only on what the optimizer step surely holds: not the activations, nor autocast's
    # 16-bit copies (absent from the float32 plan) or exact_reduction's float64 sums, freed by then
    surely = plan(dataclasses.replace(config, exact_reduction=False, dtype="float32"), world_size, counts)
    held = {part: surely[part] for part in ("parameters", "gradients", "optimizer state")}
    available = available_bytes(device)
    if available is not None and sum(held.values()) > available[0]:
        sizes = ", ".join(f"{part} {size / GB:.1f} GB" for part, size in held.items())
        raise UserError(f"the model needs at least {sum(held.values()) / GB:.1f} GB per rank ({sizes}; "
                        f"memory_plan's total with activations {parts['total'] / GB:.1f} GB) but "
                        f"{available[1]}; lower n_layer, n_embd or vocab_size, or shard it over more "
                        "ranks (--sharding=fsdp)")
    unit, scale = ("GB", GB) if parts["total"] >= GB else ("MB", 2**20)
    sizes = ", ".join(f"{k} {v / scale:.2f} {unit}" for k, v in parts.items())
    return (f"memory plan per rank: {sizes} (micro_batch_size {config.micro_batch_size}, {config.sharding}, "
            f"{config.dtype}, activation checkpointing {'on' if config.activation_checkpointing else 'off'})")
