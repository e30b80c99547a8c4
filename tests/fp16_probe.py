"""train_gpt2.main with float16's loss scaler instrumented, for tests/test_precision.py: run as a
script (plain python, or under torchrun with the repository root on PYTHONPATH), or instrument()
in the test's own process.

Overflow steps (instrument's, or a run's "overflow_steps" for the script) make those updates'
gradients overflow: just before unscale_, element 0 of the first parameter's gradient becomes inf
where this rank holds it. That is every rank in ddp, whose gradients are all-reduced, and rank 0 in
zero2 and fsdp, whose slice or rows hold it: an overflow in one rank's part of the model, which
every rank must agree to skip. Every world size and mode thus overflows in the same element of the
same steps.
The records, per update: the loss scale after update() and whether the update moved the first
parameter. The script's argument is a JSON file of a list of runs, each {"args": train_gpt2.py's
arguments, "overflow_steps": [...], "out": the folder of its rank{RANK}.json}, trained in turn
(tests/many_runs.py).
"""

import json
import math
import os
import sys
from pathlib import Path

import torch

from gpt2_ddp import precision
import many_runs
import train_gpt2


MARK = "fp16_probe: the run into "


def instrument(overflow_steps, rank):
    """Makes precision.grad_scaler's scalers overflow and record as the module docstring says;
    returns (the records, a function that undoes it)."""
    records, grad_scaler = [], precision.grad_scaler

    def record_step(optimizer):
        """Steps, recording whether the update moved this rank's part of the first parameter: the
        loop always calls step(), which skips on the device."""
        first = optimizer.param_groups[0]["params"][0]
        local = first.to_local() if hasattr(first, "to_local") else first
        before = local.detach().clone()
        optimizer.unprobed_step()
        records[-1]["stepped"] = not torch.equal(before, local)

    def probed_grad_scaler(dtype, sharding, device):
        scaler = grad_scaler(dtype, sharding, device)
        unscale_, update = scaler.unscale_, scaler.update

        def probed_unscale_(optimizer):
            records.append({"stepped": False})
            if not hasattr(optimizer, "unprobed_step"):
                optimizer.unprobed_step = optimizer.step
                optimizer.step = lambda: record_step(optimizer)
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
    return records, lambda: setattr(precision, "grad_scaler", grad_scaler)


def probed_run(run):
    """train_gpt2.main(run["args"]) with instrument(run["overflow_steps"]), its console after a line
    of MARK and run["out"] on rank 0; writes the records to run["out"]/rank{RANK}.json."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"{MARK}{run['out']}")
    records, restore = instrument(set(run["overflow_steps"]), rank)
    try:
        return train_gpt2.main(run["args"])
    finally:
        restore()
        (Path(run["out"]) / f"rank{rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    many_runs.run_each(json.loads(open(sys.argv[1]).read()), probed_run)
