"""Runs train_gpt2.main (plain python, or under torchrun with the repository root on PYTHONPATH)
with float16's loss scaler instrumented, for tests/test_precision.py.

PROBE_OVERFLOW_STEPS="2,3" makes those updates' gradients overflow: just before unscale_, element 0
of the first parameter's gradient becomes inf where this rank holds it. That is every rank in ddp,
whose gradients are all-reduced, and rank 0 in zero2 and fsdp, whose slice or rows hold it: an
overflow in one rank's part of the model, which every rank must agree to skip. Every world size and
mode thus overflows in the same element of the same steps.
PROBE_OUT=DIR (required) receives rank{RANK}.json: per update, the loss scale after update() and
whether the optimizer stepped.
"""

import json
import math
import os
import sys
from pathlib import Path

from gpt2_ddp import precision
import train_gpt2

overflow_steps = {int(s) for s in os.environ.get("PROBE_OVERFLOW_STEPS", "").split(",") if s}
rank = int(os.environ.get("RANK", "0"))
records = []  # {"scale", "stepped"} per update
grad_scaler = precision.grad_scaler


def probed_grad_scaler(dtype, sharding, device):
    scaler = grad_scaler(dtype, sharding, device)
    unscale_, update = scaler.unscale_, scaler.update

    def probed_unscale_(optimizer):
        record = {"stepped": False}
        records.append(record)
        if not hasattr(optimizer, "unprobed_step"):
            optimizer.unprobed_step = optimizer.step
            optimizer.step = lambda: (records[-1].update(stepped=True), optimizer.unprobed_step())
        if len(records) in overflow_steps and (rank == 0 or sharding == "ddp"):
            grad = optimizer.param_groups[0]["params"][0].grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.inf
        unscale_(optimizer)

    def probed_update():
        update()
        records[-1]["scale"] = scaler.get_scale()

    scaler.unscale_, scaler.update = probed_unscale_, probed_update
    return scaler


precision.grad_scaler = probed_grad_scaler
try:
    code = train_gpt2.main(sys.argv[1:])
finally:
    (Path(os.environ["PROBE_OUT"]) / f"rank{rank}.json").write_text(json.dumps(records))
sys.exit(code)
