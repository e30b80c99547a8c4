"""
Writes a train_gpt2.py checkpoint as a Hugging Face GPT-2 directory (config.json, model.safetensors
and GPT-2's tokenizer) that `transformers` loads with no network. A model that is not GPT-2's
architecture (a fork's RMSNorm, an lm_head apart from wte, other keys) is refused, nothing written:

    python -m scripts.export_hf out/shakespeare_cpu out/shakespeare_cpu_hf  # an out_dir's latest
    python -m scripts.export_hf out/gpt2_124m/ckpt_0019073.pt gpt2-124m-repro

    from transformers import GPT2LMHeadModel, GPT2TokenizerFast
    model = GPT2LMHeadModel.from_pretrained("out/shakespeare_cpu_hf")
    tokenizer = GPT2TokenizerFast.from_pretrained("out/shakespeare_cpu_hf")

To share it: `hf upload YOUR_NAME/MODEL_NAME out/shakespeare_cpu_hf` (huggingface_hub's CLI).
"""

if not __spec__: raise SystemExit("run it as python -m scripts.export_hf from the repository root")
from gpt2_ddp import configurator
from gpt2_ddp.gpt2_weights import check_gpt2, save_hf
from train_gpt2 import GPT


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("checkpoint", help="a checkpoint file, or an out_dir (its latest checkpoint)")
    parser.add_argument("out_dir", help="the directory to write; must not exist or be empty")
    args = parser.parse_args(argv)
    model = check_gpt2(GPT.from_pretrained(args.checkpoint), args.checkpoint)
    config = model.config
    save_hf(model.state_dict(), config, args.out_dir)
    print(f"wrote {args.out_dir}: GPT-2 of {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters, {config.n_layer} layers, n_embd {config.n_embd}, vocab {config.vocab_size}")


if __name__ == "__main__":
    configurator.run(main, "export_hf.py")
