"""
Memory per rank before anything runs: parameters, gradients, optimizer state and activations, by
sharding mode, for a config, a world size and a device; and the largest micro-batch that fits.
train_gpt2.py prints the plan's total before its first step.

    python memory_plan.py configs/gpt2_1558m.toml --world_size 8 --gpu_memory 80
    python memory_plan.py configs/gpt2_774m.toml --sharding=fsdp --activation_checkpointing=true
    python memory_plan.py configs/shakespeare_cpu.toml --device cpu --world_size 1 --measure

Sources. Activations per transformer layer follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", section 4.1): 34*s*b*h bytes with 16-bit
activations, that is 16 tensors of s*b*h elements plus two 1-byte dropout masks, without the
5*a*s^2*b of the attention matrix, which flash attention does not store. Here the two LayerNorm
inputs are the float32 residual stream (autocast keeps it in float32): 14 tensors at the
activation width (2 bytes under CUDA's bf16 autocast, 4 on CPU) and 2 at 4 bytes. Measured on
CPU (--measure) with torch.autograd.graph.saved_tensors_hooks, the formula is within 1% (dropout 0;
CPU attention with dropout stores the s^2 matrix, which a GPU's flash attention does not).
Parameters, gradients and AdamW's two moments are float32 (4 + 4 + 8 bytes per parameter; Muon
keeps one momentum buffer, 4 bytes, for the matrices it updates), divided by the world size where
the mode shards them (ZeRO, Rajbhandari et al. 2020).
"""

import dataclasses
import math

import configurator
from sharding import SHARDING_MODES

GB = 2**30


def n_params(config):
    """Parameters of train_gpt2.GPT for `config` (the tied wte/lm_head counted once)."""
    h, L = config.n_embd, config.n_layer
    # per block: c_attn, attn.c_proj, c_fc, mlp.c_proj (12h^2), their biases (9h), two LayerNorms
    per_block = 12 * h * h + (13 * h if config.bias else 2 * h)
    ln_f = 2 * h if config.bias else h
    return (config.vocab_size + config.block_size) * h + L * per_block + ln_f


def n_muon_params(config):
    """The parameters optimizer=muon gives Muon (the blocks' matmul weights); 0 for adamw."""
    return config.n_layer * 12 * config.n_embd ** 2 if config.optimizer == "muon" else 0


def plan(config, world_size, device_type):
    """Bytes per rank, by part, of a training step of `config` on `world_size` ranks of
    `device_type` ("cuda": bf16 autocast; anything else: float32). Returns a dict of
    {part: bytes} whose last entry, "total", is their sum. The parts, for N parameters and
    W = world_size, and the sharding mode's properties (sharding.py):
      parameters: 4N float32 (fsdp: 4N/W); zero2 adds its 4N/W slices that AdamW updates;
        on CUDA the bf16 copies that autocast (ddp, zero2) or FSDP's all-gathers (fsdp: the root
        and two blocks at a time) keep for the backward;
      gradients: 4N (fsdp: 4N/W); ddp's buckets another 4N unless gradient_as_bucket_view;
        zero2's reduce-scattered slices 4N/W; exact_reduction's float64 sums 8N (fsdp 8N/W);
      optimizer state: AdamW's 8 bytes per parameter, Muon's 4 for its matrices, divided by W
        in zero2 and fsdp;
      activations: saved for the backward of one micro-batch (see the module docstring);
      logits: the (B, T, vocab) tensors alive at once around the loss.
    """
    N, W = n_params(config), world_size
    s, b, h = config.seq_len, config.micro_batch_size, config.n_embd
    L, V = config.n_layer, config.vocab_size
    cuda = device_type == "cuda"
    e = 2 if cuda else 4  # bytes per activation element
    mode = SHARDING_MODES[config.sharding]
    shard = W if mode.shards_parameters else 1
    param_copies, grad_copies = mode.extra_copies(config, W)
    parts = {}
    parts["parameters"] = 4 * N / shard + 4 * N * param_copies
    if cuda:  # bf16 weights: FSDP gathers the root and two blocks at a time, autocast casts all
        matmul = L * 12 * h * h + V * h
        parts["parameters"] += (2 * (V * h + config.block_size * h + 2 * 12 * h * h)
                                if mode.shards_parameters else 2 * matmul)
    parts["gradients"] = 4 * N / shard + 4 * N * grad_copies
    if config.exact_reduction:
        parts["gradients"] += 8 * N / shard
    parts["optimizer state"] = ((8 * N - 4 * n_muon_params(config))
                                / (W if mode.shards_optimizer_state else 1))
    sbh = s * b * h
    masks = 2 if config.dropout > 0 else 0
    layer = sbh * (14 * e + 2 * 4 + masks)
    if config.activation_checkpointing:  # the blocks' float32 inputs, and one block recomputed
        blocks = L * 4 * sbh + layer
    else:
        blocks = L * layer
    parts["activations"] = blocks + sbh * (4 + e + (1 if config.dropout > 0 else 0))  # ln_f, drop
    parts["logits"] = s * b * V * ((e + 4 + 4) if cuda else 8)  # (bf16,) float32, log-softmax
    parts["total"] = sum(parts.values())
    return parts


