"""GPT-2's BPE tokenizer, offline: tiktoken's "gpt2" encoding built from GPT-2's released vocabulary
and merges, assets/encoder.json and assets/vocab.bpe (save_hf exports them as vocab.json, merges.txt)."""

import functools
import hashlib
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from gpt2_ddp.configurator import UserError

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
GPT2_VOCAB_PATH = ASSETS_DIR / "encoder.json"  # token -> id, Hugging Face's vocab.json
GPT2_VOCAB_SHA256 = "03087853bc70c618b66e7c7a43e787d2db4c469416beac9a483e53dad1f72f27"
GPT2_MERGES_PATH = ASSETS_DIR / "vocab.bpe"  # the 50000 merges in rank order, merges.txt
GPT2_MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
# the r50k / gpt2 pre-tokenizer regex, as in tiktoken_ext/openai_public.py
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT_TOKEN = 50256


def checked(path, sha256):
    """str(path), once its sha256 is `sha256`. Raises UserError if it cannot be read or is not."""
    restore = f"Restore it from git: git checkout -- assets/{path.name}"
    try:
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise UserError(f"cannot read {path}, GPT-2's tokenizer: {e.strerror}. {restore}") from None
    if actual != sha256:
        raise UserError(f"{path} is corrupted: sha256 {actual}, expected {sha256}. {restore}")
    return str(path)


@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """GPT-2's tokenizer: 50256 BPE ranks plus <|endoftext|> = 50256, built once per process.
    Raises UserError if either file cannot be read or its sha256 is not the expected one."""
    # the hashes keep tiktoken's file cache, keyed by path, from serving a stale copy
    ranks = data_gym_to_mergeable_bpe_ranks(
        checked(GPT2_MERGES_PATH, GPT2_MERGES_SHA256), checked(GPT2_VOCAB_PATH, GPT2_VOCAB_SHA256),
        vocab_bpe_hash=GPT2_MERGES_SHA256, encoder_json_hash=GPT2_VOCAB_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_TOKEN}, explicit_n_vocab=50257)
