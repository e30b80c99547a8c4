"""HellaSwag scoring against an independent scorer (transformers on the same weights, its own
tokenization loop), and the data file's errors. W=1 against W=2 and 4: test_equivalence.py's runs
log HellaSwag, compared there with ==."""

import json
import re
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
from torch.nn import functional as F
from transformers import GPT2LMHeadModel

from conftest import ROOT, matmul_precision_kept, write_hellaswag
from gpt2_ddp import hellaswag, precision
from gpt2_ddp.configurator import UserError
from gpt2_ddp.tokenizer import gpt2_encoding
from scripts.hellaswag import main as hellaswag_main
from train_gpt2 import GPT

NATURAL = [  # examples in the official schema, shortened from the style of the val split
    {"ctx": "A man is sitting on a roof. He", "label": 3, "endings": [
        "is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
        "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
    {"ctx": "A woman is outside with a bucket and a dog. The dog is running around trying to avoid "
            "a bath. She", "label": 2, "endings": [
        "rinses the bucket off with soap and blow dry the dog's head.",
        "uses a hose to keep it from getting soapy.", "gets the dog wet, then it runs away again.",
        "gets into a bath tub with the dog."]},
]


@pytest.fixture(scope="module")
def examples_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl"
    write_hellaswag(path, 6)
    with open(path, "a") as f:
        for example in NATURAL:
            f.write(json.dumps({**example, "ind": 0, "split": "val"}) + "\n")
    return path


def independent_scores(model, example):
    """transformers' logits for each candidate, scored on its ending's tokens."""
    enc = gpt2_encoding()
    ctx = enc.encode(example["ctx"])
    sums, means = [], []
    for ending in example["endings"]:
        end = enc.encode(" " + ending)
        tokens = torch.tensor([ctx + end])
        with torch.no_grad():
            logits = model(tokens).logits[0]
        losses = [F.cross_entropy(logits[t - 1], tokens[0, t]).item()
                  for t in range(len(ctx), len(ctx) + len(end))]
        sums.append(sum(losses))
        means.append(sum(losses) / len(losses))
    return sums, means


@pytest.mark.compat
def test_scores_equal_an_independent_scorer(hf_tiny, examples_file):
    reference = GPT2LMHeadModel.from_pretrained(hf_tiny).eval()
    model = GPT.from_pretrained(hf_tiny)
    config = model.config
    examples = hellaswag.load_examples(examples_file)
    assert len(examples) == 8
    correct_norm = correct = 0
    for example in examples:
        tokens, mask = hellaswag.render(example, gpt2_encoding(), config.block_size)
        total, mean = hellaswag.ending_losses(model, tokens, mask)
        sums, means = independent_scores(reference, example)
        torch.testing.assert_close(total, torch.tensor(sums), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mean, torch.tensor(means), rtol=1e-5, atol=1e-5)
        assert int(mean.argmin()) == min(range(4), key=means.__getitem__)
        correct_norm += min(range(4), key=means.__getitem__) == example["label"]
        correct += min(range(4), key=sums.__getitem__) == example["label"]
    # a bfloat16 run scores under its autocast: near float32's scores, not the same bits
    autocast = precision.autocast("bfloat16", torch.device("cpu"))
    bf16 = hellaswag.ending_losses(model, tokens, mask, autocast)
    for got, float32 in zip(bf16, hellaswag.ending_losses(model, tokens, mask)):
        assert not torch.equal(got, float32)
        torch.testing.assert_close(got, float32, rtol=5e-2, atol=0)
    rendered = hellaswag.render_all(examples, config.block_size, config.vocab_size)
    result = hellaswag.evaluate(model.train(), rendered, torch.device("cpu"))
    assert result == {"hellaswag_acc_norm": correct_norm / 8, "hellaswag_acc": correct / 8,
                      "hellaswag_examples": 8}
    assert not any(m.training for m in model.modules())  # scored without dropout, left in eval mode


def test_standalone_script_scores_a_model(gpt_tiny, examples_file):
    proc = subprocess.run([sys.executable, "-m", "scripts.hellaswag", str(gpt_tiny), "--path",
                           str(examples_file), "--examples", "5"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    model = GPT.from_pretrained(gpt_tiny)
    config = model.config
    examples = hellaswag.render_all(hellaswag.load_examples(examples_file, 5), config.block_size,
                                    config.vocab_size)
    result = hellaswag.evaluate(model, examples, torch.device("cpu"))
    assert proc.stdout == f"{gpt_tiny}: {hellaswag.summary(result)}\n"  # no reference for one's own model
    assert "5 examples" in proc.stdout


def test_the_script_quotes_build_nanogpts_score_beside_gpt2s(gpt_tiny, examples_file, monkeypatch, capsys):
    """For gpt2 (and gpt2-xl) the script prints, after its own score, the acc_norm build-nanogpt reports;
    it scores with TF32 matmuls, as build-nanogpt did."""
    tiny = GPT.from_pretrained(gpt_tiny)
    monkeypatch.setattr(GPT, "from_pretrained", lambda source, device: tiny)  # offline: it stands in for gpt2
    with matmul_precision_kept():
        torch.set_float32_matmul_precision("highest")
        hellaswag_main(["gpt2", "--path", str(examples_file), "--examples", "2", "--device", "cpu"])
        assert torch.get_float32_matmul_precision() == "high"
    assert capsys.readouterr().out.splitlines()[1:] == ["build-nanogpt reports acc_norm 0.2955 for gpt2"]


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[:-30], "line 8 is not complete JSON \\(a truncated or corrupted file\\?\\)"),
    (lambda text: text.replace('roof. He", "label": 3', 'roof. He", "label": 7'),
     "line 7 is not a HellaSwag example"),
    (lambda text: text.replace('roof. He", "label": 3', 'roof. He", "label": 4'),  # one past the last
     "line 7 is not a HellaSwag example"),
    (lambda text: text.replace('"ctx"', '"context"', 1), "line 1 is not a HellaSwag example"),
    (lambda text: text.replace('"ctx": "A man is sitting on a roof. He"', '"ctx": null'),
     "line 7 is not a HellaSwag example"),
    (lambda text: text.replace('"endings": [', '"endings": ["one more", ', 1),
     "line 1 is not a HellaSwag example \\(ctx: str, endings: 4 str, label: 0-3\\)"),
    (lambda text: text.replace("roof", "r\udce9of"), "line 7 is not complete JSON"),  # Latin-1 é
    (lambda text: "", "holds no examples"),
])
def test_a_damaged_file_gets_a_one_line_error(examples_file, tmp_path, damage, message):
    path = tmp_path / "damaged.jsonl"
    path.write_text(damage(examples_file.read_text()), errors="surrogateescape")
    with pytest.raises(UserError, match=message):
        hellaswag.load_examples(path)


def test_a_truncated_file_fails_the_script_with_one_line(gpt_tiny, examples_file, tmp_path):
    path = tmp_path / "truncated.jsonl"
    path.write_bytes(examples_file.read_bytes()[:-30])
    proc = subprocess.run([sys.executable, "-m", "scripts.hellaswag", str(gpt_tiny), "--path", str(path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith("hellaswag.py: error: ") and proc.stderr.count("\n") == 1
    assert "delete" in proc.stderr and "Traceback" not in proc.stderr


def test_a_negative_number_of_examples_is_refused(gpt_tiny, examples_file, capsys):
    with pytest.raises(SystemExit) as excinfo:
        hellaswag_main([str(gpt_tiny), "--path", str(examples_file), "--examples", "-5"])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.endswith(
        ": error: --examples must be >= 0 (0: all), got -5\n")


def test_a_label_written_as_a_digit_string_is_read_as_its_number(tmp_path):
    """Some copies of the val split write "label": "2"; it is the same example as "label": 2."""
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": label}) + "\n"
                            for label in ("2", 2)))
    assert [example["label"] for example in hellaswag.load_examples(path)] == [2, 2]


def test_blank_lines_are_skipped_and_a_missing_file_names_where_it_comes_from(tmp_path):
    path = tmp_path / "val.jsonl"
    with pytest.raises(UserError, match=f"^HellaSwag file {path} not found \\(it is downloaded from "
                                        f"{re.escape(hellaswag.URL)} when missing\\)$"):
        hellaswag.load_examples(path)
    example = json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1})
    path.write_text(f"\n{example}\n \n")
    assert [example["label"] for example in hellaswag.load_examples(path)] == [1]


