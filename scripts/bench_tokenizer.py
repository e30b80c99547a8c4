"""
Tokenization throughput of prepare_data.py's pipeline against tiktoken's own batch encoder.

    python -m scripts.bench_tokenizer                          # tiny shakespeare paragraphs x 10
    python -m scripts.bench_tokenizer --workers 1 2 4 --trials 5
    python -m scripts.bench_tokenizer --input corpus.txt --repeat 1

Documents are the paragraphs of assets/tinyshakespeare.txt (or --input), repeated --repeat times.
Each worker count N times tiktoken's encode_ordinary_batch(docs, num_threads=N) and prepare_data's
_tokenized(docs, N) (N processes, pool start included), best of --trials after a warm-up. ratio =
prepare_data / tiktoken tokens/s. prepare_data counts one more token per document, its <|endoftext|>.
"""

import os
import time
from pathlib import Path

import prepare_data
from gpt2_ddp import configurator
from gpt2_ddp.configurator import UserError


def load_docs(path, repeat):
    """The non-empty paragraphs of the text file `path`, repeated `repeat` times."""
    paragraphs = [p for p in Path(path).read_text(encoding="utf-8").split("\n\n") if p.strip()]
    return paragraphs * repeat


def best_time(fn, trials):
    """(result, best wall time in s) of fn() over `trials` runs, after one warm-up run."""
    result = fn()
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        r = fn()
        best = min(best, time.perf_counter() - t0)
        assert r == result, "a run gave another token count"
    return result, best


def main(argv=None):
    parser = configurator.ArgumentParser(description=__doc__)
    parser.add_argument("--input", default=str(prepare_data.TINYSHAKESPEARE_PATH),
                        help="UTF-8 text file, split into documents at blank lines "
                        "(default: tiny shakespeare)")
    parser.add_argument("--repeat", type=int, default=10,
                        help="times the documents are repeated (default: 10)")
    parser.add_argument("--workers", type=int, nargs="+", default=sorted({1, os.cpu_count()}),
                        help="worker counts to time (default: 1 and os.cpu_count())")
    parser.add_argument("--trials", type=int, default=3,
                        help="timed runs per measurement, best kept (default: 3)")
    args = parser.parse_args(argv)

    docs = load_docs(args.input, args.repeat)
    enc = prepare_data.gpt2_encoding()  # built once here so that forked pool workers inherit it
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    print(f"{len(docs)} documents, {n_bytes / 1e6:.1f} MB of text, {os.cpu_count()} CPU cores, "
          f"best of {args.trials} after 1 warm-up")

    rows = []
    for n in args.workers:
        tik_tokens, tik_s = best_time(
            lambda: sum(map(len, enc.encode_ordinary_batch(docs, num_threads=n))), args.trials)
        pd_tokens, pd_s = best_time(
            lambda: sum(len(a) for a, _ in prepare_data._tokenized(docs, n)), args.trials)
        if pd_tokens != tik_tokens + len(docs):
            raise UserError(f"token counts disagree: prepare_data {pd_tokens}, tiktoken {tik_tokens} "
                            f"+ {len(docs)} documents")
        ratio = (pd_tokens / pd_s) / (tik_tokens / tik_s)
        rows.append(("tiktoken", n, tik_tokens, tik_s, ""))
        rows.append(("prepare_data", n, pd_tokens, pd_s, f"{ratio:.2f}"))

    print(f"{'method':<14}{'workers':>8}{'tokens':>12}{'seconds':>10}{'tokens/s':>14}{'ratio':>8}")
    for method, n, tokens, seconds, ratio in rows:
        print(f"{method:<14}{n:>8}{tokens:>12,}{seconds:>10.3f}{tokens / seconds:>14,.0f}{ratio:>8}")


if __name__ == "__main__":
    configurator.run(main, "bench_tokenizer.py")
