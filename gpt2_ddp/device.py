"""The device a rank runs on and the process-wide settings it needs: the oldest torch it runs on,
which device (--device=auto picks cuda:LOCAL_RANK, mps or cpu), deterministic kernels for
exact_reduction, the attention kernel, and glibc's malloc kept from returning the CPU's freed
memory to the OS."""

import ctypes
import os
import re

import torch
from torch.nn.attention import SDPBackend

from gpt2_ddp.configurator import UserError

TORCH_FLOOR = (2, 8)  # requirements.txt's: FSDP2's set_gradient_divide_factor, for exact_reduction


def check_torch_version():
    """Raises UserError, naming the pip command, for a torch older than TORCH_FLOOR."""
    # major.minor alone: NGC's and source builds of 2.8 call themselves 2.8.0a0+...
    if tuple(map(int, torch.__version__.split(".")[:2])) < TORCH_FLOOR:
        floor = "%d.%d" % TORCH_FLOOR
        raise UserError(f"torch {torch.__version__} is older than {floor}, the oldest that "
                        f"train_gpt2.py runs on: pip install 'torch>={floor}'")


def named_device(name):
    """The torch.device of a --device value (cpu, cuda, cuda:N, mps); UserError for another or one absent."""
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
        raise UserError(f"--device={name} is not a device: pass cpu, cuda, cuda:N or mps")
    device = torch.device(name)
    count = torch.cuda.device_count()  # 0 where torch was built without CUDA
    if device.type == "cuda" and (device.index or 0) >= count:
        raise UserError(f"--device={name}: torch sees {count} CUDA device(s) here; pass --device=cpu"
                        + (f" or cuda:0 to cuda:{count - 1}" if count else ""))
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device=mps: MPS is not available here; pass --device=cpu")
    return device


def choose_device(config, local_rank, launched):
    """This rank's torch.device: config.device, cuda:local_rank for cuda, or for auto cuda:local_rank,
    mps (one process) or cpu. Raises UserError for a device this machine lacks (named_device)."""
    if config.device == "cuda":  # each of torchrun's workers its own GPU, as for auto
        return named_device(f"cuda:{local_rank}")
    if config.device != "auto":
        return named_device(config.device)
    if torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank}")
    if torch.backends.mps.is_available() and not launched:
        return torch.device("mps")
    return torch.device("cpu")


def make_deterministic(device):
    """exact_reduction: bitwise runs need kernels that round alike, too."""
    if device.type == "mps":
        raise UserError("exact_reduction sums in float64, which MPS lacks: pass --device=cpu "
                        "or --exact_reduction=false")
    if device.type == "cuda":  # no atomics; cuBLAS needs a fixed workspace for that
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # CPU kernels split sums by thread: one, as torchrun's workers


def keep_freed_cpu_memory():
    """Keeps glibc (where libc is) from unmapping freed blocks each step faults in anew (docs/perf.md)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


# sdpa_backend's values, each with torch's flag that turns it on and its name in SDPBackend
SDPA_BACKENDS = {"cudnn": ("cudnn", "CUDNN_ATTENTION"), "flash": ("flash", "FLASH_ATTENTION"),
                 "efficient": ("mem_efficient", "EFFICIENT_ATTENTION"), "math": ("math", "MATH")}


def choose_attention(config, device, dtype):
    """Turns on F.scaled_dot_product_attention's kernels for config.sdpa_backend: auto keeps torch's
    order of preference (cuDNN's, then flash, on an H100 with torch 2.11), another value that kernel,
    each with the math kernel for shapes it lacks (sampling's). Returns a line naming the kernel that
    the training's attention, (B, n_head, seq_len, head size) of `dtype`, runs. Raises UserError
    when the kernel asked for does not run it on `device`."""
    for name, (flag, _) in SDPA_BACKENDS.items():
        enabled = config.sdpa_backend in ("auto", name) or name == "math"
        getattr(torch.backends.cuda, f"enable_{flag}_sdp")(enabled)
    q = torch.zeros(1, config.n_head, config.seq_len, config.n_embd // config.n_head, device=device,
                    dtype=dtype)
    chosen = SDPBackend(torch._fused_sdp_choice(q, q, q, None, config.dropout, True)).name
    if config.sdpa_backend == "auto":
        return f"attention: {chosen}, torch's choice of kernel for {device.type} (sdpa_backend=auto)"
    if chosen != SDPA_BACKENDS[config.sdpa_backend][1]:
        raise UserError(f"sdpa_backend={config.sdpa_backend}: its kernel does not run this model's "
                        f"attention on {device} (torch would run {chosen}); pass --sdpa_backend=auto")
    if config.compile:  # its caches would hand back a graph compiled for another kernel (pytorch#185449)
        torch._inductor.config.force_disable_caches = True
    return (f"attention: {chosen}, set by sdpa_backend={config.sdpa_backend}"
            + ("; torch.compile's caches off, as their keys ignore the kernel" if config.compile else ""))
