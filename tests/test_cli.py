"""The command lines: options spelled with underscores (hyphens accepted), --help texts that show
what the source says, and scripts that show which run and step they are on."""

import dataclasses
import importlib
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib

import pytest
import torch

from conftest import ROOT, TINY
from gpt2_ddp import configurator
from gpt2_ddp import runs
from gpt2_ddp.configurator import UserError, help_lines
import prepare_data
from scripts.check_equivalence import main as check_equivalence_main
import train_gpt2

SCRIPTS = ["prepare_data", *(f"scripts.{name}" for name in (
    "hellaswag", "memory_plan", "bench", "check_equivalence", "export_hf", "plot", "sample", "timeline")),
    "tests.bench_sample"]


def test_hyphen_spellings_parse_as_the_underscore_options():
    underscores = ["--output_dir", "d", "--val_tokens", "5", "--text_field=body", "--skip_bad_files",
                   "--shard_size", "1e3", "--dataset", "x/y", "--dataset_config", "c"]
    hyphens = ["--output-dir", "d", "--val-tokens", "5", "--text-field=body", "--skip-bad-files",
               "--shard-size", "1e3", "--dataset", "x/y", "--dataset-config", "c"]
    args = prepare_data._parse_args(underscores)
    assert (args.output_dir, args.val_tokens, args.text_field, args.shard_size) == ("d", 5, "body", 1000)
    assert prepare_data._parse_args(hyphens) == args

    # train_gpt2.py's overrides: a hyphen maps to the key's underscore
    assert (train_gpt2.load_config(["--max-steps=7", "--micro-batch-size=3", "--exact-reduction=true"])
            == train_gpt2.load_config(["--max_steps=7", "--micro_batch_size=3", "--exact_reduction=true"]))
    with pytest.raises(UserError, match="unknown config key 'max_stepz'; did you mean 'max_steps'"):
        train_gpt2.load_config(["--max-stepz=7"])


