"""Smoke tests of scripts/bench_tokenizer.py, run as a user would, and
of scripts/bench_sample.py's main."""

import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from gpt2_ddp.configurator import UserError
from scripts import bench_sample


def run_script(name, *args):
    """stdout of `python -m scripts.{name} args`; fails with the output if the script failed."""
    cmd = [sys.executable, "-m", f"scripts.{name}", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def table(stdout, first_header_word):
    """The header's columns and the rows (lists of cells) of the table that follows it."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_header_word])
    return lines[start], [line.split() for line in lines[start + 1:] if line.strip()]


def number(cell):
    return float(cell.replace(",", ""))


def test_bench_tokenizer():
    out = run_script("bench_tokenizer", "--repeat", 1, "--trials", 1, "--workers", 1, 2)
    header, rows = table(out, "method")
    assert header.split() == ["method", "workers", "tokens", "seconds", "tokens/s", "ratio"]
    assert [(r[0], r[1]) for r in rows] == [("tiktoken", "1"), ("prepare_data", "1"),
                                            ("tiktoken", "2"), ("prepare_data", "2")]
    n_docs = int(out.split()[0])  # "N documents, ..."
    for tik, pd in (rows[0:2], rows[2:4]):
        assert number(pd[2]) == number(tik[2]) + n_docs  # one <|endoftext|> per document
        assert number(tik[4]) > 0 and number(pd[4]) > 0
        assert abs(number(pd[5]) - number(pd[4]) / number(tik[4])) < 0.02


def test_bench_sample_times_ours_against_transformers_on_the_same_weights(capsys):
    # in this process, not run_script: importing torch and transformers again took 6 s of 9
    bench_sample.main(["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--new_tokens", "3",
                       "5", "--repeats", "2"])
    out = capsys.readouterr().out
    diff = float(re.search(r"max \|logits ours - transformers\| on the prompt: (\S+);", out)[1])
    assert diff < 1e-5  # the same function: transformers got our weights, transposed right
    header, _, *rows = [line.strip("|").split("|") for line in out.splitlines()
                        if line.startswith("|")]
    assert [cell.strip() for cell in header] == ["setting", "ours tok/s, median (min-max) of 2",
                                                 "transformers tok/s", "ratio"]
    settings = [row[0].strip() for row in rows]
    assert settings[:2] == ["cpu, 1 thread, 3 new tokens", "cpu, 1 thread, 5 new tokens"]
    assert len(rows) % 2 == 0 and all(s.startswith("cpu, ") for s in settings)
    for _, ours, theirs, ratio in rows:
        medians = []
        for cell in (ours, theirs):
            median, low, high = map(float, re.fullmatch(r" (\S+) \((\S+)-(\S+)\) ", cell).groups())
            assert 0 < low <= median <= high
            medians.append(median)
        assert float(ratio.strip().removesuffix("x")) == pytest.approx(medians[0] / medians[1],
                                                                       abs=0.01, rel=0.01)


def test_bench_sample_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(UserError, match="^transformers is not installed: pip install transformers$"):
        bench_sample.main(["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--new_tokens", "2"])


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats, --new_tokens, --n_layer and --n_head must be >= 1"),
    (["--n_embd", "100"], "--n_embd must be a positive multiple of --n_head=12, got 100"),
    (["--new_tokens", "200", "1009"], "--new_tokens at most 1008: transformers' GPT-2 has no "
                                      "position beyond block_size=1024"),
])
def test_bench_sample_refuses_bad_flags_in_one_line(args, message):
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        bench_sample.main(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to time")
def test_bench_sample_without_a_gpu_refuses_devices_cuda_in_one_line():
    with pytest.raises(UserError, match="^--devices cuda: torch sees no CUDA device here; pass "
                                        "--devices cpu$"):
        bench_sample.main(["--devices", "cuda"])
