""".ci/gpu, the GPU job, on the CPU: its TINY=1 run goes through every part and writes the report,
a stop signal ends the running part's processes, and without a GPU a real run is refused."""

import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import ROOT

PARTS = ("tests", "compile", "modes", "dtypes", "sample")


def gpu_job(report, *parts, scratch, **popen):
    """Starts `bash .ci/gpu REPORT_DIR PARTS...` at toy sizes on the CPU."""
    env = dict(os.environ, TINY="1", SCRATCH=str(scratch))
    return subprocess.Popen(["bash", ".ci/gpu", str(report), *parts], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_the_tiny_run_goes_through_every_part_and_writes_the_report(tmp_path):
    report = tmp_path / "report"
    proc = gpu_job(report, scratch=tmp_path / "scratch")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout + stderr
    assert sorted(p.name for p in report.iterdir()) == sorted(
        ["report.md", *(f"{name}.log" for name in PARTS)])
    text = (report / "report.md").read_text()
    for name in PARTS:
        assert f"| {name} | passed |" in text and f"\n## {name}: passed\n" in text
    assert "1 passed" in text  # the tests' summary
    assert "\neager " in text and "\nddp " in text and "\nfloat32 " in text  # the tables' rows
    assert "| cpu, 1 thread, 8 new tokens |" in text
    assert "prepare_data.py" in (report / "compile.log").read_text()


def running(pattern):
    """The command lines that hold `pattern`, of the processes alive (zombies aside)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if pattern in cmdline and state != "Z":
            found.append(cmdline)
    return found


def test_a_stop_signal_ends_the_running_part_with_its_processes(tmp_path):
    """SIGTERM while a benchmark trains: the job exits 143 within seconds, and nothing it started
    (timeout, bench.py, train_gpt2.py) is left, though timeout put them in a group of their own."""
    scratch = tmp_path / "scratch"
    proc = gpu_job(tmp_path / "report", "compile", scratch=scratch)
    deadline = time.monotonic() + 120
    while not any("train_gpt2.py" in cmdline for cmdline in running(str(scratch))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    time.sleep(1)
    assert running(str(scratch)) == []


def test_without_a_gpu_a_real_run_is_refused_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real run would start")
    proc = subprocess.run(["bash", ".ci/gpu", str(tmp_path / "report")], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 1
    assert proc.stderr == ("gpu: torch sees no CUDA GPU here; TINY=1 runs the parts at toy sizes on "
                           "the CPU\n")
    assert not (tmp_path / "report").exists()


def test_an_unknown_part_is_refused_in_one_line(tmp_path):
    proc = gpu_job(tmp_path / "report", "tests", "bench", scratch=tmp_path / "scratch")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and stderr.startswith("gpu: no part bench; the parts: ")