def test_arguments_passed_on_to_train_gpt2_stay_as_given():
    """A script's parser rewrites only its own options: a config key that an option of the script
    starts with is no abbreviation of it, and what follows -- is left alone."""
    parser = configurator.ArgumentParser()
    parser.add_argument("--micro_batch_sizes", type=int, nargs="*", default=[])
    args, rest = parser.parse_known_args(["--micro_batch_size=4", "--micro-batch-sizes", "1", "2",
                                          "--max-steps=3", "--", "--micro-batch-sizes"])
    assert args.micro_batch_sizes == [1, 2]
    assert rest == ["--micro_batch_size=4", "--max-steps=3", "--", "--micro-batch-sizes"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_shows_underscore_options_and_the_docstring_lines_as_written(name, capsys):
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and not out.endswith("\n\n"), out[-80:]  # no blank line after the help
    assert not re.findall(r"--[a-z0-9]+-\w+", out), out
    # argparse would refill a description, running example commands into each other
    source = inspect.getsource(module)
    assert all(line.strip() in source for line in out.split("\n\n")[1].splitlines()), out


@pytest.mark.parametrize("name", [name for name in SCRIPTS if name.startswith("scripts.")
                                  and name not in ("scripts.bench", "scripts.check_equivalence")])
def test_help_shows_the_scripts_example_commands(name, capsys):
    """A script's --help shows its docstring's example commands, each line as written (bench and
    check_equivalence, with usage lines of their own, show their first paragraph)."""
    module = importlib.import_module(name)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    out = capsys.readouterr().out
    examples = [line.strip() for line in module.__doc__.split("\n\n")[1].splitlines()]
    assert any(line.startswith(f"python -m {name}") for line in examples) and all(
        line in out for line in examples)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_says_what_every_option_does_and_its_default(name, monkeypatch):
    """A default of None, False or [] (off unless given) goes unsaid; any other shows in --help."""
    parsers = []
    monkeypatch.setattr(configurator.ArgumentParser, "print_help",
                        lambda self, file=None: parsers.append(self) or sys.exit(0))
    with pytest.raises(SystemExit):
        importlib.import_module(name).main(["--help"])
    formatter = parsers[0]._get_formatter()
    for action in parsers[0]._actions[1:]:  # after --help
        assert action.help, action.option_strings
        if action.default is not None and action.default is not False and action.default != []:
            assert "default" in formatter._get_help_string(action), action.option_strings


@pytest.mark.parametrize("name", ["train_gpt2", *SCRIPTS])
def test_docstrings_hold_no_line_continued_by_a_backslash(name):
    """A backslash at a line's end in a plain docstring joins the lines, indentation and all,
    as it did in train_gpt2.py --help."""
    module = importlib.import_module(name)
    source_lines = {line.strip() for line in inspect.getsource(module).splitlines()}
    assert all(line.strip() in source_lines for line in module.__doc__.splitlines())


@dataclasses.dataclass
class Knobs:
    flag: bool = True  # a switch
    off: bool = False  # another
    prompt: str = "Hello, I'm a model,"  # a string with spaces, in quotes
    empty: str = ""  # nothing, which bare would be invisible
    tricky: str = 'say "hi"\\\t\x7f'  # escapes
    steps: int = 19073  # a count
    lr: float = 6e-4  # a rate
    path: str = "data/hellaswag/hellaswag_val.jsonl"  # longer than 40 characters with its key
    note: int = 1  # a description long enough to wrap onto a second line in 72 columns


def test_help_lines_write_defaults_as_toml_in_one_column():
    assert "\n".join(help_lines(Knobs, width=72)) == r"""
  --flag=true                      a switch
  --off=false                      another
  --prompt="Hello, I'm a model,"   a string with spaces, in quotes
  --empty=""                       nothing, which bare would be
                                   invisible
  --tricky="say \"hi\"\\\t\u007f"  escapes
  --steps=19073                    a count
  --lr=0.0006                      a rate
  --path="data/hellaswag/hellaswag_val.jsonl"
                                   longer than 40 characters with its
                                   key
  --note=1                         a description long enough to wrap
                                   onto a second line in 72 columns""".strip("\n")
    assert tomllib.loads(r'v = "say \"hi\"\\\t\u007f"')["v"] == Knobs.tricky


@dataclasses.dataclass
class Forty:
    key_whose_help_line_reaches_column: int = 1  # its line, 40 characters to the "=1", sets the column
    accented: str = "café"  # written as it reads, not escaped
    key_one_character_past_the_fortieth: int = 1  # on a line of its own, as any longer key


def test_help_lines_fill_the_terminal_less_2_and_a_key_of_40_characters_sets_the_column(monkeypatch):
    """Without a width, the lines fill the terminal less 2; a key's line of 40 characters sets the
    column."""
    monkeypatch.setattr(configurator.shutil, "get_terminal_size", lambda: os.terminal_size((75, 24)))
    assert max(map(len, help_lines(Knobs))) == 73  # two descriptions fill 73 columns exactly
    assert help_lines(Forty, width=200) == [
        "  --key_whose_help_line_reaches_column=1  its line, 40 characters to the \"=1\", sets the column",
        '  --accented="café"'.ljust(42) + "written as it reads, not escaped",
        "  --key_one_character_past_the_fortieth=1", " " * 42 + "on a line of its own, as any longer key"]


def test_train_gpt2_help_values_read_back_as_the_defaults_in_toml():
    lines = help_lines(train_gpt2.Config, width=100)
    keys = [line for line in lines if line.startswith("  --")]
    assert len(keys) == len(dataclasses.fields(train_gpt2.Config))
    columns = set()
    for line, field in zip(keys, dataclasses.fields(train_gpt2.Config)):
        match = re.fullmatch(r'  --(\w+)=("(?:[^"\\]|\\.)*"|\S+)(?: +(.+))?', line)
        assert match[1] == field.name
        assert tomllib.loads(f"v = {match[2]}")["v"] == field.default
        if match[3]:
            columns.add(match.start(3))
    assert len(columns) == 1
    assert all(len(line) <= 100 and line == line.rstrip() for line in lines)


@pytest.mark.parametrize("name, argv, message", [
    ("scripts.check_equivalence", ["--world_sizes", "1", "0"], "--world_sizes must be >= 1"),
    ("scripts.bench", ["--nproc", "0"], "--nproc must be >= 1, got 0"),
])
def test_a_world_size_below_1_is_one_line_before_any_run(name, argv, message, capsys):
    """torchrun itself answers --nproc_per_node=0 with a traceback."""
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(name).main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")


@pytest.mark.parametrize("name, argv, message", [
    ("scripts.sample", ["out/x", "--top_k", "-3"], "--top_k must be >= 0 (0: all), got -3"),
    ("scripts.sample", ["out/x", "--num_samples", "0"], "--num_samples must be >= 1, got 0"),
    ("scripts.sample", ["out/x", "--max_new_tokens", "-1"], "--max_new_tokens must be >= 0, got -1"),
    ("scripts.sample", ["out/x", "--temperature", "0"], "--temperature must be finite and > 0, got 0.0"),
    ("scripts.bench", ["--steps", "0"], "--steps must be >= 1, got 0"),
])
def test_an_option_that_breaks_its_rule_is_one_line_naming_it_its_value_and_the_rule(name, argv, message,
                                                                                      capsys):
    """The error names the one option at fault, not every option's rule."""
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(name).main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f" error: {message}")


