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

REPORT_DIR gets report.md, results.json (parts run into it by separate commands add up) and {part}.log.
report.md holds the parts' results, the tests' summary, each benchmark's table (docs/perf.md explains
it) and a failed part's log tail. The goal for 124M on one H100 is 50% MFU.
"""

import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from gpt2_ddp import configurator, runs
from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.configurator import UserError

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
CONFIG = "configs/gpt2_124m.toml"
# micro-batch 32 fits the corpus's val split and an H100 at 124M
BENCH_TRAIN_ARGS = ["--hellaswag_interval=0", "--micro_batch_size=32", "--total_batch_size=131072"]
TINY_TRAIN_ARGS = ["--hellaswag_interval=0", "--n_layer=1", "--n_head=2", "--n_embd=32",
                   "--seq_len=32", "--micro_batch_size=2", "--total_batch_size=128",
                   "--device=cpu", "--compile=false"]
BENCHES = {"compile": (["eager", "compile"], [16]),  # (bench.py --variants, --micro_batch_sizes)
           "modes": (["ddp", "zero2", "fsdp", "ddp_exact:--exact_reduction=true", "muon"], [])}


def prepare(scratch):
    """The embedded corpus's shards into scratch/data (a rerun has nothing to do)."""
    return [PYTHON, "prepare_data.py", "--output_dir", f"{scratch}/data"]


def bench_runs(part, tiny):
    """(variants, micro_batch_sizes) of a part's benchmark, only its first variant when tiny."""
    variants, micro_batch_sizes = BENCHES[part]
    return (variants[:1], []) if tiny else (variants, micro_batch_sizes)


def train_args(tiny, scratch):
    """The train_gpt2.py config of every benchmark run, before its variant's overrides."""
    return [CONFIG, f"--data_dir={scratch}/data", *(TINY_TRAIN_ARGS if tiny else BENCH_TRAIN_ARGS)]


