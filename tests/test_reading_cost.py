"""What a person copying a template reads stays within its budget (docs/testing.md#reading-cost): the
first rung, toy_mlp.py, with every shared/ module it imports (followed transitively) at most 350 lines,
and no shared/ module over 300 lines."""

import ast

from conftest import REPO, SCRIPTS

SHARED = REPO / "shared"


def shared_modules_read(path):
    """The shared/ modules that the file at `path` imports, and those they import, by file."""
    found, todo = set(), [path]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module == "shared":  # from shared import a, b
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shared."):
                names = [node.module.split(".")[1]]
            elif isinstance(node, ast.Import):
                names = [alias.name.split(".")[1] for alias in node.names if alias.name.startswith("shared.")]
            for module in {SHARED / f"{name}.py" for name in names} - found:
                found.add(module)
                todo.append(module)
    return found | ({SHARED / "__init__.py"} if found else set())


def lines(path):
    return len(path.read_text().splitlines())


def test_the_first_rung_reads_in_at_most_350_lines():
    toy = SCRIPTS / "toy_mlp.py"
    read = [toy, *sorted(shared_modules_read(toy))]
    assert sum(map(lines, read)) <= 350, {path.name: lines(path) for path in read}


def test_no_shared_module_is_over_300_lines():
    assert {path.name: lines(path) for path in SHARED.glob("*.py") if lines(path) > 300} == {}


def test_the_count_follows_imports_to_the_end():
    assert {path.name for path in shared_modules_read(SCRIPTS / "toy_mlp.py")} == {"errors.py", "__init__.py"}
    tool = REPO / "tools" / "synthetic_digits.py"  # imports shared.flags, which imports shared.errors
    assert {path.name for path in shared_modules_read(tool)} == {"flags.py", "errors.py", "__init__.py"}
