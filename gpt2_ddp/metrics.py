"""What a run reports: rank 0 prints a line per training step and evaluation, and writes the numbers as
a JSON record to {out_dir}/log.jsonl and to the wandb or TensorBoard sinks config asks for."""

import contextlib
import dataclasses
import json
import os
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch

from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.collectives import agreed
from gpt2_ddp.configurator import UserError


def log(*args):
    """Prints on the master process (rank 0) alone, if the output is not gone (a closed ssh's)."""
    if int(os.environ.get("RANK", 0)) == 0:
        with contextlib.suppress(OSError):
            print(*args, flush=True)


class Waiting(threading.Timer):
    """Logs `waiting for {what}` if `seconds` pass between start() and cancel(), so that a long silence
    says why; a with block starts and cancels it."""

    def __init__(self, what, seconds=5):
        super().__init__(seconds, log, [f"waiting for {what}"])
        self.daemon = True

    def __enter__(self):
        self.start()

    def __exit__(self, *exc):
        self.cancel()


class Wandb:
    """A wandb run of every record against its `step`, its id in {out_dir}/wandb_run_id for a resumed
    run to log to. Raises UserError when the wandb package is missing or wandb.init fails."""

    def __init__(self, config, resumed):
        try:
            import wandb
        except ImportError:
            raise UserError("wandb_log=true needs the wandb package: pip install wandb") from None
        id_path = Path(config.out_dir) / "wandb_run_id"
        try:  # bytes or a directory there are no run's: refused, not overwritten
            run_id = id_path.read_text().strip() if id_path.exists() else None
        except (OSError, UnicodeError):
            raise UserError(f"{id_path} is not the wandb run id a run writes there: move it away, and "
                            f"this run logs to a new wandb run") from None
        try:
            self.run = wandb.init(project=config.wandb_project, name=config.wandb_run_name or None,
                                  config=dataclasses.asdict(config), id=run_id if resumed else None,
                                  resume="allow", dir=config.out_dir)
        except wandb.errors.Error as e:
            raise UserError(f"wandb.init failed: {(str(e).strip().splitlines() or [''])[0]}; set "
                            f"WANDB_MODE=offline to log without a wandb server (`wandb sync` "
                            f"uploads the run later)") from None
        if not resumed or run_id is None:
            atomic_write(id_path, lambda f: f.write(self.run.id.encode()))
        # wandb's own step counts log calls, and a resumed run logs some steps again
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record):
        self.run.log(record)

    def close(self, failed):
        self.run.finish(exit_code=1 if failed else 0)  # 1: wandb shows the run as failed


class TensorBoard:
    """TensorBoard scalars of each record under {out_dir}/tensorboard, earlier runs' events from
    first_step on hidden. Raises UserError when the tensorboard package is missing."""

    def __init__(self, config, first_step):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("tensorboard=true needs the tensorboard package: pip install "
                            "tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(Path(config.out_dir) / "tensorboard"), purge_step=first_step)

    def write(self, record):
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(key, float(value), record["step"])

    def close(self, failed):
        self.writer.close()


def start_profiler(config, rank):
    """A torch.profiler of updates 4 to 6 into {out_dir}/trace_rank{rank}.json; None unless config.profile."""
    if not config.profile:
        return None
    trace = Path(config.out_dir) / f"trace_rank{rank}.json"
    profiler = torch.profiler.profile(
        record_shapes=True,  # the collectives' sizes: bytes communicated per step
        schedule=torch.profiler.schedule(wait=2, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)))
    profiler.start()
    return profiler


# dense peak FLOP/s by device name, from NVIDIA's datasheets (SXM unless named): bfloat16 and float16
# tensor cores, and float32 matmuls, which are TF32 tensor-core ones from Ampere on (train_gpt2.py
# sets matmul precision "high"); V100 and T4 lack bf16 and TF32
PEAK_FLOPS = [("H100 PCIe", 756e12, 378e12), ("H100", 989e12, 495e12), ("H200", 989e12, 495e12),
              ("A100", 312e12, 156e12), ("V100", 125e12, 15.7e12), ("T4", 65e12, 8.1e12)]


def peak_flops(name, dtype):
    """Peak FLOP/s of the GPU called `name` in `dtype` (a DTYPES name); None for one not in PEAK_FLOPS."""
    return next((half if dtype != "float32" else full for key, half, full in PEAK_FLOPS if key in name), None)


