"""
Scores a model on HellaSwag's validation split (10042 examples) as build-nanogpt and llm.c do:

    python -m scripts.hellaswag gpt2                  # 0.2955 acc_norm in build-nanogpt (gpt2-xl: 0.4893)
    python -m scripts.hellaswag out/gpt2_124m         # the latest checkpoint of a run
    python -m scripts.hellaswag out/gpt2_124m --examples 1000 --device cuda

The data is downloaded once to data/hellaswag/ when missing.
"""

from pathlib import Path
if not __spec__: raise SystemExit("run it as python -m scripts.hellaswag from the repository root")

import torch

from gpt2_ddp import configurator, hellaswag
from gpt2_ddp.configurator import UserError
from gpt2_ddp.device import named_device
from scripts.sample import add_model_arguments
from train_gpt2 import GPT

GPT2_ACC_NORM = {"gpt2": 0.2955, "gpt2-xl": 0.4893}  # build-nanogpt's README, this scoring


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[1])
    add_model_arguments(parser)
    parser.add_argument("--path", default="data/hellaswag/hellaswag_val.jsonl",
                        help="the validation jsonl; downloaded there when missing")
    parser.add_argument("--examples", type=int, default=0, help="score the first N (0: all)")
    args = parser.parse_args(argv)
    if args.examples < 0:
        parser.error(f"--examples must be >= 0 (0: all), got {args.examples}")
    device = named_device(args.device)
    if Path(args.path).is_dir():
        raise UserError(f"--path {args.path} is a directory: pass the validation jsonl's path")
    if not Path(args.path).exists():
        hellaswag.download(args.path)
    examples = hellaswag.load_examples(args.path, args.examples)
    model = GPT.from_pretrained(args.source, device)
    torch.set_float32_matmul_precision("high")  # TF32, as build-nanogpt scored GPT-2
    examples = hellaswag.render_all(examples, model.config.block_size, model.config.vocab_size)
    result = hellaswag.evaluate(model, examples, device)
    print(f"{args.source}: {hellaswag.summary(result)}")
    if args.source in GPT2_ACC_NORM:
        print(f"build-nanogpt reports acc_norm {GPT2_ACC_NORM[args.source]} for {args.source}")


if __name__ == "__main__":
    configurator.run(main, "hellaswag.py")