def test_check_equivalence_shows_the_run_and_step_it_is_on(tiny_data, tmp_path, capsys):
    check_equivalence_main(["--world-sizes", "1", "--python", sys.executable, "--out-dir", str(tmp_path),
                            *TINY, f"--data-dir={tiny_data}", "--total-batch-size=32", "--max-steps=1"])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == "world size 1: started"
    assert re.search(r"^world size 1: step +\d+/1 \| loss", err, re.M), err
    assert re.search(r"^world size 1: step +\d+ \| val loss", err, re.M), err
    assert re.fullmatch(r"world size 1: finished in \d+ s", lines[4])
    assert re.fullmatch(rf"torch {re.escape(torch.__version__)}, world size 1: finished in \d+ s", lines[-1])
    assert "world size 1: max |diff| of loss 0.00e+00" in out
    assert (tmp_path / "world_size_1" / "log.jsonl").exists()


def test_a_python_that_cannot_run_or_import_torch_is_refused_before_any_run(tmp_path, monkeypatch):
    from scripts import check_equivalence
    monkeypatch.setattr(check_equivalence, "compare", lambda *args: pytest.fail("a run started"))
    missing = tmp_path / "missing" / "python"
    with pytest.raises(UserError, match=f"^cannot run --python {missing}: No such file or directory$"):
        check_equivalence.main(["--world_sizes", "1", "--python", str(missing), f"--out_dir={tmp_path}"])
    broken = tmp_path / "python"  # its last line of stderr says why
    broken.write_text("#!/bin/sh\necho Traceback >&2\necho '  File \"<string>\", line 1' >&2\n"
                      "echo 'ModuleNotFoundError: torch' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(UserError, match=f"^{broken} cannot import torch \\(ModuleNotFoundError: torch\\): "
                                        f"install torch and requirements.txt into it$"):
        check_equivalence.main(["--world_sizes", "1", "2", "--python", str(broken), f"--out_dir={tmp_path}"])


def test_check_equivalence_trains_world_sizes_1_2_and_4_without_world_sizes(tmp_path, monkeypatch):
    """With no --world_sizes the check compares world sizes 1, 2 and 4 (the README's promise), writing
    under --out_dir, and passes train_gpt2 every other argument."""
    from scripts import check_equivalence
    calls = []

    class Stop(Exception):
        pass

    def compare(train_args, world_sizes, out_root):
        calls.append((train_args, world_sizes, out_root))
        raise Stop

    monkeypatch.setattr(check_equivalence, "compare", compare)
    with pytest.raises(Stop):
        check_equivalence.main(["configs/shakespeare_cpu.toml", "--max_steps=3", f"--out_dir={tmp_path}"])
    assert calls == [(["configs/shakespeare_cpu.toml", "--max_steps=3"], [1, 2, 4], str(tmp_path))]