def test_a_model_with_a_smaller_vocabulary_is_refused(examples_file):
    examples = hellaswag.load_examples(examples_file)
    with pytest.raises(UserError, match="example 7 has GPT-2 token id .* beyond the model's "
                                        "vocab_size=512: HellaSwag needs GPT-2's vocabulary"):
        hellaswag.render_all(examples, 32, 512)


def test_a_token_id_equal_to_vocab_size_is_refused_and_one_below_is_scored():
    """The embedding's rows are 0 .. vocab_size - 1: an example whose largest GPT-2 token id equals
    vocab_size is refused, and with vocab_size one above it the example renders."""
    example = NATURAL[1]
    largest = int(hellaswag.render(example, gpt2_encoding(), 64)[0].max())
    with pytest.raises(UserError, match=f"example 1 has GPT-2 token id {largest}, beyond"):
        hellaswag.render_all([example], 64, largest)
    assert hellaswag.render_all([example], 64, largest + 1)[0][2] == example["label"]


def test_a_candidate_longer_than_block_size_keeps_its_ending_and_cuts_the_contexts_start():
    """render() at a block_size below context + ending keeps each candidate's last block_size tokens:
    the whole ending, masked 1, after the end of the context, masked 0."""
    enc, example, block_size = gpt2_encoding(), NATURAL[1], 20  # a 23-token context
    ctx = enc.encode_ordinary(example["ctx"])
    tokens, mask = hellaswag.render(example, enc, block_size)
    assert tokens.shape == mask.shape == (4, block_size)
    for row, ending in enumerate(example["endings"]):
        end = enc.encode_ordinary(" " + ending)
        assert tokens[row].tolist() == (ctx + end)[-block_size:]
        assert mask[row].tolist() == [0] * (block_size - len(end)) + [1] * len(end)


