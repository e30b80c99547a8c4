"""GPT-2's BPE tokenizer, offline: tiktoken's "gpt2" encoding built from assets/gpt2.tiktoken, so
that neither prepare_data.py nor sampling needs the network."""

import functools
import hashlib
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from gpt2_ddp.configurator import UserError

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
GPT2_RANKS_PATH = ASSETS_DIR / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# the r50k / gpt2 pre-tokenizer regex, as in tiktoken_ext/openai_public.py
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT_TOKEN = 50256


@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """GPT-2's tokenizer: 50256 BPE ranks plus <|endoftext|> = 50256, built once per process.
    Raises UserError if the ranks file cannot be read or its sha256 is not the expected one."""
    restore = "Restore it from git: git checkout -- assets/gpt2.tiktoken"
    try:
        actual = hashlib.sha256(GPT2_RANKS_PATH.read_bytes()).hexdigest()
    except OSError as e:
        raise UserError(f"cannot read {GPT2_RANKS_PATH}, GPT-2's tokenizer: {e.strerror}. "
                        f"{restore}") from None
    if actual != GPT2_RANKS_SHA256:
        raise UserError(
            f"{GPT2_RANKS_PATH} is corrupted: sha256 {actual}, expected {GPT2_RANKS_SHA256}. {restore}")
    # the hash keeps tiktoken's file cache, keyed by path, from serving a stale copy
    ranks = load_tiktoken_bpe(str(GPT2_RANKS_PATH), expected_hash=GPT2_RANKS_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_TOKEN}, explicit_n_vocab=50257)
