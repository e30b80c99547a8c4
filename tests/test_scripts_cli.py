"""The programs as a user launches them: --help opens with the usage line in the form that runs, a
script run by its path says that form in one line, and a boolean is true or false alone."""

import subprocess
import sys

import pytest

from conftest import ROOT
from gpt2_ddp import configurator
import train_gpt2

# every script with a main(); scripts/__init__.py aside
SCRIPTS = sorted(path.stem for path in (ROOT / "scripts").glob("[a-z]*.py"))


# Runs each program's --help as python runs it (runpy: __main__ with a __spec__ for -m, none for a file) in
# one process, which imports torch once instead of once a program; prints each help's first line.
FIRST_HELP_LINES = """
import contextlib, io, runpy, sys
for program in sys.argv[1:]:
    sys.argv[1:], out = ["--help"], io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        if program.endswith(".py"):
            runpy.run_path(program, run_name="__main__")
        else:  # as a fresh python -m, which finds no earlier script's import of it
            sys.modules.pop(program, None)
            runpy.run_module(program, run_name="__main__", alter_sys=True)
    print(out.getvalue().partition("\\n")[0])
"""


def run_all(commands):
    """(stdout, stderr, returncode) of each command (the arguments after python), run side by side
    in the repository's root."""
    procs = [subprocess.Popen([sys.executable, *command], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for command in commands]
    return [(*proc.communicate(timeout=120), proc.returncode) for proc in procs]


def test_help_opens_with_the_usage_line_that_runs():
    """The two top-level programs are run by their full paths here, and name their files alone."""
    usages = ["python train_gpt2.py", "python prepare_data.py", *(f"python -m scripts.{s}" for s in SCRIPTS)]
    programs = [str(ROOT / u.split()[-1]) if u.endswith(".py") else u.split()[-1] for u in usages]
    [(out, err, code)] = run_all([["-c", FIRST_HELP_LINES, *programs]])
    assert (err, code) == ("", 0)
    lines = out.splitlines()
    assert len(lines) == len(usages), out
    for usage, line in zip(usages, lines):
        assert line.startswith(f"usage: {usage} "), (usage, line)


def test_a_script_run_by_its_path_names_the_command_in_one_line():
    """Run by path, Python finds neither gpt2_ddp nor scripts: each script says so before importing them."""
    assert "sample" in SCRIPTS and "gpt2_ddp" not in SCRIPTS
    results = run_all([[f"scripts/{name}.py", "out/x"] for name in SCRIPTS])
    assert results == [("", f"run it as python -m scripts.{name} from the repository root\n", 1)
                       for name in SCRIPTS]


@pytest.mark.parametrize("value", ["yes", "1", "True"])
def test_a_boolean_other_than_true_or_false_is_one_line(value, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["train_gpt2.py", f"--compile={value}"])
    with pytest.raises(SystemExit) as exit_:
        configurator.run(train_gpt2.main, "train_gpt2.py")
    assert exit_.value.code == (f"train_gpt2.py: error: config key 'compile': cannot read {value!r} as "
                                f"bool: pass true or false")
    toml = tmp_path / "c.toml"  # TOML's booleans, not a number or a string
    toml.write_text(f"compile = {1 if value == '1' else repr(value)}\n")
    with pytest.raises(configurator.UserError, match="as bool: pass true or false$"):
        train_gpt2.load_config([str(toml)])


def test_a_sample_or_bench_option_that_breaks_its_rule_names_it_its_value_and_the_rule():
    """The line after the usage names the option given, its value and its rule, not every option's rule."""
    results = run_all([["-m", "scripts.sample", "out/x", "--top_k", "-3"],
                       ["-m", "scripts.bench", "--nproc", "0"]])
    assert [(err.splitlines()[-1], out, code) for out, err, code in results] == [
        ("python -m scripts.sample: error: --top_k must be >= 0 (0: all), got -3", "", 2),
        ("python -m scripts.bench: error: --nproc must be >= 1, got 0", "", 2)]
    assert all(err.startswith("usage: ") for _, err, _ in results)
