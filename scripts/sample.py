"""
Samples text from a trained model, printing tokens as they are drawn (nanoGPT's sample.py).

    python -m scripts.sample out/shakespeare_cpu --prompt "ROMEO:"          # an out_dir's latest
    python -m scripts.sample out/shakespeare_cpu/ckpt_0000450.pt --num_samples 3 --top_k 0
    python -m scripts.sample gpt2 --prompt_file prompt.txt --temperature 0.8 --device cuda

The source is an out_dir (its latest checkpoint), a checkpoint file, a Hugging Face GPT-2 directory or
gpt2, gpt2-medium, gpt2-large, gpt2-xl (downloaded once). A --seed gives the same text on the same device.
"""

import codecs
import math
import sys
from pathlib import Path
if not __spec__: raise SystemExit("run it as python -m scripts.sample from the repository root")

import torch

from gpt2_ddp import checkpoints, configurator
from gpt2_ddp.configurator import UserError
from gpt2_ddp.device import named_device
from gpt2_ddp.gpt2_weights import SOURCES
from gpt2_ddp.sampling import decoding_layout
from gpt2_ddp.tokenizer import EOT_TOKEN, gpt2_encoding
from train_gpt2 import GPT


def add_model_arguments(parser):
    """The positional `source` and --device (for device.named_device) of sample.py and hellaswag.py."""
    parser.add_argument("source", help=f"the model: {SOURCES}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda, cuda:N or mps (default: cuda where torch sees one)")


def sample(model, enc, prompt, max_new_tokens, temperature, top_k, generator, out=None):
    """Writes the prompt, then each sampled token's text to `out` (default sys.stdout) as it is drawn;
    returns the sampled token ids. An empty prompt starts from <|endoftext|>."""
    out = out or sys.stdout
    prompt_tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT_TOKEN]
    idx = torch.tensor([prompt_tokens], device=next(model.parameters()).device)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out.write(prompt)
    tokens = []
    for token in model.generate(idx, max_new_tokens, generator, temperature, top_k):
        tokens.append(token.item())
        out.write(decoder.decode(enc.decode_single_token_bytes(tokens[-1])))
        out.flush()
    out.write(decoder.decode(b"", final=True) + "\n")
    return tokens


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[1])
    add_model_arguments(parser)
    parser.add_argument("--prompt", help="text to continue (default: a checkpoint's sample_prompt, which its "
                        "run's samples continued; otherwise empty, which starts from <|endoftext|>)")
    parser.add_argument("--prompt_file", help="read the prompt from this file instead")
    parser.add_argument("--num_samples", type=int, default=1, help="samples, each from the prompt")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens drawn per sample")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="< 1 makes likely tokens likelier, > 1 flattens the distribution")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest (0: all)")
    parser.add_argument("--seed", type=int, default=1337, help="the same seed draws the same samples")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, meant for CUDA: one "
                        "graph for the prompt's prefill, one for the one-token decode step at any position "
                        "(the first tokens compile for a minute; on CPU that costs more than it saves)")
    args = parser.parse_args(argv)
    configurator.check_options(parser, args, {
        "temperature": (lambda t: 0 < t < math.inf, "finite and > 0"),  # nan would make every probability nan
        "top_k": (lambda k: k >= 0, ">= 0 (0: all)"), "num_samples": (lambda n: n >= 1, ">= 1"),
        "max_new_tokens": (lambda n: n >= 0, ">= 0")})
    if not -2**63 <= args.seed < 2**64:
        parser.error(f"--seed must be in [-2**63, 2**64), the range torch seeds from; got {args.seed}")
    device = named_device(args.device)
    prompt = args.prompt
    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read --prompt_file {args.prompt_file}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise UserError(f"--prompt_file {args.prompt_file} is not UTF-8 text (byte {e.start}): "
                            f"save it as UTF-8") from e
    model = decoding_layout(GPT.from_pretrained(args.source, device))
    path = checkpoints.resolve(args.source)
    print(f"sampling from {path or args.source}", file=sys.stderr)  # stdout holds the samples alone
    if prompt is None:  # the run's, as its samples during training; from_pretrained checked the file
        prompt = torch.load(path, weights_only=True, mmap=True)["config"]["sample_prompt"] if path else ""
    if args.compile:
        model.compile()  # compiles the forward that generate() calls
    enc = gpt2_encoding()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} of {args.num_samples}")
        sample(model, enc, prompt, args.max_new_tokens, args.temperature, args.top_k, generator)


if __name__ == "__main__":
    configurator.run(main, "sample.py")
