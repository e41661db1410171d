"""The import rules of DESIGN.md and the project's architecture drawing, held against the code: what each part may never
import, and that the pure logic of the cache and the predictors touches no file and starts no thread."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "moetier"

NEVER = [  # (modules under, may never import, why)
    ("model", "moetier.engine", "the model computes; it does not drive"),
    ("model", "moetier.cache", "the model computes; residency is the engine's business"),
    ("cache", "moetier.sim", "the cache is driven by both executors; it never reaches up"),
    ("cache", "moetier.trace", "offline fitting lives above the cache"),
    ("cache", "moetier.engine", "policies are pure: the same object runs in engine and sim"),
    ("cache", "moetier.store", "policies never touch I/O"),
    ("plan", "moetier.engine", "planner stages decide, executors do"),
    ("plan", "moetier.store", "planner stages never touch I/O"),
    ("plan", "moetier.sim", "the layer step is shared; it knows no executor"),
    ("sim", "moetier.engine", "the simulator must not run the real executor"),
    ("sim", "moetier.store", "the simulator reads no expert bytes"),
    ("engine", "moetier.sim", "the engine does not depend on the simulator"),
    ("store", "moetier.engine", "the store is a mechanism below the engine"),
    ("engine", "moetier.cli", "nothing below the faces imports them"),
    ("sim", "moetier.cli", "nothing below the faces imports them"),
    ("predict", "moetier.sim", "predictors are driven by both executors; they never reach up"),
    ("predict", "moetier.trace", "what a predictor learned offline is handed to it"),
    ("predict", "moetier.engine", "the same predictor runs in engine and sim"),
    ("predict", "moetier.store", "predictors never touch I/O"),
    ("merge", "moetier.engine", "merging is offline over stores: the faces record its calibration trace"),
    ("merge", "moetier.cli", "nothing below the faces imports them"),
    ("adapt", "moetier.engine", "resource decisions are pure: the engine feeds them and carries them out"),
    ("adapt", "moetier.store", "resource decisions touch no I/O"),
    ("adapt", "moetier.sim", "resource decisions know nothing of who drives them"),
]
FILE_CALLS = {"open", "read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "unlink", "rename",
              "replace", "rmtree", "load", "dump", "save", "glob", "iterdir", "exists"}
FILE_MODULES = {"os", "io", "pathlib", "shutil", "tempfile", "mmap", "moetier.atomic", "moetier.policy_files"}
THREADS = {"threading", "concurrent.futures", "multiprocessing"}


def modules(part: str):
    for path in sorted((PACKAGE / part).rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("part,forbidden,why", NEVER, ids=[f"{p} -x-> {f}" for p, f, _ in NEVER])
def test_never_imports(part, forbidden, why):
    broken = [f"{path.relative_to(PACKAGE)} imports {name}" for path, tree in modules(part)
              for name in imports(tree) if name == forbidden or name.startswith(forbidden + ".")]
    assert not broken, f"{why}: {broken}"


@pytest.mark.parametrize("part", ["cache", "predict", "adapt"])
def test_pure_logic_performs_no_file_io_and_starts_no_thread(part):
    found = []
    for path, tree in modules(part):
        found += [f"{path.relative_to(PACKAGE)} imports {name}" for name in imports(tree) & (FILE_MODULES | THREADS)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in FILE_CALLS:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} calls {name}()")
    assert not found, found


def test_the_rules_can_fail(tmp_path):
    """The checks above see an offending import and a file call (so a pass means something)."""
    tree = ast.parse("from moetier.sim.replay import steps\nimport json\nx = open('f').read()\n")
    assert "moetier.sim.replay" in imports(tree)
    assert any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "open" for n in ast.walk(tree))
