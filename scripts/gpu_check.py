"""
One command for a GPU machine with nothing but the repo: runs the CUDA tests and measures GPT-2 124M
on one GPU, without the network, and writes report.md and each part's log into REPORT_DIR.

    python -m scripts.gpu_check REPORT_DIR                  # every part
    python -m scripts.gpu_check REPORT_DIR --part tests     # some parts (--part compile modes)
    python -m scripts.gpu_check REPORT_DIR --dry_run        # print the plan, run nothing (any machine)
    python -m scripts.gpu_check REPORT_DIR --tiny           # every part, toy-sized, on the CPU

The parts, each killed with its processes past its time limit: tests (tests/test_cuda.py), compile
(scripts/bench.py on configs/gpt2_124m.toml: eager against torch.compile), modes (the same: ddp, zero2,
fsdp, exact_reduction and Muon) and sample (scripts/bench_sample.py against transformers' on the GPU).
The benchmarks train on the embedded tiny shakespeare corpus with HellaSwag off, 131,072 tokens a
step. Their data, runs and profiler traces go to out/gpu_check/ (--scratch).

REPORT_DIR gets {part}.log and report.md: each part's result and the end of its output (the tests'
summary, a benchmark's table, which docs/perf.md explains), or of its log for a part that did not
pass. The goal for 124M on one H100 is 50% MFU.
"""

import datetime
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from gpt2_ddp import configurator, runs
from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.configurator import UserError

PYTHON = sys.executable
# micro-batch 32 fits the corpus's val split and an H100 at 124M
BENCH_TRAIN_ARGS = ["--hellaswag_interval=0", "--micro_batch_size=32", "--total_batch_size=131072"]
TINY_TRAIN_ARGS = ["--hellaswag_interval=0", "--n_layer=1", "--n_head=2", "--n_embd=32",
                   "--seq_len=32", "--micro_batch_size=2", "--total_batch_size=128",
                   "--device=cpu", "--compile=false"]
BENCHES = {"compile": (["eager", "compile"], [16]),  # (bench.py --variants, --micro_batch_sizes)
           "modes": (["ddp", "zero2", "fsdp", "ddp_exact:--exact_reduction=true", "muon"], [])}
TAIL_LINES = 40  # of a part's output in the report


def prepare(scratch):
    """The embedded corpus's shards into scratch/data (a rerun has nothing to do)."""
    return [PYTHON, "prepare_data.py", "--output_dir", f"{scratch}/data"]


def bench(part, tiny, scratch):
    """bench.py's command for a benchmark part, only its first variant when tiny."""
    variants, micro_batch_sizes = BENCHES[part]
    if tiny:
        variants, micro_batch_sizes = variants[:1], []
    return [PYTHON, "-m", "scripts.bench", "configs/gpt2_124m.toml", f"--data_dir={scratch}/data",
            *(TINY_TRAIN_ARGS if tiny else BENCH_TRAIN_ARGS), "--nproc", "1",
            "--steps", "1" if tiny else "5", "--variants", *variants,
            *(["--micro_batch_sizes", *map(str, micro_batch_sizes)] if micro_batch_sizes else []),
            "--out_dir", f"{scratch}/{part}"]


PARTS = {  # name: (time limit in seconds, what it measures, its commands for (tiny, scratch))
    "tests": (480, "every CUDA path as a test (tests/test_cuda.py)", lambda tiny, scratch: [
        [PYTHON, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py",
         *(["-k", "kv_cache"] if tiny else [])]]),
    "compile": (420, "eager against torch.compile, micro-batch 32 and 16", lambda tiny, scratch: [
        prepare(scratch), bench("compile", tiny, scratch)]),
    "modes": (480, "ddp, zero2 and fsdp at world size 1, exact_reduction, Muon", lambda tiny, scratch: [
        prepare(scratch), bench("modes", tiny, scratch)]),
    "sample": (240, "the KV-cache sampler against transformers' generate", lambda tiny, scratch: [
        [PYTHON, "-m", "scripts.bench_sample", *(
            ["--devices", "cpu", "--n_layer", "1", "--n_head", "2", "--n_embd", "32",
             "--new_tokens", "8", "--repeats", "1"] if tiny else
            ["--devices", "cuda", "--new_tokens", "200", "1000", "--repeats", "3"])]]),
}


def shell(command):
    """command (argv) as a line to paste into a shell, with `python` for this interpreter."""
    return shlex.join("python" if word == PYTHON else word for word in command)