def state_bytes(optimizer):
    """Bytes of optimizer state this rank holds (of a DTensor, its local shard)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t
               for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def open_sinks(out, config, start_step):
    """The sinks config asks for besides log.jsonl, on rank 0. Raises UserError as they do."""
    sinks = []
    # TensorBoard first, so a missing package stops the run before wandb.init makes an empty run
    if config.tensorboard:  # from the first step past log.jsonl's, which OutDir.start has cut
        lines = out.log_path.read_text().splitlines() if out.log_path.exists() else []
        first_step = max((json.loads(line)["step"] for line in lines), default=-1) + 1
        sinks.append(TensorBoard(config, first_step))
    if config.wandb_log:
        sinks.append(Wandb(config, resumed=start_step > 0))
    return sinks


def close_sinks(sinks, failed):
    for sink in sinks:
        sink.close(failed)


class Metrics:
    """The reports of a run from start_step (its checkpoint's, or 0) on, and its profiler. out: rank 0's
    checkpoints.OutDir (None elsewhere); model: the GPT, whose FLOPs per step give MFU. A collective:
    opens the sinks on rank 0, raising UserError on every rank if one fails."""

    def __init__(self, out, config, rank, world_size, device, model, start_step):
        self.out, self.config, self.world_size, self.device = out, config, world_size, device
        self.flops_per_step = model.flops_per_token(config.seq_len) * config.total_batch_size
        self.start_step = start_step
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.peak = config.peak_flops or peak_flops(name, config.dtype)
        self.dt_avg = 0.0  # seconds per step, for the ETA
        compiles = "compiles the model (torch.compile) and " if config.compile else ""
        # step_begins starts it, train_step cancels it
        self.first_wait = Waiting(f"step {start_step + 1}, the first after a start: it {compiles}warms up "
                                  f"(memory, kernels)")
        self.loss_avg = None  # the running mean of the train loss, for spikes
        if self.peak is None and device.type != "cpu":
            log(f"MFU not reported: no {config.dtype} peak FLOP/s known for {name}; pass "
                f"--peak_flops=<FLOP/s>")
        elif self.peak is None:  # a CPU's peak would be a guess that no one can act on
            log("MFU not reported on cpu: it is measured against a GPU's peak FLOP/s")
        self.sinks = agreed(lambda: open_sinks(out, config, start_step), master_only=True) or []
        # a run that an exception ends before close() still flushes its sinks, as a failed run's
        self.closer = weakref.finalize(self, close_sinks, self.sinks, failed=True)
        self.profiler = start_profiler(config, rank)

    def step_begins(self):
        """time.time() at the start of an update; the first after a start says what it waits for
        when its line is more than 5 s away."""
        if self.first_wait.ident is None:
            self.first_wait.start()
        return time.time()

    def close(self):
        self.first_wait.cancel()
        if self.profiler:
            self.profiler.stop()
        self.closer.detach()
        close_sinks(self.sinks, failed=False)

    def write(self, record):
        if self.out is not None:
            self.out.log(record)
        for sink in self.sinks:
            sink.write(record)

    def evaluation(self, step, result, text):
        """Reports an evaluation at `step`: result is its record's fields, text its console line."""
        log(f"step {step:5d} | {text}")
        self.write({"step": step, **result})

    def train_step(self, step, loss, lr, norm, t0, optimizer, loss_scale, skipped, overflow, extras=None):
        """Reports the step-th update (from 1), begun at time.time() t0, once its values are read (the
        GPU's work of the step is then done): loss (mean of micro-batches), lr, norm (before clipping),
        loss_scale (float16's after the step, else None) and the rest. A loss a nat above the running
        mean gets its own line. extras: {name: float} of a fork's own values (the loop's: the means of
        what the model's forward puts in its `extra_metrics` dict), each logged under its name: last
        in the record, after the norm on the console line. Raises ValueError for a name that the
        record has already (loss, lr...)."""
        dt = time.time() - t0
        tokens_per_sec = self.config.total_batch_size / dt
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "dt_ms": dt * 1000,
                  "tokens_per_sec": tokens_per_sec}
        if muon_lrs := [g["lr"] for g in optimizer.param_groups if "splits" in g]:  # Muon's groups
            record["muon_lr"] = muon_lrs[0]
        if loss_scale is not None:
            record["loss_scale"] = loss_scale
        record |= {flag: True for flag, on in (("skipped", skipped), ("overflow", overflow)) if on}
        if self.peak:
            record["mfu"] = self.flops_per_step / dt / (self.peak * self.world_size)
        if self.device.type == "cuda":
            record["mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if step == self.start_step + 1:
            record["optimizer_state_bytes"] = state_bytes(optimizer)  # rank 0's
        extras = extras or {}
        if clashes := sorted(extras.keys() & record.keys()):
            raise ValueError(f"extra_metrics names {clashes}, which the record of a step has already")
        record |= extras
        self.first_wait.cancel()
        # the ETA averages the step times after the first (compilation, warm-up), evals aside
        if step > self.start_step + 1:
            self.dt_avg = 0.9 * self.dt_avg + 0.1 * dt if self.dt_avg else dt
        eta = timedelta(seconds=round(min(self.dt_avg * (self.config.max_steps - step), 1e12)))
        reason = f"float16 overflow, loss scale halved to {loss_scale:g}" if overflow else (
            "non-finite loss or gradient")
        log(f"step {step:5d}/{self.config.max_steps} | loss: {loss:.6f} | lr {lr:.4e}"
            + (f" | muon_lr {record['muon_lr']:.4e}" if "muon_lr" in record else "")
            + f" | norm: {norm:.4f}" + "".join(f" | {name}: {value:.4g}" for name, value in extras.items())
            + f" | dt: {dt * 1000:.2f}ms | tok/sec: {tokens_per_sec:.2f}"
            + (f" | mfu: {record['mfu'] * 100:.1f}%" if self.peak else "")
            + (f" | eta {eta}" if self.dt_avg else "")
            + (f" | update skipped: {reason}" if skipped else ""))
        if not skipped:
            if self.loss_avg is not None and loss > self.loss_avg + 1:
                log(f"step {step:5d} | loss spike: {loss:.6f}, the running mean is {self.loss_avg:.6f}")
            self.loss_avg = loss if self.loss_avg is None else 0.9 * self.loss_avg + 0.1 * loss
        self.write(record)
        if self.profiler:
            self.profiler.step()
