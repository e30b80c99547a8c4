"""
What a run reports: a console line per training step and per evaluation, printed by rank 0, and
the same numbers as one JSON record a line in {out_dir}/log.jsonl (checkpoints.OutDir.log), which
scripts/plot.py draws and runs.read_log reads. Another sink (wandb, TensorBoard) is one more call
in Metrics.write.
"""

import os
from datetime import timedelta

import torch

import optimizers


def log(*args):
    """Prints on the master process (rank 0) alone."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, flush=True)


class Metrics:
    """The reports of a run from start_step on. out: rank 0's checkpoints.OutDir (None on the other
    ranks, which write no records); flops_per_step: training FLOPs per optimizer step; peak: the
    device's peak FLOP/s, or None where it is not known (then no MFU is reported)."""

    def __init__(self, out, config, world_size, device, flops_per_step, peak, start_step):
        self.out, self.config, self.world_size, self.device = out, config, world_size, device
        self.flops_per_step, self.peak, self.start_step = flops_per_step, peak, start_step
        self.dt_avg = 0.0  # seconds per step, for the ETA
        if peak is None:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            log(f"MFU not reported: no peak FLOP/s known for {name}; pass --peak_flops=<FLOP/s>")

    def write(self, record):
        if self.out is not None:
            self.out.log(record)

    def evaluation(self, step, result, text):
        """Reports an evaluation at `step`: result is its record's fields (val_loss, or
        HellaSwag's), text its console line."""
        log(f"step {step:5d} | {text}")
        self.write({"step": step, **result})

    def train_step(self, step, loss, lr, norm, dt, skipped, optimizer):
        """Reports a training step: loss (the mean over its micro-batches), lr, norm (the
        gradient's before clipping), dt (seconds), whether the update was skipped, and in the
        first step the bytes of optimizer state this rank holds."""
        tokens_per_sec = self.config.total_batch_size / dt
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "dt_ms": dt * 1000,
                  "tokens_per_sec": tokens_per_sec}
        if skipped:
            record["skipped"] = True
        if self.peak:
            record["mfu"] = self.flops_per_step / dt / (self.peak * self.world_size)
        if self.device.type == "cuda":
            record["mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if step == self.start_step:
            record["optimizer_state_bytes"] = optimizers.state_bytes(optimizer)  # rank 0's
        # the ETA averages the step times after the first (compilation, warm-up), evals aside
        self.dt_avg = dt if step <= self.start_step + 1 else 0.9 * self.dt_avg + 0.1 * dt
        eta = timedelta(seconds=round(min(self.dt_avg * (self.config.max_steps - step - 1), 1e12)))
        log(f"step {step:5d}/{self.config.max_steps} | loss: {loss:.6f} | lr {lr:.4e} | norm: "
            f"{norm:.4f} | dt: {dt * 1000:.2f}ms | tok/sec: {tokens_per_sec:.2f}"
            + (f" | mfu: {record['mfu'] * 100:.1f}%" if self.peak else "") + f" | eta {eta}"
            + (" | update skipped: non-finite loss or gradient" if skipped else ""))
        self.write(record)
