"""The maintainers' size limits, a check of its own that .ci/run calls after the tests, so a fork
that grows a file still passes pytest. The limits count code lines, so that docstrings, comments
and blank lines never have to be cut to fit: Python outside tests/ at most 3900 code lines,
train_gpt2.py at most 760, train() at most 110 and any other function 70; and no line of those
files over 110 characters.

A code line is one that holds a token other than a comment, a line break (NL, NEWLINE), INDENT or
DEDENT, and outside a docstring (the string that is the first statement of a module, class or
function). A token over several lines counts each of them: a multi-line string that is not a
docstring is code. A function's count is its code lines from its `def` to its end (decorators
aside), a nested function's lines counted in the function around it as well as in its own.

    python -m tests.check_limits     # prints the counts, then each limit broken (exit 1) or one line
"""

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"code lines": 3900, "width": 110, "train_gpt2.py": 760, "train()": 110, "function": 70}
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}


def code_lines(source):
    """The set of line numbers (from 1) of Python text `source` that hold code, as the module
    docstring defines it. Raises SyntaxError for text that is not Python."""
    tree = ast.parse(source)
    docstrings = set()  # (first line, last line) of each docstring's string
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.add((first.lineno, first.end_lineno))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in NOT_CODE or (token.type == tokenize.STRING
                                      and (token.start[0], token.end[0]) in docstrings):
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def broken_limits():
    """One line per limit that the tracked Python files outside tests/ break; prints their raw and
    code line counts first."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    texts = {p: (ROOT / p).read_text() for p in listed if not p.startswith("tests/")}
    code = {p: code_lines(text) for p, text in texts.items()}
    raw = {p: len(text.splitlines()) for p, text in texts.items()}
    total, total_code = sum(raw.values()), sum(map(len, code.values()))
    main_code = len(code.get("train_gpt2.py", ()))
    print(f"Python outside tests/: {total} lines, {total_code} of code; train_gpt2.py: "
          f"{raw.get('train_gpt2.py', 0)} lines, {main_code} of code")
    broken = []
    if total_code > LIMITS["code lines"]:
        broken.append(f"Python outside tests/ is {total_code} code lines, over {LIMITS['code lines']}")
    broken += [f"{p}:{i} is {len(line)} characters, over {LIMITS['width']}" for p, text in texts.items()
               for i, line in enumerate(text.splitlines(), 1) if len(line) > LIMITS["width"]]
    if main_code > LIMITS["train_gpt2.py"]:
        broken.append(f"train_gpt2.py is {main_code} code lines, over {LIMITS['train_gpt2.py']}")
    for path, text in texts.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = LIMITS["train()" if (path, node.name) == ("train_gpt2.py", "train") else "function"]
                length = len([n for n in code[path] if node.lineno <= n <= node.end_lineno])
                if length > limit:
                    broken.append(f"{path}: {node.name}() is {length} code lines, over {limit}")
    return broken


if __name__ == "__main__":
    broken = broken_limits()
    print("\n".join(broken) or f"the size limits hold: {LIMITS}")
    sys.exit(1 if broken else 0)
