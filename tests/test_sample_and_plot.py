"""scripts/sample.py: deterministic for a seed, streamed as drawn, from what a training run saved;
scripts/plot.py: a PNG from real training logs."""

import contextlib
import io
import json
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_gpt2
from conftest import ROOT, TINY, ctrl_c_reaches, make_shards, train_here
from gpt2_ddp import checkpoints, runs
from gpt2_ddp.configurator import UserError
from gpt2_ddp.tokenizer import gpt2_encoding
from scripts import check_equivalence, hellaswag, plot, timeline
from tests import bench_sample
from scripts.sample import main as sample_main, sample
from train_gpt2 import GPT


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The out_dir of a one-step training run (train_gpt2.main in this process) of a small model
    with GPT-2's 50257 tokens, so that every prompt's tokens fit: its ckpt_0000001.pt is what
    scripts/sample.py samples from, whatever layout train_gpt2.GPT has."""
    root = tmp_path_factory.mktemp("trained")
    make_shards(root / "data")
    train_here([*TINY, "--vocab_size=50257", "--block_size=64", "--total_batch_size=32", "--max_steps=1",
                "--eval_interval=0", f"--data_dir={root / 'data'}", f"--out_dir={root / 'out'}"])
    return root / "out"


def draw(model, seed, out=None, **kwargs):
    options = dict(max_new_tokens=24, temperature=1.0, top_k=50) | kwargs
    generator = torch.Generator().manual_seed(seed)
    return sample(model, gpt2_encoding(), "Hello, I'm", generator=generator, out=out or io.StringIO(),
                  **options)


@pytest.mark.compat
def test_the_same_seed_gives_the_same_text(trained):
    model = GPT.from_pretrained(trained)
    assert draw(model, 1) == draw(model, 1)
    assert draw(model, 1) != draw(model, 2)
    assert draw(model, 1, top_k=0, temperature=0.7) == draw(model, 1, top_k=0, temperature=0.7)
    assert draw(model, 1, top_k=0) != draw(model, 1)
    assert len(draw(model, 3, max_new_tokens=5)) == 5


def test_streamed_text_is_the_prompt_then_the_decoded_tokens(trained):
    model = GPT.from_pretrained(trained)
    flushed = []  # what a reader of a pipe has seen at each flush

    class Out(io.StringIO):
        def flush(self):
            flushed.append(self.getvalue())

    out = Out()
    tokens = draw(model, 4, out)
    expected = "Hello, I'm" + gpt2_encoding().decode_bytes(tokens).decode("utf-8", errors="replace")
    assert out.getvalue() == expected + "\n"
    assert len(flushed) == len(tokens) and flushed[0].startswith("Hello, I'm")  # one a token


def test_a_sample_that_ends_inside_a_character_ends_with_its_replacement_character(trained, monkeypatch):
    """A byte-level token can be the first byte of a character whose rest is never drawn: the
    decoder's held byte is written as U+FFFD, as bytes.decode(errors="replace") writes it."""
    model, enc = GPT.from_pretrained(trained), gpt2_encoding()
    drawn = [enc.encode_single_token(b"A"), enc.encode_single_token(b"\xe2")]
    monkeypatch.setattr(model, "generate", lambda *args: (torch.tensor(t) for t in drawn))
    out = io.StringIO()
    assert sample(model, enc, "", 2, 1.0, None, None, out) == drawn
    assert out.getvalue() == "A\ufffd\n"


