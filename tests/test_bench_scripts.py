"""Smoke tests of tests/bench_sample.py's main."""

import re
import sys

import pytest
import torch

from gpt2_ddp.configurator import UserError
from tests import bench_sample


def test_bench_sample_times_ours_against_transformers_on_the_same_weights(capsys):
    # in this process, not a subprocess: importing torch and transformers again took 6 s of 9
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