def test_a_download_of_every_example_is_written_byte_for_byte_with_its_bar_at_100(tmp_path, monkeypatch,
                                                                                    capsys):
    """The whole validation split, from a stand-in URL, lands at `path` as it was served, and its
    progress bar ends full."""
    served = tmp_path / "served.jsonl"
    served.write_text("".join(f'{{"ctx": "example {i}"}}\n' for i in range(hellaswag.VAL_EXAMPLES)))
    monkeypatch.setattr(hellaswag, "URL", served.as_uri())
    target = tmp_path / "data" / "hellaswag_val.jsonl"
    hellaswag.download(target)
    assert target.read_bytes() == served.read_bytes()
    assert "100%" in capsys.readouterr().err


def test_a_download_without_every_example_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    """A cut-short download would score a subset and report it as HellaSwag's validation accuracy."""
    short = tmp_path / "short.jsonl"
    short.write_text('{"ctx": "a"}\n' * 3)
    monkeypatch.setattr(hellaswag, "URL", short.as_uri())
    target = tmp_path / "data" / "hellaswag" / "hellaswag_val.jsonl"  # a fresh clone has no data/ yet
    with pytest.raises(UserError) as excinfo:
        hellaswag.download(target)
    assert str(excinfo.value) == (f"{short.as_uri()} gave 3 lines, not the 10042 examples "
                                  f"of HellaSwag's validation split: try again, or download it by hand to "
                                  f"{target}")
    assert not target.exists()


