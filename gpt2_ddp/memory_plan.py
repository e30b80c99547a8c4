"""Memory per rank before anything runs (parameters, gradients, optimizer state, activations) by sharding
mode, for a config, world size and device, and the largest micro-batch that fits (scripts/memory_plan.py).
Parameters, gradients and optimizer state are counted on the model and optimizer as built; activations
are measured on the model itself: the peak of the tensors that its forward and backward keep alive,
run under FakeTensorMode (tensors with shapes and no data) on the CPU's kernels and autocast."""

import dataclasses
import gc
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gpt2_ddp import precision
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
    numel = sum(p.numel() for p in params)
    return {"params": numel,
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
            "matmul": sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)),
            "root": numel - sum(p.numel() for p in model.transformer.h.parameters()),
            "block": sum(p.numel() for p in model.transformer.h[0].parameters())}


class LiveBytes(TorchDispatchMode):
    """`trace`: the bytes that the storages of the tensors made under it hold, after each storage is
    made or freed (a storage lives while any tensor views it)."""

    def __init__(self):
        super().__init__()
        self.views, self.trace = {}, [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key, size = t.untyped_storage()._cdata, t.untyped_storage().nbytes()
                self.count(key, size, 1)
                weakref.finalize(t, self.count, key, size, -1)
        return out

    def count(self, key, size, views):
        self.views[key] = self.views.get(key, 0) + views
        if self.views[key] == (1 if views > 0 else 0):  # its first view made, or its last freed
            self.trace.append(self.trace[-1] + views * size)


def activation_bytes(build, config):
    """Bytes per sequence of seq_len tokens that a training step holds beyond what does not grow with
    the micro-batch (parameters, gradients, autocast's weight copies): one forward and backward of
    build()'s model in train mode and config.dtype's autocast, traced by LiveBytes at micro-batch 2
    and 3 (the same operations), the largest difference. FakeTensorMode runs it on the CPU's kernels
    with no memory or arithmetic; their attention keeps (B, nh, T, T) for dropout > 0, flash does not."""
    def trace(micro_batch_size):
        with FakeTensorMode(), torch.device("cpu"):
            model = build().train()
            idx = torch.zeros(micro_batch_size, config.seq_len, dtype=torch.long)
            with LiveBytes() as live, precision.autocast(config.dtype, torch.device("cpu")):
                _, loss = model(idx, idx)
                loss.backward()
        return live.trace

    gc.disable()  # tensors freed by reference counts alone, at the same operation in both passes
    try:
        traces = [trace(2), trace(3)]  # not 1: a batch of one takes other paths (dropout's, say)
        if len(traces[0]) != len(traces[1]):  # the first pass in a process skips one-time work
            traces[0] = trace(2)
    finally:
        gc.enable()
    if len(traces[0]) != len(traces[1]):  # other operations still: the peaks' difference instead
        return max(traces[1]) - max(traces[0])
    return max(two - one for one, two in zip(*traces))


def plan(config, world_size, counts):
    """{part: bytes} per rank of a training step of `config` (dtype bfloat16, float16 or float32) on
    `world_size` ranks, `counts` from train_gpt2.memory_counts() of a config with the same dtype,
    seq_len, dropout and activation_checkpointing; its last entry "total" their sum. With W = world_size:
      parameters: /W in fsdp, plus zero2's slices, plus in 16 bits the copies kept for the backward
        (autocast's in ddp and zero2; FSDP's all-gathered root and two blocks);
      gradients: as the parameters, plus DDP's buckets (W > 1, unless gradient_as_bucket_view) and
        exact_reduction's float64 sums (twice the float32 gradient, /W in fsdp);
      optimizer state: /W in zero2 and fsdp; activations: one micro-batch's (activation_bytes)."""
    W, P = world_size, counts["param_bytes"]
    fsdp = config.sharding == "fsdp"
    shard = W if fsdp else 1
    slices = P / W if config.sharding == "zero2" else 0  # zero2's, of parameters and of gradients
    buckets = P if config.sharding == "ddp" and W > 1 and not config.gradient_as_bucket_view else 0
    parts = {"parameters": P / shard + slices}
    if config.dtype != "float32":
        parts["parameters"] += 2 * (counts["root"] + 2 * counts["block"] if fsdp else counts["matmul"])
    parts["gradients"] = P / shard + slices + buckets + (2 * P / shard if config.exact_reduction else 0)
    parts["optimizer state"] = counts["optimizer_bytes"] / (1 if config.sharding == "ddp" else W)
    parts["activations"] = config.micro_batch_size * counts["activations"]
    parts["total"] = sum(parts.values())
    return parts


def max_micro_batch(config, world_size, counts, memory_bytes, usable=0.9):
    """The largest micro_batch_size whose planned total fits usable * memory_bytes (the rest is for
    the CUDA context, fragmentation and kernel workspaces); 0 if not even one sequence fits."""
    one = plan(dataclasses.replace(config, micro_batch_size=1), world_size, counts)
    room = usable * memory_bytes - (one["total"] - counts["activations"])
    return max(0, int(room // counts["activations"]))


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
