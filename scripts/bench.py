"""
Benchmarks short trainings of one config in several variants and prints one table: tokens/s, ms/step,
MFU, peak GPU memory, where a step's time goes, and one rank's optimizer state and collective traffic.

    python -m scripts.bench configs/gpt2_124m.toml --nproc 1                  # one GPU
    python -m scripts.bench configs/gpt2_124m.toml --nproc 8 --steps 20       # 8 GPUs
    python -m scripts.bench configs/shakespeare_cpu.toml --nproc 2 --variants eager compile
    python -m scripts.bench configs/gpt2_124m.toml --variants compile --micro_batch_sizes 16 32 64
    python -m scripts.bench configs/shakespeare_cpu.toml --nproc 4 --variants ddp zero2 fsdp
    python -m scripts.bench configs/gpt2_124m.toml --variants adamw muon
    python -m scripts.bench configs/gpt2_124m.toml --variants bfloat16 float16 float32
    python -m scripts.bench configs/gpt2_124m.toml --variants cudnn flash

Each variant runs train_gpt2.py with the config, its overrides, `--profile=true` and the extra `--key=value`
arguments, rank 0's trace in {out}/{variant}/trace_rank0.json (docs/perf.md explains the columns). A rerun
replaces only the variant directories bench.py made; SIGTERM or Ctrl-C ends the training run too.
"""

import json
import math
import shutil
import statistics
from pathlib import Path
if not __spec__: raise SystemExit("run it as python -m scripts.bench from the repository root")

from gpt2_ddp import checkpoints, configurator, runs
from gpt2_ddp.configurator import UserError

PROFILED_STEPS = 3  # train_gpt2.py's profiler schedule: wait 2, warm up 1, record 3
UNTIMED_STEPS = 6  # compilation, warm-up and the profiled steps

VARIANTS = {
    "eager": ["--compile=false"],
    "compile": ["--compile=true"],  # DDP(torch.compile(model)), as nanoGPT
    "compile_ddp": ["--compile=true", "--compile_ddp=true"],  # torch.compile(DDP(model))
    "ddp": ["--sharding=ddp"], "zero2": ["--sharding=zero2"], "fsdp": ["--sharding=fsdp"],
    "adamw": ["--optimizer=adamw"], "muon": ["--optimizer=muon"],
    "bfloat16": ["--dtype=bfloat16"],
    "float16": ["--dtype=float16"],  # with torch's loss scaler
    "float32": ["--dtype=float32"],  # TF32 matmuls on Ampere and later
    "cudnn": ["--sdpa_backend=cudnn"], "flash": ["--sdpa_backend=flash"],  # attention's kernel
}


def plan(specs, micro_batch_sizes):
    """(name, overrides) of each variant ('name' or 'name:--key=value,...') and micro-batch size. Raises
    UserError for an unknown variant, a name not a plain directory name or repeated, or a size < 1."""
    if min(micro_batch_sizes, default=1) < 1:
        raise UserError(f"--micro_batch_sizes must be >= 1, not {min(micro_batch_sizes)}")
    variants = []
    for spec in specs:
        name, _, overrides = spec.partition(":")
        if not overrides and name not in VARIANTS:
            raise UserError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}, "
                            f"or write name:--key=value,...")
        variants.append((name, overrides.split(",") if overrides else VARIANTS[name]))
    variants += [(f"B={b}", [f"--micro_batch_size={b}"]) for b in micro_batch_sizes]
    names = [name for name, _ in variants]
    for name in names:
        if name in ("", ".", "..") or Path(name).name != name:
            raise UserError(f"variant name {name!r} is not a plain directory name; write "
                            f"name:--key=value,... with a name such as 'fast'")
        if names.count(name) > 1:
            raise UserError(f"variant {name!r} is listed twice; give each its own name")
    return variants


MARKER = ".made_by_bench"


def made_here(out):
    """Whether the directory out is a variant's run that bench.py made (and so may replace)."""
    return out.is_dir() and not out.is_symlink() and (out / MARKER).is_file()


def run(name, overrides, args, train_args):
    """(log records, rank 0's trace file) of `name`, run in {out_dir}/{name}. Raises UserError if it fails."""
    out = Path(args.out_dir) / name
    if made_here(out):
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("scripts/bench.py made this directory and replaces it when rerun\n")
    runs.train([*train_args, *overrides, f"--max_steps={UNTIMED_STEPS + args.steps}",
                "--eval_interval=0", "--sample_interval=0", "--checkpoint_interval=0",
                "--keep_checkpoints=1", "--profile=true", f"--out_dir={out}", "--resume=never"],
               args.nproc, progress=name)
    records = runs.read_log(out)
    for checkpoint in checkpoints.listed(out):  # the end-of-run checkpoint is not what we measure
        checkpoint.unlink()
    return records, out / "trace_rank0.json"