def print_plan(parts, tiny, report_dir, scratch):
    total = sum(PARTS[p][0] for p in parts)
    print(f"gpu_check plan{' (--tiny, on the CPU)' if tiny else ''}: {len(parts)} part(s); a part "
          f"past its limit is killed ({total // 60} min of limits in all); report in "
          f"{report_dir}/report.md")
    for name in parts:
        limit, what, commands = PARTS[name]
        print(f"\n{name} (limit {limit // 60} min {limit % 60:02d} s): {what}")
        for command in commands(tiny, scratch):
            print(f"  {shell(command)}")


def run_part(name, tiny, report_dir, scratch):
    """Runs one part's commands in order, until one fails, each echoed and appended to
    {name}.log; past the part's limit its whole process group is killed. Returns (status,
    seconds, the report's section)."""
    limit, what, commands = PARTS[name]
    start = time.monotonic()
    status, stdout, ran = "passed", "", []
    with open(report_dir / f"{name}.log", "w") as log:

        def show(line, _):
            log.write(line)
            log.flush()
            print(line, end="", flush=True)

        for command in commands(tiny, scratch):
            ran.append(f"    {shell(command)}")
            show(f"$ {shell(command)}\n", True)
            code, stdout, _ = runs.stream(command, show, max(0.0, start + limit - time.monotonic()),
                                          dict(os.environ, PYTHONUNBUFFERED="1"), own_session=True)
            if code != 0:
                status = "timed out" if code is None else "failed"
                break
    seconds = time.monotonic() - start
    tail = stdout if status == "passed" else (report_dir / f"{name}.log").read_text()
    section = [f"## {name}: {status} in {seconds:.0f} s (limit {limit} s)", "", what + ".", "",
               *ran, "", "```", *tail.splitlines()[-TAIL_LINES:], "```", ""]
    return status, seconds, section


def machine():
    """The machine, torch and the repo's commit, for the report's head."""
    import torch
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=runs.ROOT,
                                capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return (f"GPUs: {', '.join(gpus) or 'none (CPU)'}; torch {torch.__version__} (CUDA "
            f"{torch.version.cuda or '-'}), Python {sys.version.split()[0]}; commit {commit}")


def main(argv):
    parser = configurator.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]).strip())
    parser.add_argument("report_dir", help="where report.md and the logs go")
    parser.add_argument("--part", nargs="+", choices=list(PARTS), default=list(PARTS),
                        help="the parts to run, in PARTS order (default: all)")
    parser.add_argument("--dry_run", action="store_true", help="print the plan; run nothing")
    parser.add_argument("--scratch", default="out/gpu_check",
                        help="the data, the benchmarks' runs and their profiler traces")
    parser.add_argument("--tiny", action="store_true",
                        help="every part on the CPU at toy sizes, one test and each benchmark's "
                             "first variant: checks the script, measures nothing")
    args = parser.parse_args(argv)
    parts = [name for name in PARTS if name in args.part]
    report_dir = Path(args.report_dir)
    import torch
    if not (args.tiny or args.dry_run or torch.cuda.is_available()):
        raise UserError("torch sees no CUDA GPU here: pass --dry_run to see the plan, or --tiny "
                        "to run it at toy sizes on the CPU")
    print_plan(parts, args.tiny, report_dir, args.scratch)
    if args.dry_run:
        return
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make {report_dir}: {e.strerror}") from None
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    head = ["# gpu_check report", "", f"{date}; {machine()}.", "",
            "| part | result | seconds | limit |", "| --- | --- | --- | --- |"]
    sections, failed = [""], []
    for name in parts:
        print(f"\n=== gpu_check: {name} ===", flush=True)
        status, seconds, section = run_part(name, args.tiny, report_dir, args.scratch)
        head.append(f"| {name} | {status} | {seconds:.0f} | {PARTS[name][0]} |")
        sections += section
        if status != "passed":
            failed.append(name)
        atomic_write(report_dir / "report.md", lambda f: f.write("\n".join(head + sections).encode()))
        print(f"=== gpu_check: {name} {status} in {seconds:.0f} s ===", flush=True)
    print(f"\nreport: {report_dir / 'report.md'}")
    if failed:
        raise UserError(f"part(s) {', '.join(failed)} did not pass: see {report_dir / 'report.md'}")


if __name__ == "__main__":
    configurator.run(main, "gpu_check.py")
