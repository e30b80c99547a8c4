"""The maintainers' size limits, a check of its own that .ci/run calls after the tests, so a fork
that grows a file still passes pytest: Python outside tests/ at most 5300 lines and none over 110
characters, train_gpt2.py at most 1000 lines, train() at most 120 and any other function 80.

    python -m tests.check_limits     # prints each limit broken and exits 1, else one line
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"lines": 5300, "width": 110, "train_gpt2.py": 1000, "train()": 120, "function": 80}


def broken_limits():
    """One line per limit that the tracked Python files outside tests/ break."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    lines = {p: (ROOT / p).read_text().splitlines() for p in listed if not p.startswith("tests/")}
    broken = []
    total = sum(map(len, lines.values()))
    print(f"Python outside tests/: {total} lines; train_gpt2.py: {len(lines.get('train_gpt2.py', []))}")
    if total > LIMITS["lines"]:
        broken.append(f"Python outside tests/ is {total} lines, over {LIMITS['lines']}")
    broken += [f"{p}:{i} is {len(line)} characters, over {LIMITS['width']}"
               for p, text in lines.items() for i, line in enumerate(text, 1) if len(line) > LIMITS["width"]]
    if len(lines.get("train_gpt2.py", [])) > LIMITS["train_gpt2.py"]:
        broken.append(f"train_gpt2.py is {len(lines['train_gpt2.py'])} lines, over {LIMITS['train_gpt2.py']}")
    for path, text in lines.items():
        for node in ast.walk(ast.parse("\n".join(text))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = LIMITS["train()" if (path, node.name) == ("train_gpt2.py", "train") else "function"]
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    broken.append(f"{path}: {node.name}() is {length} lines, over {limit}")
    return broken


if __name__ == "__main__":
    broken = broken_limits()
    print("\n".join(broken) or f"the size limits hold: {LIMITS}")
    sys.exit(1 if broken else 0)
