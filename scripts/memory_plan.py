"""
Memory per rank of a config before anything runs (gpt2_ddp/memory_plan.py), by part, and the
largest micro-batch that fits, by sharding mode and activation checkpointing:

    python -m scripts.memory_plan configs/gpt2_1558m.toml --world_size 8 --gpu_memory 80
    python -m scripts.memory_plan configs/gpt2_774m.toml --sharding=fsdp --activation_checkpointing=true
    python -m scripts.memory_plan configs/gpt2_124m.toml --world_size 1 --gpu_memory 16 --dtype=float16

dtype=auto plans bfloat16, as on a GPU of compute capability 8.0 or later.
"""

import dataclasses
import math
if not __spec__: raise SystemExit("run it as python -m scripts.memory_plan from the repository root")

from gpt2_ddp import configurator, memory_plan
from gpt2_ddp.memory_plan import GB
from train_gpt2 import load_config, memory_counts

SHARDINGS = ("ddp", "zero2", "fsdp")


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[1],
                                         usage="%(prog)s [CONFIG.toml] [--key=value ...] [options]")
    parser.add_argument("--world_size", type=int, default=8, help="ranks the model is sharded over")
    parser.add_argument("--gpu_memory", type=float, default=80, help="GB per GPU")
    args, config_args = parser.parse_known_args(argv)
    if args.world_size < 1:
        parser.error(f"--world_size must be >= 1, got {args.world_size}")
    if not 0 < args.gpu_memory < math.inf:
        parser.error(f"--gpu_memory must be a finite number of GB > 0, got {args.gpu_memory:g}")
    config = load_config(config_args)
    if config.dtype == "auto":
        config = dataclasses.replace(config, dtype="bfloat16")
    counts = {ckpt: memory_counts(dataclasses.replace(config, activation_checkpointing=ckpt))
              for ckpt in (False, True)}  # activations are measured with and without it
    parts = memory_plan.plan(config, args.world_size, counts[config.activation_checkpointing])
    print(f"{config.n_layer} layers, n_embd {config.n_embd}: {counts[False]['params'] / 1e6:.0f}M "
          f"parameters; {args.world_size} ranks, {config.dtype}, micro_batch_size "
          f"{config.micro_batch_size}, seq_len {config.seq_len}")
    unit, scale = ("GB", GB) if parts["total"] >= GB else ("MB", 2**20)
    print(f"{'per rank':<14}" + "".join(f"{k:>16}" for k in parts))
    print(f"{'planned ' + unit:<14}" + "".join(f"{v / scale:>16.2f}" for v in parts.values()))
    print(f"\nlargest micro_batch_size in {args.gpu_memory:g} GB (90% usable), by sharding and "
          f"activation checkpointing:")
    print(f"{'sharding':<10}{'off':>8}{'on':>8}")
    for sharding in SHARDINGS:
        fits = [memory_plan.max_micro_batch(
            dataclasses.replace(config, sharding=sharding, activation_checkpointing=ckpt),
            args.world_size, counts[ckpt], args.gpu_memory * GB) for ckpt in (False, True)]
        print(f"{sharding:<10}{fits[0]:>8}{fits[1]:>8}")


if __name__ == "__main__":
    configurator.run(main, "memory_plan.py")