def max_micro_batch(config, world_size, device_type, memory_bytes, usable=0.9):
    """The largest micro_batch_size whose planned total fits usable * memory_bytes (the rest is
    left to the CUDA context, the allocator's fragmentation and the kernels' workspaces); 0 if
    not even one sequence fits."""
    fixed = plan(dataclasses.replace(config, micro_batch_size=1), world_size, device_type)
    per_sequence = fixed["activations"] + fixed["logits"]
    room = usable * memory_bytes - (fixed["total"] - per_sequence)
    return max(0, int(room // per_sequence))


def summary(config, world_size, device_type):
    """One line for train_gpt2.py's console: the plan's parts and total, in GB (MB under 1 GB)."""
    parts = plan(config, world_size, device_type)
    unit, scale = ("GB", GB) if parts["total"] >= GB else ("MB", 2**20)
    sizes = ", ".join(f"{k} {v / scale:.2f} {unit}" for k, v in parts.items())
    return (f"memory plan per rank: {sizes}"
            + f" (micro_batch_size {config.micro_batch_size}, {config.sharding}, activation "
            f"checkpointing {'on' if config.activation_checkpointing else 'off'})")


def measure(config):
    """One training forward and backward of `config` on the CPU, one process: the bytes of
    parameters, gradients and optimizer state held, and of the tensors saved for the backward (each
    storage once, parameters excluded), as plan() names them. With activation checkpointing,
    the activations add those one block saves when the backward recomputes it."""
    import torch

    import optimizers
    from sharding import Replicas
    from train_gpt2 import GPT
    torch.manual_seed(0)
    model = GPT(config).train()
    idx = torch.randint(0, config.vocab_size, (config.micro_batch_size, config.seq_len))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
        if config.activation_checkpointing:  # one block as the backward recomputes it
            x = torch.randn(config.micro_batch_size, config.seq_len, config.n_embd, requires_grad=True)
            model.transformer.h[0](x)
    loss.backward()
    optimizer = optimizers.make_optimizer(optimizers.param_groups(model, config), Replicas(0, 1),
                                          config, torch.device("cpu"))
    optimizer.step()

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    logits = config.micro_batch_size * config.seq_len * config.vocab_size * 4  # log-softmax
    return {"parameters": size(model.parameters()),
            "gradients": size(p.grad for p in model.parameters()),
            "optimizer state": size(state), "activations": sum(saved.values()) - logits}


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[1],
                                         usage="%(prog)s [CONFIG.toml] [--key=value ...] [options]")
    parser.add_argument("--world_size", type=int, default=8)
    parser.add_argument("--gpu_memory", type=float, default=80, help="GB per GPU (default 80)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--measure", action="store_true",
                        help="also run one step of the config on the CPU and compare")
    args, config_args = parser.parse_known_args(argv)
    if args.world_size < 1:
        parser.error(f"--world_size must be >= 1, got {args.world_size}")
    if not 0 < args.gpu_memory < math.inf:
        parser.error(f"--gpu_memory must be a finite number of GB > 0, got {args.gpu_memory:g}")
    if args.measure and (args.world_size != 1 or args.device != "cpu"):
        parser.error("--measure runs one CPU process: pass --world_size 1 --device cpu with it")
    from train_gpt2 import load_config
    config = load_config(config_args)
    parts = plan(config, args.world_size, args.device)
    print(f"{config.n_layer} layers, n_embd {config.n_embd}: {n_params(config) / 1e6:.0f}M "
          f"parameters; {args.world_size} ranks of {args.device}, micro_batch_size "
          f"{config.micro_batch_size}, seq_len {config.seq_len}")
    unit, scale = ("GB", GB) if parts["total"] >= GB else ("MB", 2**20)
    print(f"{'per rank':<14}" + "".join(f"{k:>14}" for k in parts))
    print(f"{'planned ' + unit:<14}" + "".join(f"{v / scale:>14.2f}" for v in parts.values()))
    if args.measure:
        measured = measure(config)
        print(f"{'measured ' + unit:<14}" + "".join(
            f"{measured[k] / scale:>14.2f}" if k in measured else f"{'-':>14}" for k in parts))
    print(f"\nlargest micro_batch_size in {args.gpu_memory:g} GB (90% usable), by sharding and "
          f"activation checkpointing:")
    print(f"{'sharding':<10}{'off':>8}{'on':>8}")
    for sharding in SHARDING_MODES:
        fits = [max_micro_batch(dataclasses.replace(config, sharding=sharding,
                                                    activation_checkpointing=ckpt),
                                args.world_size, args.device, args.gpu_memory * GB)
                for ckpt in (False, True)]
        print(f"{sharding:<10}{fits[0]:>8}{fits[1]:>8}")


if __name__ == "__main__":
    configurator.run(main, "memory_plan.py")
