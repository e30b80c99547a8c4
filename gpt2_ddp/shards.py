"""Token shards in llm.c's .bin format (also read by modded-nanogpt): writing, reading, which files
form a split, a check that token ids fit the vocabulary. Another format changes this module alone.

A shard is 256 little-endian int32 (magic 20240520, version 1, token count, zeros), then the tokens
as little-endian uint16, named {dataset}_{split}_{index:06d}.bin (llm.c's fineweb.py) or
{dataset}_{split}.bin (llm.c's tinyshakespeare.py and tinystories.py)."""

import json
import os
import re
import shlex
import stat
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.configurator import UserError

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
MAX_SHARD_TOKENS = 2**31 - 1  # the token count is stored in an int32 header field
FIX = "remake the shards with `python prepare_data.py --overwrite` (see README)"
SHARD_NAME = re.compile(r"(?P<dataset>.+)_(?P<split>train|val)(?:_\d+)?\.bin")
ROOT = Path(__file__).resolve().parent.parent  # where prepare_data.py writes data/<name>/


def write_shard(path, tokens):
    """Writes `tokens`, 1-D ints in [0, 65535], to `path` as one shard, atomically, so a killed run leaves
    no truncated .bin. Raises ValueError for any other tokens, or more than MAX_SHARD_TOKENS of them."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.dtype != np.uint16 and tokens.size:
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi > 65535:
            raise ValueError(f"tokens must be in [0, 65535] to fit in uint16, got range [{lo}, {hi}]")
    if len(tokens) > MAX_SHARD_TOKENS:
        raise ValueError(f"a shard holds at most {MAX_SHARD_TOKENS} tokens, got {len(tokens)}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    body = tokens.astype("<u2", copy=False)
    atomic_write(path, lambda f: f.writelines([header.tobytes(), body.tobytes()]))


def read_tokens(path):
    """The tokens of a shard, memory-mapped read-only: a (N,) little-endian uint16 array."""
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_INTS * 4)


def pread_tokens(f, start, out):
    """Reads tokens [start, start + len(out)) of the open shard `f` into `out`, a contiguous "<u2" array,
    by one preadv; returns how many whole tokens it read (fewer where the file ends)."""
    return os.preadv(f.fileno(), [out], HEADER_INTS * 4 + 2 * start) // 2


def read_shard_header(path):
    """The token count (>= 1) of the .bin shard `path`, checked: a readable file, llm.c's header, and the
    size in bytes the header gives. Raises UserError for a bad one, naming the file and the fix."""
    size = file_size(path, path, {"link": ", named like a shard; point it at a shard or remove it",
                                  "directory": ", named like a shard: a shard is a file; move or rename it",
                                  "other": ", named like a shard; move or rename it"})
    if size < HEADER_INTS * 4:
        raise UserError(f"shard {path} is truncated or empty ({size} bytes); {FIX}")
    try:
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    except OSError as e:
        raise UserError(f"cannot read shard {path}: {e.strerror}") from None
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise UserError(f"shard {path} has a bad header (magic {header[0]}, version {header[1]}, "
                        f"expected {SHARD_MAGIC}, {SHARD_VERSION}): not a token shard; {FIX}")
    n_tokens = int(header[2])
    body, expected = size - HEADER_INTS * 4, HEADER_INTS * 4 + 2 * n_tokens
    if n_tokens < 0:
        raise UserError(f"shard {path} has a negative token count in its header ({n_tokens}): "
                        f"corrupt; {FIX}")
    if body % 2:
        raise UserError(f"shard {path} is {size} bytes, not the {expected} of its header's {n_tokens} "
                        f"tokens, and not a whole number of 2-byte tokens: corrupt; {FIX}")
    if body != 2 * n_tokens:
        raise UserError(f"shard {path} holds {body // 2} tokens but its header says {n_tokens} "
                        f"({size} bytes, not {expected}): truncated or corrupt; {FIX}")
    if n_tokens == 0:
        raise UserError(f"shard {path} holds no tokens (its header says 0): remove it, or {FIX}")
    return n_tokens


def file_size(path, what, advice):
    """The size in bytes of the regular file `path`, which `what` names ("input a.txt"). Raises
    UserError for a dangling link, a directory, or any other kind of file (a pipe would block its
    reader), the message ending with advice["link"], advice["directory"] or advice["other"]."""
    try:
        st = os.stat(path)
    except OSError as e:
        if os.path.islink(path):
            raise UserError(f"{what} is a dangling link (to {os.readlink(path)}: {e.strerror})"
                            f"{advice['link']}") from None
        raise UserError(f"cannot read {what}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} is a directory{advice['directory']}")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} is not a regular file (a pipe, socket or device){advice['other']}")
    return st.st_size


def read_json(path, pick=lambda value: value):
    """pick(the JSON in the file `path`); None if it is unreadable, not JSON, or not of pick's shape."""
    try:
        return pick(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def shard_name(filename):
    """(dataset, split) of a file named {dataset}_{split}[_{digits}].bin, split train or val; else None."""
    match = SHARD_NAME.fullmatch(filename)
    return (match["dataset"], match["split"]) if match else None


def split_paths(data_dir, split, dataset=""):
    """The paths of one split's shards in data_dir (as shard_name reads them), in name order: those
    of `dataset`, or of the only dataset there. Raises UserError when data_dir is a file, holds the
    shards of several datasets and `dataset` is empty, holds a stopped prepare_data.py run's commit
    dir, fails changed_shard, or holds none of them, naming then what makes them."""
    data_dir = Path(data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise UserError(f"data_dir {data_dir} is a file, not a directory of shards; pass the directory "
                        f"that holds the shards")
    named = {p: found for p in data_dir.glob("*.bin") if (found := shard_name(p.name))}
    names = sorted({d for d, _ in named.values()})
    chosen = dataset or (names[0] if len(names) == 1 else "")
    for commit in [data_dir / f".{chosen}.commit"] if chosen else data_dir.glob(".*.commit"):
        if commit.exists():
            raise UserError(f"{commit} holds shards that a stopped prepare_data.py run was moving into "
                            f"{data_dir}; rerun that prepare_data.py command, which finishes the move")
    if len(names) > 1 and not dataset:
        raise UserError(f"{data_dir} holds the shards of {len(names)} datasets ({', '.join(names)}): "
                        f"pass --dataset=NAME to train on one, or move the others out")
    if changed := chosen and changed_shard(data_dir, chosen):
        raise UserError(f"{changed}, so these are not the shards prepare_data.py made; rerun its "
                        f"command to make them again")
    paths = sorted(p for p, (d, s) in named.items() if s == split and (not dataset or d == dataset))
    if not paths:
        name = dataset or data_dir.resolve().name
        missing = f"no {split} shards ({name}_{split}_NNNNNN.bin or llm.c's {name}_{split}.bin) in {data_dir}"
        if dataset and names and dataset not in names:
            raise UserError(f"{missing}, which holds the shards of {', '.join(names)}: pass --dataset= one "
                            f"of them")
        beside = sorted(str(d) for d in data_dir.parent.glob("*") if d.is_dir() and d != data_dir
                        and any(shard_name(p.name) for p in d.glob("*.bin")))
        here = ROOT.relative_to(Path.cwd()) if ROOT.is_relative_to(Path.cwd()) else ROOT  # from the cwd
        maker = {"fineweb-edu": f"bash {here / 'scripts' / 'prepare_fineweb_edu.sh'}",
                 "tinyshakespeare": f"python {here / 'prepare_data.py'}"}.get(
                     name, f"python {here / 'prepare_data.py'} --input FILES --name {name}")
        if data_dir.resolve() != (ROOT / "data" / name).resolve():  # not where the command writes by default
            maker += f" --output_dir {data_dir}"
        # the user's launch form: torchrun's workers know their node's count and the world's
        per_node, world_size = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        nodes = "--standalone" if per_node == world_size else f"--nnodes={int(world_size) // int(per_node)}"
        launcher = f"torchrun {nodes} --nproc_per_node={per_node}" if per_node else "python"
        cd = "" if here == Path() else f"cd {here} && "
        raise UserError(
            f"{missing}{'' if data_dir.exists() else ', which does not exist'}"
            + (f"; data dirs beside it with shards: {', '.join(beside)}" if beside else "")
            + f"; make them with `{maker}`, then rerun `{launcher} {shlex.join(sys.argv)}`"
            + ("" if name == "tinyshakespeare" else f"; or try the small CPU config: {cd}python "
               f"prepare_data.py && {launcher} train_gpt2.py configs/shakespeare_cpu.toml"))
    return paths


def changed_shard(data_dir, name):
    """None if data_dir holds no {name}_manifest.json, or if its shards of dataset `name` are the files the
    manifest lists, at the sizes in bytes it lists (stat calls only); else the first difference, in words.
    Raises UserError for a file named like a shard of `name` that the manifest does not list."""
    data_dir, manifest = Path(data_dir), Path(data_dir) / f"{name}_manifest.json"
    listed = read_json(manifest, lambda m: {e["file"]: e["bytes"] for e in m["shards"]})
    if listed is None:
        return f"{manifest} lists no shards" if manifest.exists() else None
    for file, size in sorted(listed.items()):
        path = data_dir / file
        if not path.is_file():
            return f"{path}, which {manifest.name} lists, is missing"
        if path.stat().st_size != size:
            return f"{path} is {path.stat().st_size} bytes, not the {size} {manifest.name} lists"
    unlisted = sorted(f for f in os.listdir(data_dir)
                      if shard_name(f) in {(name, "train"), (name, "val")} and f not in listed)
    if unlisted:
        raise UserError(f"{data_dir / unlisted[0]} is named like a shard of {name} but {manifest.name} "
                        f"does not list it, so training would read it with them; move it out, or pass "
                        f"prepare_data.py --overwrite to remove it and make the shards again")
    return None


def max_token_ids(paths, cache_path, rank, world_size, reduce_max):
    """The largest token id of each shard in `paths`, a list of ints. A collective: from prepare_data.py's
    manifests or the JSON cache `cache_path` (in out_dir, as data_dir may be read-only) while the shard's
    size and mtime are as recorded, else read by rank i % world_size for shard i, rank 0 caching them.
    reduce_max(list of ints), called once on every rank, is the element-wise maximum over ranks."""
    cache = read_json(cache_path)
    cache = cache if isinstance(cache, dict) else {}
    known = _recorded_maxima(paths, cache)
    todo = [p for p in paths if p not in known]
    mine = [p for i, p in enumerate(paths) if i % world_size == rank and p in todo]
    scanned = {}
    with tqdm(total=sum(os.path.getsize(p) for p in mine) // 2, unit="tok", unit_scale=True,
              desc="checking token ids", disable=rank != 0, delay=1) as progress:
        for path in mine:
            ids, largest = read_tokens(path), 0
            for start in range(0, len(ids), 1 << 24):
                chunk = ids[start:start + (1 << 24)]
                largest = max(largest, int(chunk.max()))
                progress.update(len(chunk))
            scanned[path] = largest
    maxima = reduce_max([known.get(p, scanned.get(p, -1)) for p in paths])
    if rank == 0 and todo:
        for path, largest in zip(paths, maxima):
            if path in todo:
                st = path.stat()
                cache[str(path.resolve())] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                                              "max_token_id": largest}
        try:
            atomic_write(cache_path, lambda f: f.write(json.dumps(cache, indent=1).encode()))
        except OSError:
            pass  # only a cache: the next run reads the shards again
    return maxima


def _recorded_maxima(paths, cache):
    """{path: largest token id} for the shards of `paths` that an entry of a manifest beside them
    (by file name), of `cache` (by resolved path) or a shard's docs_index describes: same size and
    mtime."""
    listed = {}
    for manifest in {m for d in {p.parent for p in paths} for m in d.glob("*_manifest.json")}:
        entries = read_json(manifest, lambda m: {manifest.parent / e["file"]: e for e in m["shards"]})
        listed.update(entries or {})  # none in a file that is not a manifest: its shards are scanned
    known = {}
    for path in paths:
        st = path.stat()
        index = docs_index(path, st)  # the shuffled order's scan records it too
        for entry in (listed.get(path), cache.get(str(path.resolve())),
                      None if index is None else {"max_token_id": int(index[3]), "bytes": st.st_size,
                                                  "mtime_ns": st.st_mtime_ns}):
            if isinstance(entry, dict) and type(entry.get("max_token_id")) is int \
                    and entry["max_token_id"] >= 0 \
                    and (entry.get("bytes"), entry.get("mtime_ns")) == (st.st_size, st.st_mtime_ns):
                known[path] = entry["max_token_id"]
                break
    return known


def check_token_ids(paths, vocab_size, cache_path, rank, world_size, reduce_max):
    """Raises UserError, on every rank, for a shard of `paths` holding a token id >= vocab_size
    (another tokenizer's), before the first step. A collective; the arguments are max_token_ids'."""
    for path, largest in zip(paths, max_token_ids(paths, cache_path, rank, world_size, reduce_max)):
        if largest >= vocab_size:
            raise UserError(f"shard {path} holds token id {largest}, beyond vocab_size={vocab_size}: it "
                            f"was made with another tokenizer; remake it with prepare_data.py or raise "
                            f"vocab_size")


DOCS_INDEX = 2  # the format of .docs.npy: [2, shard bytes, mtime_ns, largest token id, starts...]


def docs_index(path, st):
    """The .docs.npy array beside the shard `path` (memory-mapped) while it describes the shard as
    os.stat gives it (st), else None."""
    try:
        saved = np.load(path.with_name(f".{path.name}.docs.npy"), mmap_mode="r")
        return saved if saved[:3].tolist() == [DOCS_INDEX, st.st_size, st.st_mtime_ns] else None
    except (OSError, ValueError, EOFError, IndexError):
        return None  # none yet, or not one of ours: made again


def document_starts(path, token):
    """The offsets in the shard `path` of its `token`s, where its documents start: a (D,) int64 array. Kept
    beside the shard in .{name}.docs.npy (docs_index) with the shard's largest token id, so that the
    one scan serves check_token_ids too; the first run to need it makes it, in memory alone if the
    directory is read-only."""
    path, st = Path(path), os.stat(path)
    saved = docs_index(path, st)
    if saved is not None:
        return np.array(saved[4:])
    tokens, chunk = read_tokens(path), 1 << 24
    starts = np.concatenate([[DOCS_INDEX, st.st_size, st.st_mtime_ns, tokens.max(initial=0)]] + [
        np.flatnonzero(tokens[i:i + chunk] == token) + i for i in range(0, len(tokens), chunk)])
    cache = path.with_name(f".{path.name}.docs.npy")
    mine = cache.with_name(f"{cache.name}.{os.getpid()}")  # the ranks of a node may make it at once
    try:
        atomic_write(mine, lambda f: np.save(f, starts))
        os.replace(mine, cache)
    except OSError:
        pass  # only a cache: the next run scans the shard again
    return starts[4:]


class DocumentRows:
    """The shuffled order's rows of a split: len() of them an epoch, each row_tokens = T + 1 long and
    starting at a document's `token` (document_starts) or row_tokens, 2 row_tokens, ... into a
    document longer than a row, a shard's first token counting as a document start (a document may
    go on from the shard before). In each shard the first row starts at its first token, and each
    next row at the last such start at most row_tokens after the row before's: short documents
    are packed into a row in order, the head of a document that a row ends in is read again by the
    next row from the document's start, and a long document is read whole, in pieces; each row fits
    in its shard. `reads` counts the tokens rows hold, `twice` those two rows hold (docs/data.md
    measures both). Row r is row r % len() of epoch r // len()'s permutation, drawn from (seed,
    epoch) alone; starts() gives its offset in the stream of the shards `paths` of `sizes` tokens.
    Raises UserError, naming `split` ("train split in DIR"), where the shards hold no such row."""
    PACKING = 2  # checkpoints record it: rows packed another way are other rows

    def __init__(self, paths, sizes, row_tokens, token, seed, split):
        rows, offset, self.reads, self.twice = [], 0, 0, 0
        for path, size in tqdm(list(zip(paths, sizes)), "finding document starts", unit="shard", delay=1,
                               disable=int(os.environ.get("RANK", 0)) != 0):  # the first run over new shards
            docs = document_starts(path, token)
            docs = np.concatenate([[0], docs[docs > 0]])  # a document may go on from the shard before
            pieces = (np.append(docs[1:], size) - docs - 1) // row_tokens + 1  # row starts in each document
            firsts = np.repeat(np.cumsum(pieces) - pieces, pieces)  # in order, as the documents are
            starts = np.repeat(docs, pieces) + row_tokens * (np.arange(len(firsts)) - firsts)
            starts = starts[starts + row_tokens <= size]
            following = (np.searchsorted(starts, starts + row_tokens, side="right") - 1).tolist()
            chosen, i = [0] if len(starts) else [], 0
            while chosen and (j := following[i]) != i:
                chosen.append(j)
                i = j
            rows.append(starts[chosen] + offset)
            if chosen:  # consecutive rows touch or overlap, so they hold one span of the shard
                self.reads += int(starts[i] - starts[0]) + row_tokens
                self.twice += (len(chosen) - 1) * row_tokens - int(starts[i] - starts[0])
            offset += size
        self.rows, self.seed, self.epoch, self.order = np.concatenate(rows), seed, None, None
        if len(self.rows) == 0:
            raise UserError(f"the {split} holds no row of seq_len+1 = {row_tokens} tokens, which must fit "
                            f"in a shard (the longest holds {max(sizes)} tokens): pass "
                            f"--data_order=sequential, or a lower seq_len")

    def __len__(self):
        return len(self.rows)

    def starts(self, first, n):
        """Stream offsets of rows first .. first + n - 1, counted across epochs: a (n,) int64 array."""
        out = []
        while n > 0:
            epoch, i = divmod(first, len(self.rows))
            if epoch != self.epoch:
                rng = np.random.default_rng([self.seed, epoch])
                self.epoch, self.order = epoch, rng.permutation(self.rows)
            take = min(n, len(self.rows) - i)
            out.append(self.order[i:i + take])
            first, n = first + take, n - take
        return np.concatenate(out)
