"""
Tokenize text with GPT-2's BPE tokenizer into .bin token shards for training (docs/data.md):

    python prepare_data.py                                   # assets/tinyshakespeare.txt
    python prepare_data.py --input 'my_books/*.txt' --name books
    python prepare_data.py --input corpus.jsonl --text_field content
    python prepare_data.py --dataset HuggingFaceFW/fineweb-edu --dataset_config sample-10BT

A .txt file is one document, or one a paragraph with --sample_by=paragraph (the embedded corpus's default:
its paragraphs are speeches); .jsonl/.json and .parquet files hold one a row; a hub dataset is streamed.

Each document is preceded by <|endoftext|> (50256), as in GPT-2's training data. The first tokens
form the val split, the rest train, never in one shard. Shards, in llm.c's .bin format, are named
{name}_{split}_{index:06d}.bin, one index across the splits, val first, as in build-nanogpt.

{name}_manifest.json, beside the shards, holds "inputs" (per file [absolute path, bytes, mtime in ns], or
[dataset, config, split]), "options" (those that change the shards), "shards" (in file-name order, {"file",
"bytes", "mtime_ns", "tokens", "max_token_id"}) and the overall "max_token_id". A rerun of the same inputs
and options does nothing while the shards are there at their listed sizes, else makes them again. Only
the shards and manifest of {name} decide that: an output dir may hold several datasets, each of its own
name, which training picks with --dataset.
"""

import argparse
import collections
import contextlib
import fcntl
import glob
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt2_ddp import configurator
from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.configurator import UserError
from gpt2_ddp.shards import MAX_SHARD_TOKENS, changed_shard, file_size, read_json, shard_name, write_shard
from gpt2_ddp.tokenizer import ASSETS_DIR, EOT_TOKEN, gpt2_encoding

TINYSHAKESPEARE_PATH = ASSETS_DIR / "tinyshakespeare.txt"

# how each file extension is read: text and json here, parquet by `datasets`' builder
READERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate

PART_CHARS = 1 << 19  # the most characters tokenized at once: tiktoken's memory grows with them
# a part ends before a space, tab or newline that follows another character: GPT-2's pre-tokenizer
# never joins the two, so the parts' tokens are the whole document's (tested)
PART_END = re.compile(r"(?<=\S)[ \t\n\r]")


