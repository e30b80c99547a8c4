"""README.md and docs/ against the code, so that they cannot drift: every relative link resolves
(anchors included), every flag that a command in them passes is one its program takes, every
repository path they name exists, and every example console line has the shape the training
prints."""

import dataclasses
import importlib
import re
import shlex
import subprocess

import pytest

import prepare_data
from conftest import ROOT, TINY, make_shards, run_training
from train_gpt2 import Config

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
# scripts that pass the arguments they do not take on to train_gpt2.py
PASS_ON = {"bench", "check_equivalence", "memory_plan"}
OTHER_TOOLS = {"--standalone", "--nproc_per_node", "--nnodes", "--node_rank", "--rdzv-backend",
               "--rdzv-endpoint", "--rdzv-id", "--max-restarts", "--no-python",  # torchrun's
               "--index-url", "--durations", "--dist", "--logdir",  # pip's, pytest's, TensorBoard's
               "--key"}  # --key=value, the form of an override
# the shapes of train_gpt2.py's console lines that the docs quote
LINES = {
    "train": r"step +\d+/\d+ \| loss: \d+\.\d{6} \| lr \d\.\d{4}e[-+]\d\d( \| muon_lr \d\.\d{4}e[-+]\d\d)? \| "
             r"norm: \d+\.\d{4} \| "
             r"dt: \d+\.\d\dms \| tok/sec: \d+\.\d\d( \| mfu: \d+\.\d%)?( \| eta \d+:\d\d:\d\d)?"
             r"( \| update skipped: (non-finite loss or gradient"
             r"|float16 overflow, loss scale halved to \d+))?",
    "eval": r"step +\d+ \| val loss \d+\.\d{4}( \| val loss rows \d+\.\d{4})?",
    "hellaswag": r"step +\d+ \| hellaswag acc_norm \d\.\d{4} \| acc \d\.\d{4} \| \d+ examples",
    "sample": r"sample at step \d+: ['\"].*",  # the text's repr, abridged in the docs
    "saved": r"saved \S+/ckpt_\d{7}\.pt",
    "batch": r"world_size \d+ \| device \S+ \| total batch \d+ tokens = \d+ x \d+ x \d+ x \d+ grad "
             r"accum steps",
    "dtype": r"dtype (bfloat16|float16 with loss scaling|float32): .+",
    "epochs": r"max_steps=\d+ x \d+ tokens a step = [\d,]+ tokens: \d+\.\d epochs of (the [\d,]+ train tokens|"
              r"[\d,]+ rows, each epoch reading \d+\.\d% of the [\d,]+ train tokens \(\d+\.\d% twice\))",
    "attention": r"attention: [A-Z_]+, (torch's choice of kernel for \w+ \(sdpa_backend=auto\)"
                 r"|set by sdpa_backend=\w+(; torch.compile's caches off, as their keys ignore the kernel)?)",
}
# words of how or where the repository was made, which docs and comments never speak of
BUILT = r"\b(lent|sessions?|this task|before the restructure|since removed)\b"


def heading_anchors(doc):
    """The anchors GitHub makes of a markdown file's headings: lower case, punctuation dropped,
    spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", doc.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves_anchors_included():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists() or (anchor and anchor not in heading_anchors(path)):
                broken.append(f"{doc.name}: {target}")
    assert broken == []


def flags_of(main, capsys):
    """The --options that a command-line entry point's --help lists as its own."""
    with pytest.raises(SystemExit):
        main(["--help"])
    return set(re.findall(r"^  (?:-\w, )?(--[a-z_]+)", capsys.readouterr().out, re.M))


def commands(doc):
    """Each command of the doc's code blocks as a list of words: lines joined at a trailing
    backslash, comments dropped, split at &&, ; and |."""
    found = []
    for block in FENCE.findall(doc.read_text()):
        text = re.sub(r"\\\n\s*", " ", block.strip("`"))
        for line in text.splitlines()[1:]:
            line = re.sub(r"(^|\s)#.*", "", line)
            for part in re.split(r"&&|;|\|", line):
                try:
                    found.append(shlex.split(part))
                except ValueError:  # an example output line, not a command
                    continue
    return found


def test_every_flag_the_docs_name_exists(capsys):
    """In a documented command, each flag is one its program takes; anywhere else, one that some
    program of the repository, or torchrun, pip, pytest or TensorBoard, takes."""
    config_keys = {f"--{f.name}" for f in dataclasses.fields(Config)}
    takes = {"train_gpt2.py": config_keys, "prepare_data.py": flags_of(prepare_data.main, capsys)}
    for path in sorted((ROOT / "scripts").glob("[a-z]*.py")):
        flags = flags_of(importlib.import_module(f"scripts.{path.stem}").main, capsys)
        takes[f"scripts.{path.stem}"] = flags | (config_keys if path.stem in PASS_ON else set())
    for name in ("bench_data_order", "compare_data_orders", "bench_sample", "bench_kernels"):  # docs/ cite them
        takes[f"tests.{name}"] = flags_of(importlib.import_module(f"tests.{name}").main, capsys)
    anywhere = set().union(*takes.values(), OTHER_TOOLS)
    unknown = [f"{doc.name}: {flag}" for doc in DOCS
               for flag in re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", doc.read_text())
               if flag not in anywhere and "--" + flag[2:].replace("-", "_") not in anywhere]
    for doc in DOCS:
        for words in commands(doc):
            program = next((i for i, w in enumerate(words) if w.split("/")[-1] in takes), None)
            if program is None:
                continue
            flags = {"--" + w[2:].split("=")[0].replace("-", "_")
                     for w in words[program + 1:] if w.startswith("--")}
            unknown += [f"{doc.name}: {words[program]} {flag}" for flag in
                        sorted(flags - takes[words[program].split("/")[-1]])]
    assert unknown == []


