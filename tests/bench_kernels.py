"""
Times the two parts of GPT-2's step that have rival kernels, each beside its alternative: attention
(SDPA's cuDNN, flash and memory-efficient kernels) and the loss head (lm_head's logits and
cross-entropy, whole or in chunks that never hold all (B*T, vocab) logits).

    python -m tests.bench_kernels                                   # GPT-2 124M's shapes, micro-batch 32
    python -m tests.bench_kernels --device cpu --micro_batch_size 2 --seq_len 64 --vocab_size 512

Attention: one layer's F.scaled_dot_product_attention, (B, n_head, T, head size) bfloat16, causal,
forward and forward + backward, median ms of 20 after 5 warm-ups. The loss head: x (B*T, n_embd) and a
float32 weight (vocab, n_embd) under bfloat16 autocast, loss and backward, median ms of 10; the chunked
one computes each chunk's gradients in its forward (as Liger-Kernel's fused linear cross-entropy), in
torch ops. Its errors are against the first row's. A kernel that does not run on the device says so.
"""

import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt2_ddp import configurator
from gpt2_ddp.device import named_device

KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}


def median_ms(fn, device, n, warm):
    """Median ms of n calls of fn after warm ones (CUDA events on a GPU)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of x @ weight.T against y, `chunk` rows at a time, in bfloat16 matmuls: each
    chunk's softmax gradient is made and spent in the forward, so no chunk's logits outlive it."""

    @staticmethod
    def forward(ctx, x, weight, y, chunk):
        n = x.size(0)
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        grad_x, grad_w = torch.empty_like(x), torch.zeros(weight.shape, device=weight.device)
        w, xb = weight.to(torch.bfloat16), x.to(torch.bfloat16)
        for s in range(0, n, chunk):
            xc, yc = xb[s:s + chunk], y[s:s + chunk]
            logits = (xc @ w.t()).float()  # (chunk, vocab)
            lse = torch.logsumexp(logits, -1)
            loss += (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
            p = torch.exp(logits - lse[:, None])
            p.scatter_add_(1, yc[:, None], torch.full_like(lse[:, None], -1.0))  # softmax - one-hot
            p = (p / n).to(torch.bfloat16)
            grad_x[s:s + chunk] = p @ w
            grad_w += (p.t() @ xc).float()
        ctx.save_for_backward(grad_x, grad_w)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_out, grad_w * grad_out, None, None


def attention_rows(args, device):
    shape = (args.micro_batch_size, args.n_head, args.seq_len, args.n_embd // args.n_head)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
    chosen = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True)).name
    print(f"attention {tuple(shape)} bfloat16, causal; torch's choice here: {chosen}")
    for name, kernel in KERNELS.items():
        def forward(kernel=kernel):
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            both = median_ms(lambda: forward().backward(grad), device, 20, 5)
            row = f"{median_ms(forward, device, 20, 5):10.3f} {both:12.3f}"
        except RuntimeError:
            row = f"{'does not run on ' + device.type:>23}"
        print(f"  {name:<10} {row}   ms forward, forward + backward")


def loss_head_rows(args, device):
    n = args.micro_batch_size * args.seq_len
    x = torch.randn(n, args.n_embd, device=device).requires_grad_()
    weight = (torch.randn(args.vocab_size, args.n_embd, device=device) * 0.02).requires_grad_()
    y = torch.randint(0, args.vocab_size, (n,), device=device)

    def whole(x, weight, y):
        return F.cross_entropy((x @ weight.t()).float(), y)

    variants = [("whole, compiled", torch.compile(whole)), ("whole, eager", whole)] + [
        (f"chunks of {c}, {how}", wrap(lambda x, weight, y, c=c: ChunkedLinearCrossEntropy.apply(x, weight, y, c)))
        for c in args.chunks for how, wrap in (("compiled", torch.compile), ("eager", lambda f: f))]
    print(f"loss head: ({n}, {args.n_embd}) x ({args.vocab_size}, {args.n_embd}), bfloat16 autocast")
    reference = None
    for name, fn in variants:
        def step(fn=fn):
            x.grad = weight.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = fn(x, weight, y)
            loss.backward()
            return loss
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        loss = step().item()
        peak = f"+{(torch.cuda.max_memory_allocated() - base) / 2**30:5.2f} GiB" if device.type == "cuda" else "-"
        reference = reference or (loss, x.grad.clone(), weight.grad.clone())
        errors = [abs(loss - reference[0])] + [((g - r).norm() / r.norm()).item()
                                               for g, r in zip((x.grad, weight.grad), reference[1:])]
        print(f"  {name:<22} {median_ms(step, device, 10, 3):9.2f} ms   {peak:>10}   errors: loss "
              f"{errors[0]:.1e}, x's gradient {errors[1]:.1e}, the weight's {errors[2]:.1e}")


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--micro_batch_size", type=int, default=32)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--vocab_size", type=int, default=50304)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 8192], help="rows a chunk")
    args = parser.parse_args(argv)
    if min(args.micro_batch_size, args.seq_len, args.n_head, args.n_embd, args.vocab_size, *args.chunks) < 1:
        parser.error("every size must be >= 1")
    device = named_device(args.device)
    torch.set_float32_matmul_precision("high")
    attention_rows(args, device)
    loss_head_rows(args, device)


if __name__ == "__main__":
    configurator.run(main, "bench_kernels.py")