def bench(part, tiny, scratch):
    """bench.py's command for a benchmark part."""
    variants, micro_batch_sizes = bench_runs(part, tiny)
    return [PYTHON, "-m", "scripts.bench", *train_args(tiny, scratch), "--nproc", "1",
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
MFU_GOAL = 0.5  # of the H100's dense bf16 peak, for 124M on one GPU


def shell(command):
    """command (argv) as a line to paste into a shell, with `python` for this interpreter."""
    return shlex.join("python" if word == PYTHON else word for word in command)


def check_plan(tiny, scratch):
    """Loads each benchmark run's config. Raises UserError for a bad key, variant or batch."""
    from scripts import bench
    from train_gpt2 import grad_accum_steps, load_config
    for part in BENCHES:
        for _, overrides in bench.plan(*bench_runs(part, tiny)):
            try:
                grad_accum_steps(load_config([*train_args(tiny, scratch), *overrides]), 1)
            except UserError as e:
                raise UserError(f"part {part}, {' '.join(overrides)}: {e}") from None


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


def run_command(command, log, deadline):
    """Runs command in the repo root, its output appended to `log` and echoed; returns (exit code or
    "timed out", stdout). Past `deadline` (time.monotonic()) its whole process group is killed."""
    log.write(f"$ {shell(command)}\n")
    log.flush()

    def show(line, _):
        log.write(line)
        log.flush()
        print(line, end="", flush=True)

    code, stdout, _ = runs.stream(command, show, max(0.0, deadline - time.monotonic()),
                                  dict(os.environ, PYTHONUNBUFFERED="1"), own_session=True)
    return ("timed out" if code is None else code), stdout


def run_part(name, tiny, report_dir, scratch):
    """Runs one part's commands in order, until one fails; returns its result for results.json."""
    limit, what, commands = PARTS[name]
    start = time.monotonic()
    result = {"what": what, "limit_s": limit, "commands": [], "status": "passed"}
    with open(report_dir / f"{name}.log", "w") as log:
        for command in commands(tiny, scratch):
            code, stdout = run_command(command, log, start + limit)
            result["commands"].append({"command": shell(command), "exit": code, "stdout": stdout})
            if code != 0:
                result["status"] = "timed out" if code == "timed out" else "failed"
                break
    result["seconds"] = round(time.monotonic() - start, 1)
    with open(report_dir / f"{name}.log") as log:
        result["log_tail"] = log.read().splitlines()[-40:]
    return result


def machine():
    """The machine, torch and the repo's commit, for the report's head."""
    import torch
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {"gpus": ", ".join(gpus) or "none (CPU)", "torch": torch.__version__,
            "cuda": torch.version.cuda or "-", "python": sys.version.split()[0],
            "commit": commit}


def bench_rows(stdout):
    """bench.py's table in its stdout: the header line, the rule and the rows."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("variant ")), None)
    return [] if start is None else lines[start:]


def part_section(name, result):
    lines = [f"## {name}: {result['status']} in {result['seconds']:.0f} s (limit "
             f"{result['limit_s']} s)", "", result["what"] + ".", ""]
    for command in result["commands"]:
        lines.append(f"    {command['command']}")
    lines.append("")
    stdout = result["commands"][-1]["stdout"] if result["commands"] else ""
    if name == "tests":
        summary = stdout.splitlines()
        start = next((i for i, line in enumerate(summary) if "short test summary" in line), None)
        kept = summary[start + 1:] if start is not None else summary[-1:]
        lines += ["```", *kept, "```", ""] if kept else []
    rows = bench_rows(stdout)
    if rows:
        lines += ["```", *rows, "```", ""]
        mfus = [float(mfu) for mfu in (row.split()[3].rstrip("%") for row in rows[2:])
                if mfu != "-"]
        if mfus:
            verdict = "reached" if max(mfus) >= MFU_GOAL * 100 else "not reached"
            lines += [f"Best MFU {max(mfus):.1f}%; the goal, {MFU_GOAL:.0%} for 124M on one "
                      f"H100, is {verdict}. fwd+bwd, optim and data ms say where a step's time "
                      f"goes; the traces are in the scratch folder's {name}/*/trace_rank0.json.", ""]
    if name == "sample":
        lines += [line for line in stdout.splitlines() if line.startswith("|")] + [""]
    if result["status"] != "passed":
        lines += [f"The end of {name}.log:", "", "```", *result["log_tail"], "```", ""]
    return lines


def write_report(report_dir, results, info):
    """report.md from results.json's parts, in PARTS order."""
    lines = ["# gpu_check report", "",
             f"{info['date']}; GPUs: {info['gpus']}; torch {info['torch']} (CUDA {info['cuda']}), "
             f"Python {info['python']}; commit {info['commit']}.", "",
             "| part | result | seconds | limit |", "| --- | --- | --- | --- |"]
    names = [name for name in PARTS if name in results]
    for name in names:
        r = results[name]
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.0f} | {r['limit_s']} |")
    lines.append("")
    for name in names:
        lines += part_section(name, results[name])
    atomic_write(report_dir / "report.md", lambda f: f.write("\n".join(lines).encode()))


def main(argv):
    parser = configurator.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]).strip())
    parser.add_argument("report_dir", help="where report.md, results.json and the logs go")
    parser.add_argument("--part", nargs="+", choices=list(PARTS), default=list(PARTS),
                        help="the parts to run, in PARTS order (default: all)")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the plan and check its configs; run nothing")
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
    check_plan(args.tiny, args.scratch)
    print_plan(parts, args.tiny, report_dir, args.scratch)
    if args.dry_run:
        return
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make {report_dir}: {e.strerror}") from None
    results_path = report_dir / "results.json"
    try:  # parts run by earlier commands into the same folder stay in the report
        results = json.loads(results_path.read_text())["parts"]
    except (OSError, ValueError, KeyError):
        results = {}
    info = {**machine(), "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
    for name in parts:
        print(f"\n=== gpu_check: {name} ===", flush=True)
        results[name] = run_part(name, args.tiny, report_dir, args.scratch)
        atomic_write(results_path, lambda f: f.write(json.dumps(
            {"info": info, "parts": results}, indent=1).encode()))
        write_report(report_dir, results, info)
        print(f"=== gpu_check: {name} {results[name]['status']} in "
              f"{results[name]['seconds']:.0f} s ===", flush=True)
    print(f"\nreport: {report_dir / 'report.md'}")
    failed = [name for name in parts if results[name]["status"] != "passed"]
    if failed:
        raise UserError(f"part(s) {', '.join(failed)} did not pass: see {report_dir / 'report.md'}")


if __name__ == "__main__":
    configurator.run(main, "gpu_check.py")
