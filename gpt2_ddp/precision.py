"""The arithmetic of a run, from config.dtype: bfloat16 or float16 autocast (float32 weights, optimizer
and loss; matmuls and attention in 16 bits) or float32 throughout, and torch's loss scaler for float16.
dtype=auto picks bfloat16 on CUDA GPUs of compute capability 8.0 on, float16 on older ones (nanoGPT's
choice) and float32 on CPU and MPS. Autocast is the same on every device, so CPU tests run a GPU's."""

import dataclasses
import math
import warnings
from contextlib import nullcontext

import torch

from gpt2_ddp.configurator import UserError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve(config, device):
    """(config with the dtype that runs, a line saying which and why). Raises UserError for bfloat16 on
    a GPU without bf16 tensor cores, or a dtype this device or torch cannot autocast (check_runs)."""
    dtype, why = config.dtype, f"set by dtype={config.dtype}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        gpu = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
        if dtype == "auto":
            dtype = "bfloat16" if major >= 8 else "float16"
            why = f"dtype=auto: {gpu} {'has' if major >= 8 else 'lacks'} bfloat16 tensor cores"
        elif dtype == "bfloat16" and major < 8:
            raise UserError(f"--dtype=bfloat16: {gpu} has no bfloat16 tensor cores (8.0 and later "
                            f"do); pass --dtype=float16, which scales the loss, or --dtype=auto")
    elif dtype == "auto":
        dtype, why = "float32", (f"dtype=auto on {device.type}: full precision; --dtype=bfloat16 "
                                 f"runs a GPU's casts here too")
    check_runs(dtype, device)
    scaling = " with loss scaling" if dtype == "float16" else ""
    return dataclasses.replace(config, dtype=dtype), f"dtype {dtype}{scaling}: {why}"


def check_runs(dtype, device):
    """Raises UserError, in one line, when autocast to `dtype` (and for float16 the loss scaler)
    does not run on `device` with this torch: one small matmul's forward and backward tell."""
    try:
        with warnings.catch_warnings(action="ignore"):  # where autocast cannot run, torch warns and skips it
            w = torch.ones(2, 2, device=device, requires_grad=True)
            with autocast(dtype, device):
                y = w @ w
            if y.dtype != DTYPES[dtype]:
                raise RuntimeError(f"autocast gave {y.dtype}")
            scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
            scaler.scale(y.float().sum()).backward()
            scaler.unscale_(torch.optim.SGD([w]))
    except (RuntimeError, TypeError) as e:
        raise UserError(f"--dtype={dtype} does not run on {device} with torch {torch.__version__} "
                        f"({(str(e).strip().splitlines() or [''])[0]}): pass --dtype=float32") from None


def autocast(dtype, device):
    """torch.autocast to `dtype` (a DTYPES name) on `device`'s type, or nothing for float32."""
    return nullcontext() if dtype == "float32" else torch.autocast(device.type, dtype=DTYPES[dtype])


def grad_scaler(dtype, sharding, device):
    """torch's loss scaler, off unless `dtype` is float16. Its found-inf flag must agree over ranks:
    zero2's slices need the sharded scaler; DTensor all-reduces fsdp's; ddp's grads are alike."""
    enabled = dtype == "float16"
    if enabled and sharding == "zero2":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # FSDP's import is slow
        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type, enabled=enabled)


def scale(scaler, device):
    """The loss scale as a device scalar, to be read with the step's other values: get_scale() would
    read it alone. 1 where the scaler is off."""
    return scaler._scale if scaler.is_enabled() else torch.ones((), device=device)


def overflowed(scaler, loss, norm, scale):
    """Whether an update skipped for a non-finite gradient norm under a finite loss was float16's normal
    overflow (the scaler then halves its scale); one at a scale under 1 is a divergence. scale: the
    scaler's after its update()."""
    return (not math.isfinite(norm) and math.isfinite(loss) and scaler.is_enabled()
            and scale >= 0.5)  # halved from 1 or more


def step_unless(optimizer, skip):
    """optimizer.step(), leaving every weight and state as they were where the device bool `skip` is
    true: torch's found_inf, which GradScaler hands to fused AdamW, given to AdamW and Muon alike."""
    inner = getattr(optimizer, "optimizer", optimizer)  # the swap-ins' optimizer of views
    torch_optimizers, found_inf = getattr(inner, "optimizers", [inner]), skip.float()  # Chain's two
    for opt in torch_optimizers:
        opt.found_inf = found_inf
    optimizer.step()
    for opt in torch_optimizers:
        del opt.found_inf


def diverged(step, skipped, loss, norm, last_saved, config):
    """The UserError that ends a run whose loss or gradient norm was not finite for `skipped`
    steps in a row up to `step`: what happened, and what to try."""
    newest = f"step {last_saved}" if last_saved else "none yet"
    return UserError(f"the loss or gradient norm was not finite in steps {step - skipped + 1}-{step} (loss "
                     f"{loss}, grad norm {norm}): the run diverged; those updates were skipped. Lower "
                     f"--max_lr (now {config.max_lr}) or look for bad data in those steps, and rerun to "
                     f"resume from the newest checkpoint ({newest}), or move the newest out of "
                     f"{config.out_dir} to resume from before the divergence began")