def _parts(sources, field):
    """Yields (part, first) of each non-empty document of the _sources(): the text, or past PART_CHARS
    characters its parts cut at PART_END; first marks a first part. Raises UserError naming a vanished file,
    or a row unreadable, without a `field` string, or with no cut in PART_CHARS // 2 characters."""
    for where, rows in sources:
        try:
            for name, row in rows():
                text, start = _text(name, row, field), 0
                while len(text) - start > PART_CHARS:
                    if (cut := PART_END.search(text, start + PART_CHARS // 2, start + PART_CHARS)) is None:
                        raise UserError(f"{name} has {PART_CHARS // 2:,} characters with no space, tab or "
                                        f"newline after another; too long to tokenize, split or remove it")
                    yield text[start:cut.start()], start == 0
                    start = cut.start()
                if text:  # an empty document would add nothing but an <|endoftext|>
                    yield text[start:], start == 0
        except OSError as e:
            raise UserError(f"{where} vanished or changed while prepare_data read it ({e.strerror}); "
                            f"rerun") from None


def _tokenize_parts(parts):
    """<|endoftext|> before each document, then the tokens of each part, all concatenated into
    one uint16 array (compact to send between processes); and the parts' size in UTF-8 bytes."""
    encode = gpt2_encoding().encode_ordinary
    tokens = [np.array([EOT_TOKEN] * first + encode(text), dtype=np.uint16) for text, first in parts]
    return np.concatenate(tokens), sum(len(text.encode("utf-8")) for text, _ in parts)


def _batches(parts, docs_per_task):
    """Groups parts into lists of at most docs_per_task parts and about PART_CHARS characters,
    so that progress moves within a long document too."""
    batch, chars = [], 0
    for part in parts:
        batch.append(part)
        chars += len(part[0])
        if len(batch) == docs_per_task or chars >= PART_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _tokenized(parts, workers, docs_per_task=256):
    """Yields _tokenize_parts(batch) for each batch of the (part, first) `parts`, in input order. Raises
    UserError when a worker process dies (killed for memory, say)."""
    batches = _batches(parts, docs_per_task)
    if workers == 1:
        yield from map(_tokenize_parts, batches)
        return
    with ProcessPoolExecutor(workers, initializer=signal.signal,  # Ctrl-C: the main process ends the run
                             initargs=[signal.SIGINT, signal.SIG_IGN]) as pool:
        try:  # a bounded window of tasks keeps memory flat and the workers busy, results in order
            in_flight = collections.deque()
            for batch in batches:
                in_flight.append(pool.submit(_tokenize_parts, batch))
                if len(in_flight) > 2 * workers:
                    yield in_flight.popleft().result()
            while in_flight:
                yield in_flight.popleft().result()
        except BrokenExecutor:
            raise UserError(f"a tokenizer worker died (killed, by the out-of-memory killer?); nothing was "
                            f"written; free memory or lower --workers (now {workers}), and rerun") from None


def _terminated(signum, frame):
    """The command's SIGTERM handler: kills the tokenizer workers, which would outlive this process,
    then ends it by the signal's default action, as without the handler. (Run in a worker, which fork
    gives a copy of it, it kills no process but the worker.)"""
    for child in multiprocessing.active_children():
        child.kill()
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _text(name, row, field):
    """The string in `field` of `row`, one document, which `name` names ('FILE line 3'). Raises
    UserError saying what the row holds when that is not an object with a string there."""
    if not isinstance(row, dict):
        raise UserError(f"{name} is {_kind(row)}, not an object with a {field!r} string; fix or remove it")
    if isinstance(text := row.get(field), str):
        return text
    if field not in row:
        fields = f"its fields are {', '.join(map(str, row))}" if row else "it has no fields"
        raise UserError(f"{name} has no field {field!r}; {fields}; choose the text with --text_field")
    raise UserError(f"{name}'s {field!r} is {_kind(text)}, not a string; fix that row, or choose "
                    f"the text with --text_field")


def _kind(value):
    """What a JSON or parquet value is, in words: 'null', 'the number 5', 'an array' and so on."""
    if value is None or type(value) in (list, dict):
        return {type(None): "null", list: "an array", dict: "an object"}[type(value)]
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"a {type(value).__name__} ({str(value)[:40]!r})"


def _read_error(where, e):
    """The one-line UserError for a source that `datasets` failed to parse."""
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return UserError(f"cannot read {where}: {first_line}")


class _ShardWriter:
    """Packs token arrays into shards of `shard_size` tokens; one file index across splits."""

    def __init__(self, out_dir, name, shard_size):
        self.out_dir, self.name = out_dir, name
        self.buf = np.empty(shard_size, dtype=np.uint16)
        self.fill, self.split = 0, None  # tokens in buf, and their split
        self.shards = []  # the manifest's entry of each shard written, in writing order

    def add(self, split, tokens):
        if not len(tokens):
            return
        if split != self.split:
            self.flush()  # val and train tokens never share a shard
            self.split = split
        while len(tokens):
            n = min(len(self.buf) - self.fill, len(tokens))
            self.buf[self.fill : self.fill + n] = tokens[:n]
            self.fill += n
            tokens = tokens[n:]
            if self.fill == len(self.buf):
                self.flush()

    def flush(self):
        if self.fill == 0:
            return
        path = self.out_dir / f"{self.name}_{self.split}_{len(self.shards):06d}.bin"
        write_shard(path, self.buf[: self.fill])
        st = path.stat()  # a rename into out_dir keeps the mtime, which the loader checks
        self.shards.append({"file": path.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                            "tokens": self.fill, "max_token_id": int(self.buf[: self.fill].max())})
        self.fill = 0


def _token_count(s):
    """argparse type for token counts: a whole number, also written like 1e8; _parse_args checks its range."""
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}")
    if not x.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {s!r}")
    return int(x)


def _parse_args(argv):
    parser = configurator.ArgumentParser(
        description="Tokenize text with GPT-2's BPE into llm.c .bin token shards.",
        epilog="With no --input or --dataset, the embedded corpus assets/tinyshakespeare.txt is used.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--input", nargs="+", metavar="PATH_OR_GLOB", help="local files: .txt (one document "
                        "per file), .jsonl/.json or .parquet (one document per row); all of one kind")
    source.add_argument("--dataset", metavar="NAME",
                        help="Hugging Face hub dataset to stream, e.g. HuggingFaceFW/fineweb-edu")
    parser.add_argument("--dataset_config", metavar="CONFIG", help="config of --dataset, e.g. sample-10BT")
    parser.add_argument("--split", default="train", help="split of --dataset to read (default: train)")
    parser.add_argument("--text_field", default="text",
                        help="column holding the text in json/parquet/hub rows (default: text)")
    parser.add_argument("--sample_by", choices=("document", "paragraph"), help=".txt input: a document per "
                        "file, or per paragraph (text between blank lines), as `datasets`' text builder "
                        "reads them (default: paragraph for the embedded corpus, else document)")
    parser.add_argument("--name", help="prefix of the shard names, a plain file name (default: the first "
                                       "file's stem, the dataset's last path component, or tinyshakespeare)")
    parser.add_argument("--output_dir", help="default: data/<name>/ next to this script")
    parser.add_argument("--shard_size", type=_token_count, default=100_000_000,
                        help="tokens per shard (default: 1e8)")
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val_tokens", type=_token_count, help="exactly this many tokens (>= 1), the first "
                     "ones, go to val; skips the pass that counts the tokens for --val_fraction (worth it "
                     "for big inputs). Default for --dataset: --shard_size (the first shard is val)")
    val.add_argument("--val_fraction", type=float, default=0.1,
                     help="fraction of all tokens, the first ones, that go to val, in (0, 1) (default: 0.1)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(),
                        help="tokenizer processes (default: all cores)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the <name>_*.bin shards of an existing output dir")
    parser.add_argument("--skip_bad_files", action="store_true",
                        help="skip .txt files that are not valid UTF-8, with a warning, instead of failing")
    args = parser.parse_args(argv)

    if not args.dataset and (args.dataset_config is not None or args.split != "train"):
        parser.error("--dataset_config and --split only apply to --dataset")
    if not 1 <= args.shard_size <= MAX_SHARD_TOKENS:
        parser.error(f"--shard_size must be in [1, {MAX_SHARD_TOKENS}], got {args.shard_size}")
    if not 0 < args.val_fraction < 1:
        parser.error("--val_fraction must be in (0, 1): training needs a val split")
    if args.val_tokens is not None and args.val_tokens < 1:
        parser.error(f"--val_tokens must be >= 1, got {args.val_tokens}: training needs a val split")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    args.sample_by = args.sample_by or ("document" if args.input or args.dataset else "paragraph")
    return args


