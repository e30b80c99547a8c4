"""Reads a run's config for train_gpt2.py, as nanoGPT's configurator.py does: a TOML file, then --key=value
(or --key value) overrides, each cast to its dataclass field's type and checked against its rule; --help
text from each field's comment. The scripts' ArgumentParser spells options as config keys are. Every
mistake is a UserError."""

import argparse
import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import shutil
import signal
import sys
import textwrap
import time
import tomllib
from pathlib import Path


RANK_ERROR_WAIT_S = 30  # see run()


class UserError(Exception):
    """Bad input (config, data, checkpoint): printed as one line that says how to fix it."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's line breaks and shows defaults but None, False, [] or named ones."""

    def _get_help_string(self, action):
        if action.default in (None, []) or action.default is False or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser for the scripts: options answer to --out_dir and --out-dir (not shown),
    --help shows the defaults, and abbreviations are off, as scripts that pass unknown arguments on
    to train_gpt2.py would take --micro_batch_size=4 for --micro_batch_sizes."""

    def __init__(self, *args, description=None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        spec = sys.modules["__main__"].__spec__  # set when run as python -m scripts.NAME
        kwargs.setdefault("prog", f"python -m {spec.name}" if spec else f"python {Path(sys.argv[0]).name}")
        if description:
            description = textwrap.dedent(description).strip("\n")
        super().__init__(*args, description=description, **kwargs)

    def print_help(self, file=None):
        print_quietly(self.format_help(), file)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, after --foo-bar[=value] of an option --foo_bar is spelled so (not after --)."""
        args = sys.argv[1:] if args is None else list(args)
        for i, arg in enumerate(args):
            if arg == "--":
                break
            name, eq, value = arg.partition("=")
            canonical = "--" + name[2:].replace("-", "_")
            if name.startswith("--") and canonical in self._option_string_actions:
                args[i] = canonical + eq + value
        return super().parse_known_args(args, namespace)


def print_quietly(text, file=None):
    """Prints text (on stdout by default); exits with status 0, not a traceback, if the reader has gone."""
    file = file or sys.stdout
    try:
        print(text, file=file, end="" if text.endswith("\n") else "\n", flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), file.fileno())  # the exit's flush goes nowhere
        sys.exit(0)