def test_the_summary_line_names_each_accuracy_and_the_example_count():
    result = {"hellaswag_acc_norm": 0.25, "hellaswag_acc": 0.5, "hellaswag_examples": 4}
    assert hellaswag.summary(result) == "hellaswag acc_norm 0.2500 | acc 0.5000 | 4 examples"


def test_no_network_names_the_url_and_where_to_put_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(hellaswag, "URL", "http://127.0.0.1:9/hellaswag_val.jsonl")  # refused
    target = tmp_path / "hellaswag" / "hellaswag_val.jsonl"
    with pytest.raises(UserError, match=f"downloading it from {hellaswag.URL} failed .* put it at "
                                        f"{target}"):
        hellaswag.download(target)
    assert not target.exists() and not list(target.parent.iterdir())  # no partial file left


def test_a_server_that_never_answers_times_out_in_one_line(tmp_path, monkeypatch):
    """The download asks urlopen for a timeout, so a stalled server ends in the one line, not a hang
    (the test shortens the timeout to half a second)."""
    server = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    real = urllib.request.urlopen

    def urlopen(url, timeout=None):
        assert timeout is not None, "no timeout: a stalled server hangs the download"
        return real(url, timeout=0.5)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(hellaswag, "URL", f"http://127.0.0.1:{server.getsockname()[1]}/hellaswag_val.jsonl")
    with server, pytest.raises(UserError, match=f"downloading it from {hellaswag.URL} failed \\(.*timed out"):
        hellaswag.download(tmp_path / "hellaswag_val.jsonl")


def test_training_downloads_a_missing_hellaswag_file_once_and_reads_a_present_one(tmp_path, monkeypatch):
    """examples_for_training fetches the file where hellaswag_path names none, and not where it is."""
    from train_gpt2 import load_config
    path, fetched = tmp_path / "hellaswag_val.jsonl", []
    monkeypatch.setattr(hellaswag, "download", lambda p: fetched.append(p) or write_hellaswag(p, 3))
    config = load_config([f"--hellaswag_path={path}", "--hellaswag_interval=1", "--vocab_size=50304"])
    first = hellaswag.examples_for_training(config)
    second = hellaswag.examples_for_training(config)
    assert fetched == [path] and len(first) == len(second) > 0


def test_on_rank_1_training_leaves_the_download_to_rank_0_and_reads_its_file(tmp_path, monkeypatch):
    """Rank 1 of 2 (the process group simulated) does not fetch a missing file: rank 0 does, within
    the collective that rank 1 waits in, and rank 1 then reads the file rank 0 wrote."""
    import torch.distributed as dist
    from train_gpt2 import load_config
    path, fetched = tmp_path / "hellaswag_val.jsonl", []
    monkeypatch.setattr(hellaswag, "download", lambda p: fetched.append(p) or write_hellaswag(p, 3))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    # rank 0's download ends within the all-gather that rank 1 waits in
    monkeypatch.setattr(dist, "all_gather_object", lambda errors, error: write_hellaswag(path, 3)
                        or errors.__setitem__(slice(None), [None, error]))
    config = load_config([f"--hellaswag_path={path}", "--hellaswag_interval=1", "--vocab_size=50304"])
    assert len(hellaswag.examples_for_training(config)) > 0 and fetched == []


def test_a_stop_ends_the_evaluation_before_the_next_example(gpt_tiny, examples_file):
    """check_stop runs before each example: where it raises Stopped at the third, two were scored."""
    from gpt2_ddp.collectives import Stopped
    model = GPT.from_pretrained(gpt_tiny)
    examples = hellaswag.render_all(hellaswag.load_examples(examples_file, 5), model.config.block_size,
                                    model.config.vocab_size)
    checks, scored = [], []
    model.register_forward_hook(lambda *args: scored.append(1))

    def check_stop():
        checks.append(1)
        if len(checks) == 3:
            raise Stopped

    with pytest.raises(Stopped):
        hellaswag.evaluate(model, examples, torch.device("cpu"), check_stop=check_stop)
    assert len(checks) == 3 and len(scored) == 2