def _expand_inputs(patterns):
    """Each path or glob's sorted matches, and their extension's READERS kind. Raises UserError for a
    pattern matching nothing, a match not a readable file, a file matched twice, or mixed or unknown ones."""
    files = []
    for pattern in patterns:
        if not (matches := sorted(glob.glob(pattern, recursive=True))):
            raise UserError(f"no files match {pattern!r}")
        files += matches
    first = {}  # the real path of each file -> the index of the first match naming it
    for i, f in enumerate(files):
        file_size(f, f"input {f}", {"link": "; point it at a file or leave it out",
                                    "directory": f", not a file; pass the files in it, e.g. --input "
                                                 f"'{f.rstrip('/')}/*.txt'", "other": "; pass files"})
        try:
            open(f, "rb").close()
        except OSError as e:
            raise UserError(f"cannot read input {f}: {e.strerror}") from None
        if (j := first.setdefault(os.path.realpath(f), i)) != i:
            also = "" if files[j] == f else f" (also as {files[j]})"
            raise UserError(f"input {f} is matched more than once{also}, so its documents would be "
                            f"in the data twice; pass each file once")
    extensions = sorted({Path(f).suffix.lower() for f in files})
    if unsupported := [e or "(none)" for e in extensions if e not in READERS]:
        raise UserError(f"unsupported file extension {', '.join(unsupported)}; "
                        f"supported: {', '.join(READERS)}")
    if len(extensions) > 1:
        raise UserError(f"all --input files must have one extension, got {', '.join(extensions)}")
    return files, READERS[extensions[0]]


def _drop_bad_utf8(files, skip):
    """The files that are valid UTF-8; the others are skipped with a warning if `skip`, else fatal."""
    good = []
    for f in files:
        try:
            Path(f).read_bytes().decode("utf-8")  # all at once, as the text builder reads it anyway
        except UnicodeDecodeError as e:
            problem = f"{f} is not valid UTF-8 (first bad byte at offset {e.start})"
            if not skip:
                raise UserError(f"{problem}; fix it, or pass --skip_bad_files to skip it")
            print(f"prepare_data.py: warning: skipping {problem}", file=sys.stderr)
        else:
            good.append(f)
    return good