def test_the_script_prints_what_the_function_draws(trained):
    proc = subprocess.run([sys.executable, "-m", "scripts.sample", str(trained), "--prompt", "Hello, I'm",
                           "--max_new_tokens", "24", "--num_samples", "2", "--seed", "7"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # stdout holds the samples alone; the out_dir's newest checkpoint is named
    assert proc.stderr == f"sampling from {checkpoints.path_of(trained, 1)}\n"
    model = GPT.from_pretrained(trained)
    generator = torch.Generator().manual_seed(7)
    expected = io.StringIO()
    for i in (1, 2):
        expected.write(f"--- sample {i} of 2\n")
        sample(model, gpt2_encoding(), "Hello, I'm", 24, 1.0, 50, generator, out=expected)
    assert proc.stdout == expected.getvalue()


def test_a_bad_source_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scripts.sample", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == (f"sample.py: error: {tmp_path} holds neither checkpoints (ckpt_NNNNNNN.pt) "
                           f"nor a Hugging Face config.json\n")


def test_a_device_this_torch_lacks_is_one_line(trained):
    count = torch.cuda.device_count()  # 0 on a CPU-only torch
    proc = subprocess.run([sys.executable, "-m", "scripts.sample", str(trained), f"--device=cuda:{count}"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == (f"sample.py: error: --device=cuda:{count}: torch sees {count} CUDA device(s) "
                           f"here; pass --device=cpu" + (f" or cuda:0 to cuda:{count - 1}" if count else "")
                           + "\n")


@pytest.mark.parametrize("main, options", [(sample_main, []), (hellaswag.main, ["--path", "nowhere.jsonl"])])
def test_a_device_that_is_no_device_is_refused_before_any_work(main, options, tmp_path):
    """Before the model loads and before HellaSwag's file is downloaded."""
    with pytest.raises(UserError, match="^--device=banana is not a device: pass cpu, cuda, cuda:N or mps$"):
        main([str(tmp_path / "nowhere"), "--device=banana", *options])


def test_a_seed_beyond_torchs_range_is_refused(trained, capsys):
    with pytest.raises(SystemExit):
        sample_main([str(trained), "--seed", str(2**64)])
    assert capsys.readouterr().err.endswith(f" error: --seed must be in [-2**63, 2**64), the range "
                                            f"torch seeds from; got {2**64}\n")
    with pytest.raises(UserError, match=rf"^--seed must be in \[0, 2\*\*63\), got {2**64}$"):
        bench_sample.main(["--devices", "cpu", "--seed", str(2**64)])


@pytest.mark.parametrize("temperature", ["inf", "nan", "0"])
def test_a_temperature_not_finite_and_positive_is_refused(trained, temperature, capsys):
    with pytest.raises(SystemExit):
        sample_main([str(trained), "--temperature", temperature, "--max_new_tokens", "5"])
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith(f" error: --temperature must be finite and > 0, got {float(temperature)}\n")


def test_a_training_sample_hands_the_model_back_in_training_mode():
    """training_sample() draws in eval mode (no dropout) and leaves every module in training mode, so
    the steps after a sample keep their dropout; its seed, not a fresh generator's default, picks the
    draw."""
    from gpt2_ddp.sampling import training_sample
    torch.manual_seed(0)
    model = GPT(train_gpt2.load_config([*TINY, "--dropout=0.5"])).train()
    args = [1, 2], 16, 0, torch.device("cpu"), contextlib.nullcontext(), lambda: None
    text = training_sample(model, *args)
    assert isinstance(text, str) and all(m.training for m in model.modules())
    assert training_sample(model.eval(), *args) == text  # the draw of the model without dropout
    assert training_sample(model, [1, 2], 16, 1, *args[3:]) != text  # the seed picks the draw


def test_a_tiny_temperature_samples_the_likeliest_tokens(trained, capsys):
    texts = []
    for options in (["--temperature", "1e-40"], ["--temperature", "1e-300"], ["--top_k", "1"]):
        sample_main([str(trained), *options, "--max_new_tokens", "8", "--device", "cpu"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2]


def test_the_model_is_compiled_with_compile_alone(trained, monkeypatch, capsys):
    compiled = []
    monkeypatch.setattr(GPT, "compile", lambda self: compiled.append(options), raising=False)
    for options in ([], ["--compile"]):  # each call records the options of the run that made it
        sample_main([str(trained), *options, "--max_new_tokens", "2", "--device", "cpu"])
    assert compiled == [["--compile"]]


def test_ctrl_c_while_sampling_is_one_line(trained):
    proc = subprocess.Popen([sys.executable, "-m", "scripts.sample", str(trained), "--max_new_tokens",
                             "1000000", "--device", "cpu"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches)
    assert proc.stdout.read(1)  # the prompt comes with the first token
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, f"sampling from {checkpoints.path_of(trained, 1)}\n"
                                           f"sample.py: interrupted\n")


def test_an_empty_or_default_prompt_starts_from_endoftext(trained, tmp_path, capsys):
    model = GPT.from_pretrained(trained)
    expected = io.StringIO()
    sample(model, gpt2_encoding(), "<|endoftext|>", 5, 1.0, 50, torch.Generator().manual_seed(1337),
           out=expected)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for prompt in ([], ["--prompt", ""], ["--prompt_file", str(empty)]):  # [], as training's default
        sample_main([str(trained), *prompt, "--max_new_tokens", "5", "--device", "cpu"])
        assert capsys.readouterr().out == expected.getvalue().removeprefix("<|endoftext|>")


def test_a_checkpoint_continues_its_runs_sample_prompt_unless_given_another(trained, tmp_path, capsys):
    """As the samples printed during training; an explicit --prompt "" starts from <|endoftext|>."""
    state = checkpoints.load(checkpoints.path_of(trained, 1))
    state["config"]["sample_prompt"] = "ROMEO:"
    checkpoints.save(checkpoints.path_of(tmp_path, 1), state)
    model = GPT.from_pretrained(trained)
    for argv, prompt in (([], "ROMEO:"), (["--prompt", ""], "<|endoftext|>")):
        expected = io.StringIO()
        sample(model, gpt2_encoding(), prompt, 5, 1.0, 50, torch.Generator().manual_seed(1337), out=expected)
        sample_main([str(tmp_path), *argv, "--max_new_tokens", "5", "--device", "cpu"])
        assert capsys.readouterr().out == expected.getvalue().removeprefix("<|endoftext|>")


def test_a_top_k_above_the_vocabulary_samples_from_all_of_it(trained, capsys):
    texts = []
    for top_k in ("100000", "0", "50"):
        sample_main([str(trained), "--top_k", top_k, "--max_new_tokens", "5", "--device", "cpu"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2]


def test_a_prompt_file_that_is_missing_or_not_utf8_is_refused(trained, tmp_path):
    path = tmp_path / "prompt.txt"
    with pytest.raises(UserError, match=f"^cannot read --prompt_file {path}: No such file or directory$"):
        sample_main([str(trained), "--prompt_file", str(path)])
    path.write_bytes(b"caf\xe9")  # Latin-1
    with pytest.raises(UserError, match=f"--prompt_file {path} is not UTF-8 text \\(byte 3\\): "
                                        f"save it as UTF-8"):
        sample_main([str(trained), "--prompt_file", str(path)])


def test_plot_writes_a_png_of_real_runs(equiv_runs, equiv_runs_dir, tmp_path):
    out = tmp_path / "runs.png"
    plot.main([str(equiv_runs_dir / "world_size_1"), str(equiv_runs_dir / "world_size_2" / "log.jsonl"),
               "--out", str(out)])
    png = out.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    assert not list(tmp_path.glob("*.tmp"))
    assert plot.pyplot().get_fignums() == []  # closed once written


def write_log(run_dir, records):
    run_dir.mkdir()
    (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    run = write_log(tmp_path / "run", [{"step": 0, "loss": 3.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(UserError, match="matplotlib is not installed: pip install matplotlib"):
        plot.main([str(run), "--out", str(tmp_path / "p.png")])


def test_plot_to_a_directory_or_where_it_cannot_write_is_one_line(tmp_path):
    run = write_log(tmp_path / "run", [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.5}])
    proc = subprocess.run([sys.executable, "-m", "scripts.plot", str(run), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == f"plot.py: error: {tmp_path} is a directory: pass --out the path of a PNG file\n"
    out = run / "log.jsonl" / "plot.png"  # under a file: run as root, a read-only directory would not stop it
    with pytest.raises(UserError, match=f"^cannot write {out}: Not a directory; pass --out a path you "
                                        f"can write$"):
        plot.main([str(run), "--out", str(out)])
    assert sorted(p.name for p in run.iterdir()) == ["log.jsonl"]
    assert plot.pyplot().get_fignums() == []  # closed after a failed write too


@pytest.mark.parametrize("record", [[0, 3.0], {"loss": 3.0}, {"step": 1, "loss": "3.0"}, {"step": 1e400},
                                    {"step": 10**400}, {"step": 1, "mfu": 10**400}])
def test_plot_skips_a_record_that_is_not_train_gpt2s_with_a_warning(tmp_path, record, capsys,
                                                                   monkeypatch):
    saved = []
    monkeypatch.setattr(plot, "save_png", lambda fig, out: saved.append(out))
    run = write_log(tmp_path / "run", [{"step": 0, "loss": 3.0, "mfu": None}, record])
    plot.main([str(run)])
    assert capsys.readouterr().err == (f"warning: {run / 'log.jsonl'}: skipped 1 line that is not a "
                                       f"record of train_gpt2.py (line 2)\n")
    assert saved == [run / "plot.png"]
    (run / "log.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(UserError, match=f"^{run / 'log.jsonl'} holds no line that is a record of "
                                        f"train_gpt2.py: not a log.jsonl of train_gpt2.py\\?$"):
        plot.main([str(run)])


def test_a_torn_line_in_a_log_is_skipped_with_a_warning(tmp_path, capsys):
    """A full disk cut a record short and the next one went on the same line: the line is lost,
    the rest kept. A last line not yet ended (a run being written or killed) goes silently. Of many
    such lines the first ten are named, where a reader starts looking."""
    lines = [json.dumps({"step": step, "loss": 3.0, "dt_ms": 75.23}) for step in range(1, 6)]
    log = tmp_path / "log.jsonl"
    log.write_text(f"{lines[0]}\n{lines[1][:-1]}{lines[2]}\n{lines[3]}\n[]\n{lines[4]}\n")
    assert [r["step"] for r in runs.read_log(tmp_path)] == [1, 4, 5]
    assert capsys.readouterr().err == (f"warning: {log}: skipped 2 lines that are not a JSON object "
                                       f"(lines 2, 4)\n")
    log.write_text("[]\n" * 12 + f"{lines[0]}\n")
    assert [r["step"] for r in runs.read_log(log)] == [1]
    assert capsys.readouterr().err == (f"warning: {log}: skipped 12 lines that are not a JSON object "
                                       f"(lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ...)\n")
    log.write_text("[]\n" * 10 + f"{lines[0]}\n")  # ten named are all of them: no "..."
    runs.read_log(log)
    assert capsys.readouterr().err.endswith("(lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)\n")
    log.write_text(f"{lines[0]}\n{lines[1][:20]}")
    assert [r["step"] for r in runs.read_log(log)] == [1] and capsys.readouterr().err == ""
    log.write_text("")
    with pytest.raises(UserError, match=f"^{log} holds no line that is a JSON object"):
        runs.read_log(log)
    log.write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(UserError, match=f"^{log} is not text: not a log.jsonl\\?$"):
        runs.read_log(log)
    log.unlink()
    with pytest.raises(UserError, match=f"^cannot read {log}: No such file or directory$"):
        runs.read_log(tmp_path)


def test_check_equivalence_of_one_world_size_is_refused_before_any_run(tmp_path):
    for sizes in (["1"], ["2", "2"]):
        with pytest.raises(UserError, match=f"^--world_sizes {' '.join(sizes)} compares nothing: pass "
                                            f"two or more different ones \\(--world_sizes 1 2\\) or "
                                            f"another --python$"):
            check_equivalence.main(["--world_sizes", *sizes, f"--out_dir={tmp_path}",
                                    f"--data_dir={tmp_path / 'none'}"])
    assert list(tmp_path.iterdir()) == []


def test_timeline_of_a_file_that_is_not_a_trace_or_to_a_directory_is_one_line(tmp_path, capsys):
    trace = tmp_path / "trace_rank0.json"
    with pytest.raises(UserError, match=f"^cannot read {trace}: No such file or directory$"):
        timeline.main([str(trace)])
    trace.write_text("[]")
    with pytest.raises(UserError, match=f"^{trace} holds no traceEvents list: not a trace of train_gpt2.py$"):
        timeline.main([str(trace)])
    trace.write_text("{")  # found in the run's directory, the message names the file
    with pytest.raises(UserError, match=f"^{trace} is not JSON \\(.+\\): not a trace of "
                                        f"train_gpt2.py$"):
        timeline.main([str(tmp_path)])
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "forward", "ts": 0, "dur": 1}]}))
    with pytest.raises(UserError, match="^no ProfilerStep in the trace: was it written by train_gpt2.py "
                                        "--profile=true\\?$"):
        timeline.main([str(trace)])
    step = {"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 10}
    trace.write_text(json.dumps({"traceEvents": [step, 7, {"ph": "X", "name": "forward", "ts": "1"}]}))
    with pytest.raises(UserError, match=f"^{tmp_path} is a directory: pass --out the path of a PNG file$"):
        timeline.main([str(trace), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        timeline.main([str(trace), "--steps", "0"])
    assert capsys.readouterr().err.endswith(" error: --steps must be >= 1, got 0\n")


def test_timeline_draws_the_first_steps_profiled_steps(tmp_path, monkeypatch, capsys):
    """--steps N draws the ranges of the first N profiled steps, all of them where fewer were profiled,
    timed from the first step's start; the script draws each rank's trace beside them by default."""
    events = []
    for step in range(3):  # steps of 100 us holding a forward range each, apart from the step before
        start = 1000 + 200 * step
        events += [{"ph": "X", "name": f"ProfilerStep#{step}", "ts": start, "dur": 100},
                   {"ph": "X", "name": "forward", "cat": "user_annotation", "ts": start + 10, "dur": 50}]
    for steps, starts in ((1, [0.01]), (2, [0.01, 0.21]), (5, [0.01, 0.21, 0.41])):
        compute, _ = timeline.lanes({"traceEvents": events}, steps)
        assert [start for _, start, _ in compute] == pytest.approx(starts), steps
    for rank in (0, 1):
        (tmp_path / f"trace_rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
    titles = []
    monkeypatch.setattr(timeline, "save_png", lambda fig, out: titles.append((fig.axes[0].get_title(), out)))
    timeline.main([str(tmp_path), "--steps", "2"])
    timeline.main([str(tmp_path)])  # one step by default
    assert titles == [("2 rank(s), 2 profiled step(s)", tmp_path / "timeline.png"),
                      ("2 rank(s), 1 profiled step(s)", tmp_path / "timeline.png")]
    assert capsys.readouterr().out == f"wrote {tmp_path / 'timeline.png'}\n" * 2


def test_timelines_legend_names_every_kind_inside_the_figure(monkeypatch):
    """The legend's row of compute and collective kinds lies below the x axis's label and wholly inside
    the saved figure, for few ranks and for many (the figure's height grows with them)."""
    step = {"ph": "X", "name": "ProfilerStep#0", "ts": 1000, "dur": 100}
    figures = []
    monkeypatch.setattr(timeline, "save_png", lambda fig, out: figures.append(fig))
    for ranks in (1, 8):
        timeline.draw({rank: {"traceEvents": [step]} for rank in range(ranks)}, "unused.png", 1, None)
        figure = figures[-1]
        figure.tight_layout()  # as save_png lays it out
        figure.canvas.draw()
        legend = figure.axes[0].get_legend()
        assert len(legend.get_texts()) == len(timeline.COMPUTE) + len(timeline.COLLECTIVES)
        box, label = legend.get_window_extent(), figure.axes[0].xaxis.label.get_window_extent()
        assert 0 <= box.x0 < box.x1 <= figure.bbox.x1 and 0 <= box.y0 < box.y1 < label.y0, ranks


def test_timeline_draws_the_gpus_ranges_where_the_trace_has_them():
    """A GPU's trace holds each range twice, as the CPU launched it and as the GPU ran it: the
    lanes show the GPU's, and the collectives are its NCCL kernels, not the CPU's calls of them."""
    step = {"ph": "X", "name": "ProfilerStep#0", "ts": 1000, "dur": 500}
    launched = {"ph": "X", "name": "forward", "cat": "user_annotation", "ts": 1010, "dur": 50}
    ran = {"ph": "X", "name": "forward", "cat": "gpu_user_annotation", "ts": 1100, "dur": 80}
    nccl = {"ph": "X", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", "cat": "kernel",
            "ts": 1200, "dur": 50}
    issued = {"ph": "X", "name": "c10d::allreduce_", "cat": "cpu_op", "ts": 1150, "dur": 5}  # the CPU's call
    recorded = {"ph": "X", "name": "nccl:all_reduce", "cat": "cpu_op", "ts": 1151, "dur": 3}  # and its record
    compute, comm = timeline.lanes({"traceEvents": [step, launched, ran, issued, recorded, nccl]}, 1)
    assert compute == [("forward", pytest.approx(0.1), pytest.approx(0.08))]
    assert comm == [("all_reduce", pytest.approx(0.2), pytest.approx(0.05))]


def test_hellaswag_path_of_a_directory_is_one_line_and_only_a_missing_one_is_downloaded(tmp_path,
                                                                                        monkeypatch):
    with pytest.raises(UserError, match=f"^--path {tmp_path} is a directory: pass the validation "
                                        f"jsonl's path$"):
        hellaswag.main(["gpt2", "--path", str(tmp_path), "--device", "cpu"])
    downloads = []

    def download(path):  # offline here: record where it would go
        downloads.append(path)
        raise UserError("offline")

    monkeypatch.setattr(hellaswag.hellaswag, "download", download)
    path = tmp_path / "val.jsonl"
    with pytest.raises(UserError, match="^offline$"):
        hellaswag.main(["gpt2", "--path", str(path), "--device", "cpu"])
    path.write_text("")  # there: read, not downloaded again
    with pytest.raises(UserError, match="holds no examples"):
        hellaswag.main(["gpt2", "--path", str(path), "--device", "cpu"])
    assert downloads == [str(path)]
    monkeypatch.chdir(tmp_path)  # by default, the file that training downloads
    with pytest.raises(UserError, match="^offline$"):
        hellaswag.main(["gpt2", "--device", "cpu"])
    assert downloads[1:] == [train_gpt2.Config.hellaswag_path]


def test_panels_without_data_are_left_out_and_the_hellaswag_references_drawn_beside_data_only(
        tmp_path, monkeypatch):
    """A CPU run's log (no HellaSwag, no MFU) gets the four panels it has data for."""
    figures = []
    monkeypatch.setattr(plot, "save_png", lambda fig, out: figures.append(fig))
    steps = [{"step": 1, "loss": 3.0, "lr": 1e-3, "tokens_per_sec": 1e3, "grad_norm": 1.0}]
    plot.plot({"run": steps}, tmp_path / "plot.png")
    plot.plot({"run": [*steps, {"step": 1, "hellaswag_acc_norm": 0.3}]}, tmp_path / "plot.png")
    titles = [[ax.get_title() for ax in fig.axes] for fig in figures]
    assert titles[0] == ["loss", "learning rate", "tokens/s", "gradient norm"]
    assert titles[1] == ["loss", "HellaSwag acc_norm", "learning rate", "tokens/s", "gradient norm"]
    assert len(figures[1].axes[1].lines) == 3  # the run's and GPT-2's and GPT-3's references
    assert figures[0].axes[0].get_shared_x_axes().joined(figures[0].axes[0], figures[0].axes[3])
    assert all(ax.yaxis.get_gridlines()[0].get_visible() for ax in figures[0].axes)  # each panel gridded
    plot.plot({"run": [{**steps[0], "mfu": 0.4}]}, tmp_path / "plot.png")  # MFU is drawn in percent
    mfu = figures[2].axes[3]
    assert mfu.get_title() == "MFU (%)" and list(mfu.lines[0].get_ydata()) == [40.0]
    plot.plot({"run": [{"step": 1, "lr": 1e-3}]}, tmp_path / "plot.png")  # the loss panel stays, empty
    empty = figures[3].axes[0]
    assert [text.get_text() for text in empty.texts] == ["no loss in these logs"]
    note = empty.texts[0]  # in the middle of the panel, whatever its axes' limits
    assert note.get_position() == (0.5, 0.5) and note.get_transform() == empty.transAxes
    assert (note.get_horizontalalignment(), note.get_verticalalignment()) == ("center", "center")


def test_a_logged_number_without_a_panel_gets_a_panel_titled_by_its_key(tmp_path, monkeypatch):
    """A fork's `z_loss` and Muon's `muon_lr` get a panel each, in the order the log first holds
    them, with their numbers at their steps; bools, text, the numbers shown elsewhere (val_loss,
    dt_ms) and the once-logged optimizer_state_bytes get none."""
    figures = []
    monkeypatch.setattr(plot, "save_png", lambda fig, out: figures.append(fig))
    steps = [{"step": 1, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "dt_ms": 75.0, "muon_lr": 0.02,
              "optimizer_state_bytes": 4096, "skipped": True, "note": "text"},
             *({"step": s, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "dt_ms": 75.0, "muon_lr": 0.02,
                "z_loss": 40.0 + s} for s in (2, 3)),
             {"step": 3, "val_loss": 2.5}, {"step": 4, "z_loss": "n/a"}, {"step": 5, "z_loss": None}]
    plot.main([str(write_log(tmp_path / "run", steps))])
    titles = [ax.get_title() for ax in figures[0].axes]
    assert titles == ["loss", "learning rate", "gradient norm", "muon_lr", "z_loss"]
    (z_loss,) = figures[0].axes[4].lines
    assert list(z_loss.get_xdata()) == [2, 3] and list(z_loss.get_ydata()) == [42.0, 43.0]


def test_logs_in_directories_of_one_name_are_each_drawn_under_a_label_of_their_own(tmp_path, monkeypatch,
                                                                                  capsys):
    """Three out_dirs all named `run` (in other parents) are three runs: run, run' and run'', drawn
    by default into plot.png beside the first."""
    saved = []
    monkeypatch.setattr(plot, "save_png", lambda fig, out: saved.append((fig, out)))
    logs = []
    for i, parent in enumerate("abc"):
        (tmp_path / parent).mkdir()
        logs.append(write_log(tmp_path / parent / "run", [{"step": 1, "val_loss": 3.0 - i}]))
    plot.main([str(log) for log in logs])
    [(figure, out)] = saved
    assert [line.get_label() for line in figure.axes[0].lines] == ["run val", "run' val", "run'' val"]
    assert out == logs[0] / "plot.png" and capsys.readouterr().out == f"wrote {out}\n"


def test_a_skipped_step_or_a_log_of_val_losses_alone_keeps_its_curves(tmp_path, monkeypatch):
    """A NaN or infinite loss is a gap in the raw and smoothed curves, not their end; a log with
    val losses alone draws them."""
    figures = []
    monkeypatch.setattr(plot, "save_png", lambda fig, out: figures.append(fig))
    losses = [3.0, float("nan"), 2.9, float("inf"), *np.linspace(2.8, 2.0, 96)]
    plot.plot({"run": [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]},
              tmp_path / "plot.png")
    plot.plot({"run": [{"step": 50, "val_loss": 3.0}, {"step": 100, "val_loss": 2.5}]},
              tmp_path / "plot.png")
    raw, smoothed = figures[0].axes[0].lines
    assert len(smoothed.get_ydata()) == 98 and np.isfinite(smoothed.get_ydata()).all()
    assert list(raw.get_xdata()[:3]) == [1, 3, 5]
    (val,) = figures[1].axes[0].lines
    assert list(val.get_ydata()) == [3.0, 2.5] and not figures[1].axes[0].texts


def test_the_loss_axis_leaves_out_the_first_steps_fall(tmp_path, monkeypatch):
    """A run whose loss falls from 11 to 6 in its first steps and then to 5: the axis shows 5 to 6,
    not 11, and the first steps' curve runs off its top; the learning rate's axis keeps its own range.
    The smoothed curve is the mean of the last 4 steps (a 50th of the run), of fewer over the first 3."""
    figures = []
    monkeypatch.setattr(plot, "save_png", lambda fig, out: figures.append(fig))
    losses = [11.0 - i for i in range(5)] + list(np.linspace(6.0, 5.0, 195))
    plot.plot({"run": [{"step": i + 1, "loss": loss, "lr": 6e-4} for i, loss in enumerate(losses)]},
              tmp_path / "plot.png")
    low, high = figures[0].axes[0].get_ylim()
    assert 4.8 < low < 5.0 and 6.0 < high < 6.5
    low, high = figures[0].axes[1].get_ylim()
    assert figures[0].axes[1].get_title() == "learning rate" and low < 6e-4 < high < 1e-3
    raw, smoothed = figures[0].axes[0].lines
    means = [np.mean(losses[max(0, k - 3):k + 1]) for k in range(200)]
    np.testing.assert_allclose(smoothed.get_ydata(), means, rtol=1e-12)
    plot.plot({"run": [{"step": i + 1, "loss": 3.0} for i in range(10)]}, tmp_path / "plot.png")
    assert figures[1].axes[0].get_ylim() == pytest.approx((3.0 - 0.05, 3.0 + 0.2))  # flat: a unit span
    assert figures[1].get_size_inches()[0] == 5  # one panel, one column wide
