"""The repository's layout, read from the tracked files: the top level holds the design's files and
one package, no module of the package imports a script, no module imports another that imports
it back, and nothing edits sys.path but tests/conftest.py. The size limits are tests/check_limits.py's."""

import ast
import re
import subprocess

from conftest import ROOT

TOP_LEVEL = {"train_gpt2.py", "prepare_data.py", "configs", "scripts", "requirements.txt", "README.md",
             "pytest.ini", "tests", "docs", "assets", ".ci", ".gitignore", "gpt2_ddp"}


def tracked(suffix=""):
    """The repository's tracked paths (relative to ROOT) that end with `suffix`."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [path for path in out.stdout.splitlines() if path.endswith(suffix)]


def module_name(path):
    """gpt2_ddp/muon.py -> gpt2_ddp.muon, train_gpt2.py -> train_gpt2."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def imported(path):
    """Every module name a file imports, at its top or inside a function: `import a.b` gives a.b,
    `from a import b` gives a and a.b (b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def import_graph():
    """{module: the project modules it imports} over train_gpt2, prepare_data, gpt2_ddp and scripts."""
    files = [p for p in tracked(".py") if not p.startswith("tests/")]
    modules = {module_name(p): p for p in files}
    return {name: imported(path) & modules.keys() - {name} for name, path in modules.items()}


def test_the_top_level_is_the_designs_files_and_one_package():
    assert {path.split("/")[0] for path in tracked()} == TOP_LEVEL


def test_no_module_of_the_package_imports_a_script():
    for name, deps in import_graph().items():
        if name.startswith("gpt2_ddp"):
            assert not {d for d in deps if not d.startswith("gpt2_ddp")}, name


def test_no_import_circle():
    graph = import_graph()

    def reaches(start, goal, seen):
        return any(dep == goal or (dep not in seen and reaches(dep, goal, seen | {dep}))
                   for dep in graph.get(start, ()))

    circles = [name for name in graph if reaches(name, name, {name})]
    assert not circles, circles


def test_nothing_but_conftest_edits_sys_path():
    edit = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\s*(\[.*\])?\s*\+?=")
    editors = [p for p in tracked(".py") if edit.search((ROOT / p).read_text())]
    assert editors == ["tests/conftest.py"]