def main(argv=None):
    """Run the pipeline; argv is a list of command-line arguments (default: sys.argv[1:])."""
    args = _parse_args(argv)
    name, what, files, reader = _inputs(args)
    out_dir = Path(args.output_dir) if args.output_dir else Path(__file__).resolve().parent / "data" / name
    source = {"inputs": [args.dataset, args.dataset_config, args.split] if args.dataset else
              [[str(Path(f).resolve()), os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files],
              "options": {k: getattr(args, k) for k in ("name", "text_field", "sample_by", "shard_size",
                                                        "val_tokens", "val_fraction", "skip_bad_files")}}
    manifest_path = out_dir / f"{name}_manifest.json"
    with _locked(out_dir):
        for commit in out_dir.glob(".*.commit"):  # a run was stopped while it moved its shards in
            _finish_commit(out_dir, commit.name[1:-len(".commit")])
        # other datasets' shards are no conflict: training reads one of several with --dataset
        made = any(shard_name(f) in {(name, "train"), (name, "val")} for f in os.listdir(out_dir))
        if made and not args.overwrite:
            if read_json(manifest_path, lambda m: {"inputs": m["inputs"], "options": m["options"]}) != source:
                raise UserError(f"{out_dir} already has shards of {name}, made from other input or options; "
                                f"pass --overwrite to replace its {name}_*.bin shards, or pick another "
                                f"--output_dir or --name")
            if (changed := changed_shard(out_dir, name)) is None:
                print(f"{out_dir} already holds the shards of this input and these options: nothing to do")
                return
            print(f"{changed}: making the shards of this input again")

        sources = _sources(args, files, reader)
        for _, rows in sources:
            if (first := next(rows(), None)) is not None:
                _text(*first, args.text_field)
        staging = out_dir / ".partial"  # this run's alone (under the lock): made here, then committed
        if staging.is_symlink() or staging.is_file():
            staging.unlink()
        elif staging.exists():
            shutil.rmtree(staging)  # left by a killed run
        staging.mkdir()
        try:
            shards = _write_shards(args, sources, what, name, staging)
            manifest = {**source, "shards": shards, "max_token_id": max(s["max_token_id"] for s in shards)}
            atomic_write(staging / manifest_path.name,
                         lambda f: f.write((json.dumps(manifest, indent=1) + "\n").encode()))
        except BaseException:  # an error or Ctrl-C: nothing half-made stays behind
            shutil.rmtree(staging)
            raise
        os.replace(staging, out_dir / f".{name}.commit")  # from here, a killed run's shards replace the old
        _finish_commit(out_dir, name)
    print(f"wrote {len(shards)} shard(s) to {out_dir}")
    for split in ("val", "train"):
        tokens = [s["tokens"] for s in shards if shard_name(s["file"])[1] == split]
        print(f"  {split:5s}: {len(tokens):4d} shard(s) {sum(tokens):15,d} tokens")


@contextlib.contextmanager
def _locked(out_dir):
    """Holds an exclusive flock on {out_dir}/.prepare_data.lock, making out_dir, while the with block
    runs: runs on one output dir, on any node of a shared filesystem, go one at a time, and one that
    waits says so. Raises UserError when out_dir cannot be made, written or locked."""
    path = out_dir / ".prepare_data.lock"
    try:
        while True:
            made = not out_dir.exists()
            out_dir.mkdir(parents=True, exist_ok=True)
            f = open(path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                print(f"waiting for the other prepare_data run on {out_dir} "
                      f"({f.read().strip() or 'starting'}) to end", flush=True)
                fcntl.flock(f, fcntl.LOCK_EX)
            if path.exists() and os.path.samestat(os.fstat(f.fileno()), path.stat()):
                break
            f.close()  # the run before removed the file this one locked: lock the new one
        f.truncate(0)
        print(f"pid {os.getpid()} on {socket.gethostname()}", file=f, flush=True)
    except OSError as e:
        raise UserError(f"cannot write to {out_dir}: {e.strerror}; pick a writable --output_dir") from None
    try:
        yield
    finally:
        path.unlink()  # while locked, so that a run waiting on this file locks a new one
        if made and not any(out_dir.iterdir()):  # a failed run leaves no empty dir
            out_dir.rmdir()
        f.close()


def _finish_commit(out_dir, name):
    """Replaces out_dir's shards of `name` (the .bin files its manifest lists, and any shards.shard_name
    reads as `name`'s, llm.c's too) with a finished run's in {out_dir}/.{name}.commit, manifest last, and
    removes that. Safe to repeat: the next run on out_dir finishes what a killed run began."""
    commit, manifest_path = out_dir / f".{name}.commit", out_dir / f"{name}_manifest.json"
    new = read_json(commit / manifest_path.name, lambda m: {e["file"] for e in m["shards"]})
    if new is not None:  # else the manifest, moved in last, is in place
        old = read_json(manifest_path, lambda m: {e["file"] for e in m["shards"]}) or set()
        for f in os.listdir(out_dir):
            if f not in new and (shard_name(f) in {(name, "train"), (name, "val")} or
                                 f in old and f.endswith(".bin")):
                os.unlink(out_dir / f)
        for path in sorted(commit.glob("*.bin")):
            os.replace(path, out_dir / path.name)
        os.replace(commit / manifest_path.name, manifest_path)
    commit.rmdir()


def _inputs(args):
    """(name, what, files, reader): the shards' name prefix, the input in words, the local input
    files (none for --dataset) and their READERS kind. Raises UserError for bad input files and for
    a name that is not a plain file name, as every file is written as {output_dir}/{name}_*."""
    if args.dataset:
        name = args.name if args.name is not None else args.dataset.rstrip("/").split("/")[-1].lower()
        what, files, reader = f"dataset {args.dataset}", [], None
    else:
        patterns = args.input or [str(TINYSHAKESPEARE_PATH)]
        files, reader = _expand_inputs(patterns)
        name = args.name if args.name is not None else Path(files[0]).stem
        if reader == "text":
            files = _drop_bad_utf8(files, args.skip_bad_files)
        what = " ".join(patterns)
    if reader != "text" and args.sample_by == "paragraph":
        raise UserError(f"--sample_by=paragraph splits .txt files, not {what}; leave it out")
    if name in ("", ".", "..") or any(sep and sep in name for sep in ("/", os.sep, os.altsep, "\0")):
        given = "--name" if args.name is not None else f"the name taken from {what}"
        raise UserError(f"{given} {name!r} is not a plain file name (it is empty, '.' or '..', or "
                        f"holds a path separator); pass --name with a plain name, such as books")
    return name, what, files, reader


def _sources(args, files, reader):
    """The (where, rows) sources, rows() an iterator of (row name, dict) pairs, read afresh on each
    call: a hub dataset, streamed, or one per local file, so errors can name it. .txt and json files
    are read as `datasets`' text (sample_by=document or paragraph) and json builders do, without it."""
    files = [f for f in files if os.path.getsize(f) > 0]  # no documents; the parquet builder crashes on them
    if reader == "text":
        return [(f, partial(_text_rows, f, args.sample_by)) for f in files]
    if reader == "json":
        return [(f, partial(_json_rows, f)) for f in files]
    try:  # imported here: slow to import, and only the hub and parquet need it
        import datasets
        import huggingface_hub
    except ImportError:
        raise UserError(f"{'--dataset' if args.dataset else 'parquet input'} needs the "
                        f"datasets package: pip install datasets") from None
    # _read_error() says parse errors and an unreachable hub in one line, which the loggers would repeat
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    huggingface_hub.utils.logging.set_verbosity_error()
    if args.dataset:
        print(f"opening {args.dataset} on the Hugging Face hub", flush=True)  # retried before it fails
        wanted = [(args.dataset, dict(path=args.dataset, name=args.dataset_config, split=args.split))]
    else:
        wanted = [(f, dict(path=reader, data_files=f, split="train")) for f in files]
    sources = []
    for where, kwargs in wanted:
        try:  # a hub out of reach, a name it does not hold, a file that does not parse
            dataset = datasets.load_dataset(**kwargs, streaming=True)
        except Exception as e:
            raise _read_error(where, e) from None
        sources.append((where, partial(_dataset_rows, where, dataset)))
    return sources


def _text_rows(path, sample_by):
    """A .txt file as one row, (its path, {"text": its contents}), or with sample_by="paragraph" as
    a row per paragraph, its text between blank lines (`datasets`' text builder splits on "\n\n")."""
    text = Path(path).read_text(encoding="utf-8")
    if sample_by == "document":
        yield str(path), {"text": text}
    else:
        for i, paragraph in enumerate(text.split("\n\n")):
            yield f"{path} paragraph {i + 1}", {"text": paragraph}


def _json_rows(path):
    """The rows of a .jsonl or .json file as (name, row) pairs: one JSON value a non-blank line, named
    by line, or for a .json file starting with '[' its array's elements, named by item (the two forms
    `datasets`' json builder reads). Raises UserError for a line, or such a file, not UTF-8 JSON."""
    with open(path, "rb") as f:
        if path.endswith(".json") and f.read(1 << 16).lstrip(b" \t\r\n\xef\xbb\xbf")[:1] == b"[":
            f.seek(0)
            items = _json_value(f.read(), path, "fix it")
            yield from ((f"{path} item {i}", row) for i, row in enumerate(items, 1))
            return
        f.seek(0)
        for number, line in enumerate(f, 1):
            if line.strip():
                name = f"{path} line {number}"
                yield name, _json_value(line, name, "fix or remove that line")


def _json_value(data, name, fix):
    """The JSON value in the bytes `data`, which `name` names. Raises UserError, ending with `fix`,
    for bytes that are not UTF-8 JSON (a UTF-8 byte order mark before them is allowed), or whose
    strings hold a lone surrogate escape such as \\ud800, which is no Unicode text."""
    try:
        value = json.loads(data.decode("utf-8-sig"))
        if SURROGATE_ESCAPE.search(data):  # a pair decodes to one character; a lone one cannot
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not valid UTF-8 (first bad byte at offset {e.start}); {fix}") from None
    except UnicodeEncodeError as e:
        raise UserError(f"{name} holds a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), "
                        f"which is no Unicode text; {fix}") from None
    except ValueError as e:
        raise UserError(f"{name} is not valid JSON ({e}); {fix}") from None


def _dataset_rows(where, dataset):
    """A `datasets` dataset's (f"{where} row {n}", row) pairs, n from 1. Raises UserError on a bad one."""
    try:
        for number, row in enumerate(dataset, 1):
            yield f"{where} row {number}", row
    except Exception as e:  # pyarrow's and datasets' parse and cast errors
        raise _read_error(where, e) from None


def _write_shards(args, sources, what, name, staging):
    """Tokenizes the sources into shards in `staging`; returns their manifest entries, by file name.
    Without --val_tokens (and for local files), a first pass counts the tokens to size the val split."""
    val_tokens, total = args.val_tokens, None
    if val_tokens is None and args.dataset:
        val_tokens = args.shard_size  # as build-nanogpt does for FineWeb-Edu; no counting pass
    elif val_tokens is None:
        total = 0
        size = sum(os.path.getsize(where) for where, _ in sources)  # local files: a known total
        with tqdm(total=size, desc="counting tokens", unit="B", unit_scale=True) as bar:
            for tokens, n_bytes in _tokenized(_parts(sources, args.text_field), args.workers):
                total += len(tokens)
                bar.update(n_bytes)
                bar.set_postfix_str(f"{total:,} tokens")
            bar.update(size - bar.n)  # the bytes of json and parquet that are not text
        val_tokens = int(total * args.val_fraction)
        if val_tokens == 0 and total:  # no tokens at all: the empty input is named below
            raise UserError(f"--val_fraction {args.val_fraction} of the input's {total} tokens is 0 tokens, "
                            f"and training needs a val split; raise --val_fraction or pass --val_tokens N")

    writer, val_left = _ShardWriter(staging, name, args.shard_size), val_tokens
    with tqdm(total=total, desc="writing shards", unit="tok", unit_scale=True) as bar:
        for tokens, _ in _tokenized(_parts(sources, args.text_field), args.workers):
            bar.update(len(tokens))
            head = tokens[:val_left]
            val_left -= len(head)
            writer.add("val", head)
            writer.add("train", tokens[len(head):])
    if writer.split is None:  # no document came through, so nothing has been written
        raise UserError(f"empty input: no documents in {what}")
    writer.flush()
    if writer.split == "val":  # val comes first, so all shards are val
        n = sum(s["tokens"] for s in writer.shards)
        raise UserError(f"the input has only {n} tokens, all of them went to val (--val_tokens "
                        f"{val_tokens}); no train shard was written")
    return sorted(writer.shards, key=lambda shard: shard["file"])


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    configurator.run(main, "prepare_data.py")
