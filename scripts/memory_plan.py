"""
Memory per rank of a config before anything runs (gpt2_ddp/memory_plan.py), by part, and the
largest micro-batch that fits, by sharding mode and activation checkpointing:

    python -m scripts.memory_plan configs/gpt2_1558m.toml --world_size 8 --gpu_memory 80
    python -m scripts.memory_plan configs/gpt2_774m.toml --sharding=fsdp --activation_checkpointing=true
    python -m scripts.memory_plan configs/shakespeare_cpu.toml --device cpu --world_size 1 --measure

--measure also runs one training step on the CPU and counts what it holds, by the plan's parts.
"""

import dataclasses
import math

import torch

from gpt2_ddp import configurator, memory_plan
from gpt2_ddp.memory_plan import GB
from train_gpt2 import GPT, load_config, memory_counts

SHARDINGS = ("ddp", "zero2", "fsdp")


def measure(config):
    """Bytes of parameters, gradients, optimizer state and saved activations (each storage once),
    as a dict, after one training step of `config` on the CPU in this process."""
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
    optimizer = model.configure_optimizers(config, "cpu")
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
    config = load_config(config_args)
    counts = memory_counts(config)
    parts = memory_plan.plan(config, args.world_size, args.device, counts)
    print(f"{config.n_layer} layers, n_embd {config.n_embd}: {counts['params'] / 1e6:.0f}M "
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
    for sharding in SHARDINGS:
        fits = [memory_plan.max_micro_batch(
            dataclasses.replace(config, sharding=sharding, activation_checkpointing=ckpt),
            args.world_size, args.device, counts, args.gpu_memory * GB) for ckpt in (False, True)]
        print(f"{sharding:<10}{fits[0]:>8}{fits[1]:>8}")


if __name__ == "__main__":
    configurator.run(main, "memory_plan.py")
