"""Runs train_gpt2.main under torchrun (with the repository root on PYTHONPATH) with instruments
that the tests read afterwards.

PROBE_OUT=DIR (required) receives, per rank, a JSON file with:
  events: in order, "allreduce <bucket index>" for each bucket a DDP comm hook all-reduces and
          "step" for each optimizer step, so a test can count all-reduces per optimizer step;
  micro_losses: the loss of each training micro-batch this rank ran, in order;
  stopped: for each DDP the run built, whether StopSignals.check raised Stopped on this rank when the
           last rank alone held a stop signal (checked as DDP is built, on every rank at once).
PROBE_LATE_TOGGLE=1 sets DDP's require_backward_grad_sync only after the next forward, the bug
of build-nanogpt #30, so a test can show that the equivalence check catches it.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.parallel import DistributedDataParallel

import train_gpt2
from gpt2_ddp.collectives import StopSignals, Stopped

events, micro_losses, stopped = [], [], []


def stop_reaches_this_rank():
    """Whether StopSignals.check raises Stopped here when the last rank alone holds a signal. A collective."""
    signals = StopSignals(torch.device("cpu"))
    if dist.get_rank() == dist.get_world_size() - 1:
        signals.append(signal.SIGTERM)
    try:
        signals.check()
    except Stopped:
        return True
    return False


def counting_allreduce_hook(state, bucket):
    events.append(f"allreduce {bucket.index()}")
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


class ProbedDDP(DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_comm_hook(None, counting_allreduce_hook)
        stopped.append(stop_reaches_this_rank())
        self.late_toggle = os.environ.get("PROBE_LATE_TOGGLE") == "1"
        self.pending_sync = None

    def __setattr__(self, name, value):
        if name == "require_backward_grad_sync" and getattr(self, "late_toggle", False):
            self.pending_sync = value  # takes effect after the next forward: the bug
            return
        super().__setattr__(name, value)

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.late_toggle and self.pending_sync is not None:
            object.__setattr__(self, "require_backward_grad_sync", self.pending_sync)
        return out


original_forward = train_gpt2.GPT.forward


def recording_forward(self, idx, targets=None):
    logits, loss = original_forward(self, idx, targets)
    if self.training and targets is not None and not isinstance(loss, FakeTensor):  # not the memory plan's
        micro_losses.append(loss.item())
    return logits, loss


original_step = torch.optim.AdamW.step


def recording_step(self, *args, **kwargs):
    if self.param_groups[0]["params"][0].device.type != "meta":  # the memory plan's optimizer
        events.append("step")
    return original_step(self, *args, **kwargs)


train_gpt2.DDP = ProbedDDP  # parallelize() wraps the model in DDP
train_gpt2.GPT.forward = recording_forward
torch.optim.AdamW.step = recording_step
try:
    train_gpt2.main(sys.argv[1:])
finally:
    out = Path(os.environ["PROBE_OUT"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps({"events": events, "micro_losses": micro_losses, "stopped": stopped}))
