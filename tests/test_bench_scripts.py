"""Smoke tests of tests/bench_sample.py's main, and of tests/bench_kernels.py's rivals."""

import re
import sys

import pytest
import torch
from torch.nn import functional as F

from gpt2_ddp.configurator import UserError
from tests import bench_kernels, bench_sample


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


def test_bench_sample_times_loading_and_whole_samples_in_fresh_processes(hf_tiny, capsys):
    """--load and --sample_from time fresh processes, ours against transformers': the import, two
    from_pretrained calls, and a whole sample.py run against a transformers script doing the same;
    the speedup is transformers' seconds over ours."""
    bench_sample.main(["--load", str(hf_tiny), "--sample_from", str(hf_tiny), "--new_tokens", "3",
                       "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.startswith(f"fresh processes at one CPU thread, seconds, best of 1; torch "
                          f"{torch.__version__}\n")
    header, _, *rows = [[cell.strip() for cell in line.strip("|").split("|")]
                        for line in out.splitlines() if line.startswith("|")]
    assert header == ["what", "ours", "transformers", "speedup"]
    assert [row[0] for row in rows] == [
        f"{hf_tiny.name}: import", f"{hf_tiny.name}: from_pretrained, the first in a process",
        f"{hf_tiny.name}: from_pretrained again",
        f"{hf_tiny.name}: python -m scripts.sample, 3 new tokens, loading included"]
    for _, ours, theirs, speedup in rows:
        assert float(ours) >= 0 and float(theirs) > 0 and re.fullmatch(r"\d+\.\d\dx", speedup)
    _, ours, theirs, speedup = rows[-1]  # whole processes: seconds, so 2 decimals give the ratio
    assert float(speedup[:-1]) == pytest.approx(float(theirs) / float(ours), rel=0.01)


def test_bench_sample_says_which_child_failed_in_one_line(tmp_path):
    with pytest.raises(UserError, match=f"^ours loading {tmp_path}/nowhere failed: "
                                        f"gpt2_ddp.configurator.UserError: {tmp_path}/nowhere is neither "):
        bench_sample.main(["--load", str(tmp_path / "nowhere"), "--repeats", "1"])


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


def test_the_chunked_loss_head_is_cross_entropy_of_whole_logits_and_attention_rows_print(capsys):
    """bench_kernels' chunked linear + cross-entropy against F.cross_entropy on the whole logits of
    the same bfloat16 matmul: the loss to float32 rounding (1e-6), the gradients to bfloat16's (1e-2,
    the chunks' weight gradient summed in another order); the attention rows name each kernel, one
    that does not run on the CPU said so."""
    torch.manual_seed(0)
    x, weight = torch.randn(96, 32, requires_grad=True), (torch.randn(200, 32) * 0.1).requires_grad_()
    y = torch.randint(0, 200, (96,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = F.cross_entropy((x @ weight.t()).float(), y)
    whole.backward()
    expected = (whole.detach(), x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    chunked = bench_kernels.ChunkedLinearCrossEntropy.apply(x, weight, y, 40)  # 40, 40, 16 rows
    chunked.backward()
    torch.testing.assert_close(chunked.detach(), expected[0], rtol=1e-6, atol=0)
    for got, want in zip((x.grad, weight.grad), expected[1:]):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-4)
    bench_kernels.attention_rows(type("Args", (), dict(micro_batch_size=1, n_head=2, seq_len=8, n_embd=8)),
                                 torch.device("cpu"))
    out = capsys.readouterr().out
    assert "cudnn          does not run on cpu" in out and re.search(r"flash +\d+\.\d+ +\d+\.\d+", out)
