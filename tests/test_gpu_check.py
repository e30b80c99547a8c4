"""scripts/gpu_check.py on the CPU: its dry run prints every command of the GPU plan, its --tiny run
goes through every part and writes the report, and a part past its time limit is killed."""

import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from gpt2_ddp.configurator import UserError
from scripts import gpu_check


def test_the_dry_run_prints_every_part_and_runs_nothing(tmp_path, capsys):
    gpu_check.main([str(tmp_path / "report"), "--dry-run"])
    out = capsys.readouterr().out
    for name in gpu_check.PARTS:
        assert f"\n{name} (limit " in out
    assert "tests/test_cuda.py" in out and "--devices cuda" in out
    assert "--variants eager compile --micro_batch_sizes 16" in out
    assert "--variants ddp zero2 fsdp ddp_exact:--exact_reduction=true muon" in out
    assert not (tmp_path / "report").exists()  # nothing ran


def test_the_tiny_run_goes_through_every_part_and_writes_the_report(tmp_path):
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", str(report), "--tiny",
                           "--scratch", str(tmp_path / "scratch")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in report.iterdir()) == sorted(
        ["report.md", *(f"{name}.log" for name in gpu_check.PARTS)])
    text = (report / "report.md").read_text()
    for name in gpu_check.PARTS:
        assert f"| {name} | passed |" in text
    assert "1 passed" in text  # the tests' summary
    assert "\neager " in text and "\nddp " in text  # the benchmarks' tables, one row each
    assert "| cpu, 1 thread, 8 new tokens |" in text
    assert "prepare_data.py" in (report / "compile.log").read_text()


def ended(pid):
    """Whether the process is gone, or a zombie that nobody reaps in a container without init."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_part_past_its_limit_is_killed_with_its_children(tmp_path, monkeypatch):
    """The hung part is killed at its limit, its child too; the report says so, shows the end of
    its log, and keeps the part that passed before it."""
    pid_file = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '300']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('hanging', flush=True); "
            "time.sleep(300)")
    monkeypatch.setattr(gpu_check, "PARTS", {
        "quick": (60, "prints", lambda tiny, scratch: [[sys.executable, "-c", "print('done')"]]),
        "hang": (2, "hangs", lambda tiny, scratch: [[sys.executable, "-c", hang]])})
    report = tmp_path / "report"
    with pytest.raises(UserError, match=r"^part\(s\) hang did not pass: see .*report.md$"):
        gpu_check.main([str(report), "--tiny", "--part", "hang", "quick"])  # run in PARTS order
    text = (report / "report.md").read_text()
    assert "| quick | passed |" in text and "| hang | timed out |" in text
    assert text.index("| quick |") < text.index("| hang |")
    assert "\ndone\n" in text  # the end of quick's output
    assert "## hang: timed out" in text and "\nhanging\n" in text  # the end of hang.log
    assert ended(int(pid_file.read_text()))


def test_sigint_to_the_launcher_ends_the_process_group_it_started(tmp_path):
    """runs.stream, which gpu_check.py runs each part with in a session of its own (where Ctrl-C
    in the terminal does not reach), passes a SIGINT on to the part's whole process group."""
    pid_file = tmp_path / "child.pid"
    hang = ("import subprocess, time; child = subprocess.Popen(['sleep', '300']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('hanging', flush=True); "
            "time.sleep(300)")
    launcher = ("import sys; from gpt2_ddp import runs; "
                f"runs.stream([sys.executable, '-c', {hang!r}], "
                "lambda line, _: print(line, end='', flush=True), own_session=True)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "hanging\n"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert "stopped by SIGINT; ending the command it runs" in proc.stderr.read()
    assert ended(int(pid_file.read_text()))


def test_without_a_gpu_a_real_run_is_refused_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real run would start")
    with pytest.raises(UserError, match="^torch sees no CUDA GPU here: pass --dry_run"):
        gpu_check.main([str(tmp_path / "report")])