def run(main, script, interrupted="interrupted"):
    """Runs a command-line entry point, main(argv), and exits with what it returns. A UserError ends
    it with the one line `{script}: error: {message}` on stderr and exit status 1, Ctrl-C with
    `{script}: {interrupted}` and 130. Under torchrun a node's workers but LOCAL_RANK 0 wait RANK_ERROR_WAIT_S
    to be stopped: one line a node, even one whose peers are gone; it also goes to TORCHELASTIC_ERROR_FILE."""
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        line = f"{script}: error: {e}"
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # in the format of record's file, not a traceback
            info = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
            Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps({"message": info}))
        if os.environ.get("LOCAL_RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" in os.environ:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the training loop's handler defers it
            time.sleep(RANK_ERROR_WAIT_S)
        sys.exit(line)
    except KeyboardInterrupt:
        print(f"{script}: {interrupted}", file=sys.stderr)
        sys.exit(130)


def cast_value(key, raw, typ):
    """A TOML or command-line value as a field's type (1e4 -> 10000); UserError names key, value, type."""
    try:
        if isinstance(raw, (list, dict)) or (isinstance(raw, bool) and typ is not bool):
            raise ValueError  # a TOML array, table or boolean where a number or string belongs
        if typ is bool:  # TOML's spellings, on the command line too
            return raw if isinstance(raw, bool) else {"true": True, "false": False}[raw]
        if typ is int:
            value = float(raw)
            if value != int(value) or abs(value) >= 2**63:  # the range of torch's and numpy's int64
                raise ValueError
            return int(value)
        if typ is float:
            value = float(raw)
            if not math.isfinite(value):
                raise UserError(f"config key {key!r} must be a finite number, got {raw!r}")
            return value
        return str(raw)
    except (ValueError, OverflowError, KeyError):
        raise UserError(f"config key {key!r}: cannot read {raw!r} as {typ.__name__}"
                        + (": pass true or false" if typ is bool else "")) from None


def load_config(argv, config_class, rules):
    """Builds a config_class from `[CONFIG.toml] [--key=value | --key value ...]`. `rules` maps keys to
    (a predicate or a tuple of allowed values, the rule in words). Raises UserError for a missing or
    malformed config file or argument, an unknown key, or a value of the wrong type or rule."""
    fields = {f.name: f.type for f in dataclasses.fields(config_class)}
    values = {}
    if argv and not argv[0].startswith("--"):
        path = Path(argv[0])
        if not path.is_file():
            what = "is a directory, not a TOML file" if path.is_dir() else "not found"
            raise UserError(f"config file {path} {what} (see configs/ for examples)")
        try:  # utf-8-sig: a byte order mark, as some Windows editors write, is no TOML error
            values.update(tomllib.loads(path.read_bytes().decode("utf-8-sig")))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            # tomllib says "Cannot overwrite a value" of a key given twice
            message = re.sub(r"^is not valid TOML: Cannot overwrite a value \(at (.*)\)$",
                             r"gives a key twice, the second time at \1: keep one of them",
                             f"is not valid TOML: {e}")
            raise UserError(f"config file {path} {message}") from None
        argv = argv[1:]
    while argv:
        arg, argv = argv[0], argv[1:]
        if "=" not in arg and argv and not argv[0].startswith("--"):  # --key value, as argparse's
            arg, argv = f"{arg}={argv[0]}", argv[1:]
        if arg.partition("=")[0] == "--config" or (not arg.startswith("--") and arg.endswith(".toml")):
            raise UserError(f"pass the config file first and without --config: CONFIG.toml "
                            f"[--key=value ...] (got {arg!r})")
        if not arg.startswith("--") or "=" not in arg:
            raise UserError(f"cannot parse argument {arg!r}: write overrides as --key=value or --key value")
        key, raw = arg[2:].split("=", 1)
        values[key.replace("-", "_")] = raw  # --max-steps, as the scripts' options allow
    kwargs = {}
    for key, raw in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"unknown config key {key!r}{hint}")
        kwargs[key] = cast_value(key, raw, fields[key])
    config = config_class(**kwargs)
    for key, (allowed, rule) in rules.items():
        value = getattr(config, key)
        if not (value in allowed if isinstance(allowed, tuple) else allowed(value)):
            raise UserError(f"config key {key!r} must be {rule}, got {value!r}")
    return config


def check_options(parser, args, rules):
    """Ends with parser.error(`--key must be RULE, got VALUE`) at the first option of args, as parser parsed
    them, that breaks its rule; `rules` maps option names to (a predicate, the rule in words), as
    load_config's rules do."""
    for key, (allowed, rule) in rules.items():
        if not allowed(getattr(args, key)):
            parser.error(f"--{key} must be {rule}, got {getattr(args, key)}")


def toml_value(value):
    """`value` (a bool, int, float or str) as TOML writes it: true/false, 6e-05, inf, "escaped"."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # JSON's string escapes are TOML's, but for DEL, which TOML escapes
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)


def help_lines(config_class, width=None):
    """`--key=default  description` lines of config_class's fields, from their comments, `width` wide."""
    if width is None:
        width = shutil.get_terminal_size().columns - 2
    source = inspect.getsource(config_class)
    comments = dict(re.findall(r"^    (\w+): \w+ = .*?  # (.*)$", source, re.M))
    keys = {f.name: f"  --{f.name}={toml_value(f.default)}" for f in dataclasses.fields(config_class)}
    column = max((len(k) for k in keys.values() if len(k) <= 40), default=0) + 2
    lines = []
    for name, key in keys.items():
        text = textwrap.wrap(comments[name], max(width - column, 20), break_on_hyphens=False)
        lines.append(key if len(key) + 2 > column else key.ljust(column) + text.pop(0))
        lines += [" " * column + part for part in text]
    return lines