def test_every_config_key_the_docs_set_exists():
    """`key=value` in a doc's inline code, a code call's keyword arguments and pip's aside."""
    keys = {f.name for f in dataclasses.fields(Config)}
    unknown = [f"{doc.name}: {span}" for doc in DOCS for span in re.findall(r"`([^`\n]+)`", doc.read_text())
               if "(" not in span and not span.startswith("pip ")
               for key in re.findall(r"(?<![\w.-])([a-z]\w*)=", span) if key not in keys]
    assert unknown == []


def test_every_default_the_docs_state_is_the_configs():
    """`key=value` followed by "the default" or "by default" in a doc: value is Config's default for key."""
    defaults = {f.name: str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
                for f in dataclasses.fields(Config)}
    stated = [(doc.name, key, value) for doc in DOCS for key, value in
              re.findall(r"`([a-z]\w*)=([^`\s]+)`,? \(?(?:the|by) default", doc.read_text())]
    assert len(stated) >= 4
    assert [(doc, key, value) for doc, key, value in stated if defaults.get(key) != value] == []


def test_every_repository_path_the_docs_name_exists():
    named = set()
    for doc in DOCS:
        text = doc.read_text()
        named |= set(re.findall(r"(?<![\w./-])((?:configs|scripts|gpt2_ddp|docs|tests|assets|\.ci)"
                                r"/[\w./-]*\w)", text))
        named |= {f"scripts/{name}.py" for name in re.findall(r"-m scripts\.([a-z_]+)\b", text)}
    missing = [path for path in sorted(named) if not (ROOT / path).exists()]
    assert missing == []


def test_the_docs_console_lines_have_the_shape_the_training_prints(tmp_path):
    """A run that prints each kind of line matches the shapes, and so does every line of that kind
    that a doc's example output shows."""
    make_shards(tmp_path / "data")
    proc = run_training([*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}",
                         "--max_steps=2", "--total_batch_size=64", "--sample_interval=2",
                         "--vocab_size=50304", "--data_order=shuffled"])
    printed = {kind: [line for line in proc.stdout.splitlines() if re.fullmatch(shape, line)]
               for kind, shape in LINES.items() if kind != "hellaswag"}
    assert all(printed.values()), proc.stdout
    quoted = [line for doc in DOCS for block in FENCE.findall(doc.read_text())
              for line in block.splitlines()
              if re.match(r"(step|sample at step|saved|world_size|dtype|max_steps=\d+|attention:) ", line)]
    assert quoted and [line for line in quoted
                       if not any(re.fullmatch(shape, line) for shape in LINES.values())] == []


def test_docs_and_comments_speak_to_the_reader_not_of_how_the_repository_was_built():
    """README.md, docs/ and every tracked text file outside tests/ (code, comments, scripts,
    configs) hold none of the words of BUILT, nor, in a doc, "this machine" (in code it is the user's)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split("\0")
    files = {ROOT / p for p in tracked if p and not p.startswith(("tests/", "assets/"))
             and (ROOT / p).suffix in {".md", ".py", ".sh", ".toml", ".txt", ""}} | set(DOCS)
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in sorted(files) if path.is_file()
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if re.search(BUILT + (r"|\bthis machine\b" if path.suffix == ".md" else ""), line, re.I)]
    assert not hits, "speak to the reader of the repository, not of how it was built:\n" + "\n".join(hits)


def test_the_hellaswag_references_are_build_nanogpts_as_the_docs_quote_them():
    """The script's and the plot's reference acc_norm of GPT-2 are the figures the docs quote."""
    from scripts import hellaswag, plot
    after_training = (ROOT / "docs" / "after_training.md").read_text()
    gpt2, xl = hellaswag.GPT2_ACC_NORM["gpt2"], hellaswag.GPT2_ACC_NORM["gpt2-xl"]
    assert f"build-nanogpt: acc_norm {gpt2} (gpt2-xl: {xl})" in after_training
    assert f"{gpt2} acc_norm in build-nanogpt (gpt2-xl: {xl})" in hellaswag.__doc__
    gpt2_124m, gpt3_125m = plot.REFERENCES["GPT-2 124M"], plot.REFERENCES["GPT-3 125M"]
    assert f"GPT-2 124M ({gpt2_124m}) and GPT-3 125M ({gpt3_125m})" in after_training and gpt2_124m == gpt2