def test_a_gradient_norm_difference_alone_fails_check_equivalence_with_python(tmp_path, monkeypatch, capsys):
    """With --python, a gradient norm that differs by more than --tolerance (relative) exits 1
    though every loss is equal, also where only the first of two world sizes differs; within the
    tolerance it exits 0. The runs are made-up results."""
    from scripts import check_equivalence
    # the other's norm below ours, where a signed difference would read as none
    grad_norms = {sys.executable: [1.0, 2.0], "other": [1.0, 2.0 * (1 - 1e-3)]}

    def compare(train_args, world_sizes, out_root, python=sys.executable, label=""):
        return {n: {"step": [1, 2], "loss": [6.0, 5.0 - 0.25 * (n - 1)], "val_loss": [5.5], "hellaswag": [],
                    "grad_norm": grad_norms[python if n == 1 else sys.executable],  # world size 1's alone
                    "model": {"w": torch.zeros(2)}, "max_param_diff": 0.5 * (n - 1)} for n in world_sizes}

    monkeypatch.setattr(check_equivalence, "compare", compare)
    monkeypatch.setattr(check_equivalence, "torch_version", lambda python: "0.0")
    argv = ["--world_sizes", "1", "--python", "other", f"--out_dir={tmp_path}"]
    assert check_equivalence.main([*argv, "--tolerance=1e-4"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "torch 0.0, world size 1: max |diff| of loss 0.00e+00, grad norm 2.00e-03, val loss 0.00e+00, "
        "weights 0.00e+00",
        f"largest relative loss or grad norm difference to torch {torch.__version__}: 1.00e-03, OVER the "
        f"tolerance 1e-04"]
    assert check_equivalence.main([*argv, "--tolerance=1e-2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(": 1.00e-03, within the tolerance 1e-02")
    assert check_equivalence.main(["--world_sizes", "1", "2", *argv[2:], "--tolerance=1e-4"]) == 1
    # the world sizes' table: each step's |diff| to world size 1, then each quantity's largest
    assert capsys.readouterr().out.splitlines()[:7] == [
        " step |    loss (world size 1) |    |diff| world size 2",
        "    1 |            6.000000000 |              0.000e+00",
        "    2 |            5.000000000 |              2.500e-01",
        "max |diff| of loss    : world size 2: 2.500e-01",
        "max |diff| of val_loss: world size 2: 0.000e+00",
        "max |diff| of weights : world size 2: 5.000e-01",
        "the differences are float rounding: each world size sums the micro-batches' gradients in another "
        "order, and training amplifies the last-bit differences over steps; --exact_reduction=true sums in "
        "float64 and makes the runs bitwise identical"]
    # the weights' difference is the largest of any tensor's, in either direction
    zeros = {"a": torch.zeros(2), "b": torch.zeros(2)}
    assert check_equivalence.max_diff({"a": torch.zeros(2), "b": torch.tensor([1.0, -3.0])}, zeros) == 3.0
    grad_norms["other"] = [1.0, 1.5]  # 0.5 / 2.0: a difference of exactly the tolerance is within it
    assert check_equivalence.main([*argv, "--tolerance=0.25"]) == 0


def test_world_size_1_runs_as_plain_python_and_more_under_torchrun(tmp_path):
    """runs.command: one process is `python train_gpt2.py`, two or torchrun=True go under torchrun;
    runs.train launches what command() gives for its torchrun=."""
    script = str(ROOT / "train_gpt2.py")
    assert runs.command(["--max_steps=1"], 1) == [sys.executable, script, "--max_steps=1"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert runs.command(["--max_steps=1"], 2) == [*torchrun, "--nproc_per_node=2", script, "--max_steps=1"]
    assert runs.command([], 1, torchrun=True) == [*torchrun, "--nproc_per_node=1", script]
    fake_python = tmp_path / "python"  # prints the arguments runs.train gives it
    fake_python.write_text('#!/bin/sh\necho "$@"\n')
    fake_python.chmod(0o755)
    launched = runs.train([], python=str(fake_python), torchrun=True).stdout
    assert launched == f"-m torch.distributed.run --standalone --nproc_per_node=1 {script}\n"


def test_a_run_past_its_timeout_is_killed_with_its_output_so_far(tmp_path, capsys):
    fake_python = tmp_path / "python"  # runs.train calls it with train_gpt2.py's path
    fake_python.write_text('#!/bin/sh\necho "step     0 | loss 6.2"\necho warning >&2\nexec sleep 60\n')
    fake_python.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        runs.train([], python=str(fake_python), timeout=1, progress="fake")
    assert time.monotonic() - start < 10
    assert (info.value.output, info.value.stderr) == ("step     0 | loss 6.2\n", "warning\n")
    assert capsys.readouterr().err == "fake: started\nfake: step     0 | loss 6.2\n"


def test_a_stopped_command_that_ignores_sigterm_is_killed_after_the_grace(monkeypatch):
    """A stop signal passes SIGTERM on to the command; one that ignores it is killed STOP_GRACE_S
    later and reaped, so a stopped script never leaves it running."""
    monkeypatch.setattr(runs, "STOP_GRACE_S", 0.5)
    pids, unstopped = [], signal.getsignal(signal.SIGTERM)

    def stop_once_started(line, from_stdout):  # the command has printed its pid: stop this process
        pids.append(int(line))
        deadline = time.monotonic() + 10
        while signal.getsignal(signal.SIGTERM) == unstopped and time.monotonic() < deadline:
            time.sleep(0.01)  # the reader can start before stream() sets its handler
        os.kill(os.getpid(), signal.SIGTERM)

    start = time.monotonic()
    with pytest.raises(SystemExit) as info:
        runs.stream(["sh", "-c", 'trap "" TERM; echo $$; exec sleep 60'], stop_once_started)
    assert info.value.code == 128 + signal.SIGTERM and time.monotonic() - start < 10
    with pytest.raises(ProcessLookupError):  # killed and reaped: no process, not even a zombie
        os.kill(pids[0], 0)


def test_a_run_killed_by_a_signal_is_a_failure_with_its_output(tmp_path):
    """A run that a signal ends (exit status -9 for SIGKILL, as the out-of-memory killer's) fails
    runs.train with its code and output, as a non-zero exit does; it is no success."""
    fake_python = tmp_path / "python"  # runs.train calls it with train_gpt2.py's path
    fake_python.write_text('#!/bin/sh\necho "step     1 | loss 6.2"\nkill -9 $$\n')
    fake_python.chmod(0o755)
    with pytest.raises(UserError, match=r"train_gpt2.py failed \(-9\):\nstep     1 \| loss 6.2\n"):
        runs.train([], python=str(fake_python), timeout=60)


def test_a_command_runs_in_the_repository_root_from_any_working_directory(tmp_path, monkeypatch):
    """The scripts launch `train_gpt2.py` and `-m scripts.NAME` by paths relative to the root."""
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = runs.stream([sys.executable, "-c", "import os; print(os.getcwd())"], lambda *a: None)
    assert (code, stdout) == (0, f"{ROOT}\n")


def test_a_streamed_command_leaves_the_stop_signal_handlers_as_it_found_them():
    """A script's Ctrl-C after its runs must not stop a command that has ended."""
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    assert runs.stream(["true"], lambda *a: None) == (0, "", "")
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == before


def test_a_command_streamed_from_a_worker_thread_runs_with_no_signal_handlers():
    """Only the main thread may set signal handlers, so a script's thread that launches runs (a
    sweep over configs, say) leaves stop signals to the main thread."""
    result = []
    worker = threading.Thread(target=lambda: result.append(runs.stream(["echo", "hi"], lambda *a: None)))
    worker.start()
    worker.join(60)
    assert result == [(0, "hi\n", "")]


def test_a_torchrun_worker_but_local_rank_0_waits_to_be_stopped_after_an_error(monkeypatch):
    """One error line a node: LOCAL_RANK 0 exits with it, the node's other workers wait to be stopped,
    SIGTERM's default action back first (the training loop's handler would defer it past the wait)."""
    waits = []
    monkeypatch.setattr(configurator.time, "sleep", lambda seconds: waits.append(seconds))
    monkeypatch.setattr(configurator.signal, "signal", lambda *args: waits.append(args))  # pytest's kept
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)

    def main(argv):
        raise UserError("bad")

    stopped_then_wait = [(signal.SIGTERM, signal.SIG_DFL), configurator.RANK_ERROR_WAIT_S]
    for local_rank, expected in (("1", stopped_then_wait), ("0", [])):
        waits.clear()
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as exit_:
            configurator.run(main, "x.py")
        assert (exit_.value.code, waits) == ("x.py: error: bad", expected), local_rank


def test_a_short_text_into_a_closed_pipe_is_flushed_at_once_and_exits_0():
    """Text shorter than the buffer, left unflushed, would meet the closed pipe at exit, as a traceback."""
    read, write = os.pipe()
    os.close(read)
    with open(write, "w", buffering=1 << 16) as file, pytest.raises(SystemExit) as exit_:
        configurator.print_quietly("usage: short", file)
    assert exit_.value.code == 0


@pytest.mark.parametrize("argv", [["train_gpt2.py", "-h"], ["-m", "scripts.bench", "--help"]])
def test_help_into_a_closed_pipe_is_quiet(argv):
    """`--help | head -2`: the reader is gone before the help is written; no BrokenPipeError."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.parametrize("argv, message", [
    (["--max_steps=5", "configs/shakespeare_cpu.toml"], "got 'configs/shakespeare_cpu.toml'"),
    (["--config", "configs/shakespeare_cpu.toml"], "got '--config=configs/shakespeare_cpu.toml'"),
])
def test_a_config_file_after_an_override_or_as_config_is_one_line_saying_where_it_goes(argv, message):
    with pytest.raises(UserError, match="^pass the config file first and without --config: "
                                        rf"CONFIG.toml \[--key=value ...\] \({message}\)$"):
        train_gpt2.load_config(argv)


def test_a_key_given_twice_in_a_config_file_is_one_line_with_its_line_and_the_fix(tmp_path):
    path = tmp_path / "twice.toml"
    path.write_text("max_steps = 3\nmax_steps = 4\n")
    with pytest.raises(UserError, match=f"^config file {re.escape(str(path))} gives a key twice, the second "
                                        f"time at line 2, column 14: keep one of them$"):
        train_gpt2.load_config([str(path)])


def test_a_config_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbfmax_steps = 3\n")
    assert train_gpt2.load_config([str(path)]).max_steps == 3



def test_the_attention_kernel_is_named_and_one_that_cannot_run_is_one_line(monkeypatch):
    """The run's start names SDPA's kernel for its attention: torch's choice under auto, which keeps
    every kernel on; another value keeps that kernel and the math one, turns torch.compile's caches
    off (their keys ignore the kernel, pytorch#185449) and is refused in one line where it cannot
    run the model's attention (cuDNN's on a CPU)."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", False)
    cpu = torch.device("cpu")
    line = train_gpt2.choose_attention(train_gpt2.load_config(TINY), cpu, torch.float32)
    assert re.fullmatch(r"attention: [A-Z_]+, torch's choice of kernel for cpu \(sdpa_backend=auto\)", line)
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch._inductor.config.force_disable_caches
    line = train_gpt2.choose_attention(train_gpt2.load_config([*TINY, "--sdpa_backend=math", "--compile=true"]),
                                       cpu, torch.bfloat16)
    assert line == ("attention: MATH, set by sdpa_backend=math; torch.compile's caches off, as their "
                    "keys ignore the kernel")
    assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch._inductor.config.force_disable_caches
    with pytest.raises(UserError, match=r"^sdpa_backend=cudnn: its kernel does not run this model's attention "
                                        r"on cpu \(torch would run MATH\); pass --sdpa_backend=auto$"):
        train_gpt2.choose_attention(train_gpt2.load_config([*TINY, "--sdpa_backend=cudnn"]), cpu, torch.float32)
    train_gpt2.choose_attention(train_gpt2.load_config(TINY), cpu, torch.float32)  # as other runs start
    assert torch.backends.cuda.flash_sdp_enabled()