def time_split(events):
    """Per-step ms (GPU time where traced) of data, fwd_bwd, allreduce_wait, optimizer, newton_schulz."""
    cat = ("gpu_user_annotation" if any(e.get("cat") == "gpu_user_annotation" for e in events)
           else "user_annotation")
    durations = {}
    for e in events:
        if e.get("cat") == cat and e.get("ph") == "X":
            durations.setdefault(e["name"], []).append(e["dur"] / 1000)  # us -> ms
    nosync, sync = durations.get("forward_backward", []), durations.get("forward_backward_sync", [])
    wait = statistics.mean(sync) - statistics.mean(nosync) if nosync and sync else None
    fwd_bwd = (sum(nosync) + sum(sync) - (wait or 0) * len(sync)) / PROFILED_STEPS
    return {"data": sum(durations.get("data", [])) / PROFILED_STEPS, "fwd_bwd": fwd_bwd,
            "allreduce_wait": max(wait, 0.0) if wait is not None else None,
            "optimizer": sum(durations.get("optimizer", [])) / PROFILED_STEPS,
            "newton_schulz": (sum(durations["newton_schulz"]) / PROFILED_STEPS
                              if "newton_schulz" in durations else None)}


ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8}


def comm_bytes(events):
    """Bytes rank 0 hands to collectives per profiled step, from a trace recorded with shapes."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("c10d::")]
    all_reduce_types = {}  # c10d's all-reduce event lacks the dtype that the backend's event has
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ("gloo:all_reduce", "nccl:all_reduce"):
            dims, types = e["args"]["Input Dims"], e["args"]["Input type"]
            all_reduce_types[math.prod(dims[0])] = types[0]
    total = 0
    for e in ops:
        dims, types = e["args"].get("Input Dims"), e["args"].get("Input type")
        if e["name"] == "c10d::allreduce_":
            numel = math.prod(dims[0][0])
            total += numel * ELEMENT_BYTES.get(all_reduce_types.get(numel, "float"), 4)
        elif e["name"] in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_"):
            total += max(math.prod(d) for d in dims[:2]) * ELEMENT_BYTES.get(types[0], 4)
        elif e["name"] in ("c10d::broadcast_", "c10d::scatter_", "c10d::gather_"):
            piece = dims[1][0] if e["name"] == "c10d::gather_" else dims[0][0]  # this rank's piece
            total += math.prod(piece) * 2
    return total / PROFILED_STEPS


def summarize(records, trace_path):
    timed = [r for r in records if "loss" in r and r["step"] > UNTIMED_STEPS]
    events = json.load(open(trace_path))["traceEvents"]
    return {
        "optimizer_state_mb": records[0]["optimizer_state_bytes"] / 2**20,
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
        "ms_per_step": statistics.median(r["dt_ms"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if "mfu" in timed[0] else None,
        "mem_gb": max(r["mem_gb"] for r in timed) if "mem_gb" in timed[0] else None,
        **time_split(events),
        "comm_mb": comm_bytes(events) / 2**20,
    }


def print_table(rows):
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    header = (f"{'variant':<22} {'tok/s':>11} {'ms/step':>9} {'MFU':>6} {'mem GB':>7} "
              f"{'data ms':>8} {'fwd+bwd ms':>10} {'allreduce wait ms':>17} {'optim ms':>8} "
              f"{'NS ms':>6} {'optim state MB':>14} {'comm MB/step':>12}")
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        mfu = None if r["mfu"] is None else r["mfu"] * 100
        print(f"{name:<22} {r['tokens_per_sec']:>11,.0f} {r['ms_per_step']:>9.1f} {fmt(mfu, '5.1f'):>5}% "
              f"{fmt(r['mem_gb'], '.1f'):>7} {r['data']:>8.1f} {r['fwd_bwd']:>10.1f} "
              f"{fmt(r['allreduce_wait'], '.1f'):>17} {r['optimizer']:>8.1f} "
              f"{fmt(r['newton_schulz'], '.1f'):>6} "
              f"{r['optimizer_state_mb']:>14.2f} {r['comm_mb']:>12.3f}")


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[0],
                                         usage="%(prog)s [CONFIG.toml] [--key=value ...] [options]")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--variants", nargs="+", default=["eager", "compile", "compile_ddp"],
                        help=f"from {', '.join(VARIANTS)}, or name:--key=value,...")
    parser.add_argument("--micro_batch_sizes", type=int, nargs="*", default=[],
                        help="also run the config (with its own compile setting) at these B")
    parser.add_argument("--out_dir", default="out/bench", help="each variant's run in a directory here")
    args, train_args = parser.parse_known_args(argv)
    configurator.check_options(parser, args, dict.fromkeys(["nproc", "steps"], (lambda n: n >= 1, ">= 1")))
    variants = plan(args.variants, args.micro_batch_sizes)
    for name, _ in variants:  # before any variant trains: bench.py replaces only its own runs
        out = Path(args.out_dir) / name
        if (out.exists() or out.is_symlink()) and not made_here(out):
            raise UserError(f"{out} exists and was not made by bench.py, which writes each variant's "
                            f"run there; pass another --out_dir or move it away")
    print_table({name: summarize(*run(name, overrides, args, train_args)) for name, overrides in variants})


if __name__ == "__main__":
    configurator.run(main, "bench.py")
