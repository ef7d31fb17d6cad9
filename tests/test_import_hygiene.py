"""aiopipe imports only the standard library, torch, nvtx and uvloop; the adapter
(hstu_tasks) uses aiopipe's public surface and torchrec's private helpers in one module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("torchrec", "megatron", "fbgemm_gpu", "hstu_tasks")
ALLOWED_THIRD_PARTY = {"torch", "nvtx", "uvloop", "exceptiongroup"}  # the last: 3.10 backport
PACKAGE = Path(__file__).resolve().parents[1] / "aiopipe"


def test_importing_aiopipe_loads_no_framework() -> None:
    code = (
        "import sys, aiopipe, aiopipe.executors; "
        f"print([m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_aiopipe_sources_import_only_allowed_packages() -> None:
    stdlib = set(sys.stdlib_module_names)
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                if root not in stdlib and root not in ALLOWED_THIRD_PARTY and root != "aiopipe":
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}: {root}")
    assert not offenders, offenders


# -- the package's own layering ------------------------------------------------------


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, top_level_only: bool) -> list[tuple[str, tuple[str, ...]]]:
    """``(absolute module, names)`` for each ``from ... import`` / ``import`` in
    ``path``; with ``top_level_only``, those a module runs as it is imported (not in a
    function, not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[str, tuple[str, ...]]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if top_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                base = package[: len(package) - child.level + 1] if child.level else []
                module = ".".join(base + ([child.module] if child.module else []))
                found.append((module, tuple(alias.name for alias in child.names)))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, ()) for alias in child.names)
            visit(child)

    visit(tree)
    return found


def _aiopipe_modules() -> dict[str, Path]:
    return {_module_of(path): path for path in PACKAGE.rglob("*.py")}


def test_the_private_core_imports_only_the_standard_library_and_errors() -> None:
    stdlib = set(sys.stdlib_module_names)
    offenders = []
    for path in (PACKAGE / "_core").glob("*.py"):
        for module, _ in _imports(path, top_level_only=False):
            root = module.split(".")[0]
            inside = module in ("aiopipe.errors", "aiopipe._core") or module.startswith("aiopipe._core.")
            # nvtx and uvloop are imported inside the functions that use them
            if not (root in stdlib or inside or root in ("nvtx", "uvloop")):
                offenders.append(f"{path.name}: {module}")
    assert not offenders, offenders


def test_no_module_imports_a_private_name_of_another() -> None:
    modules = _aiopipe_modules()
    offenders = []
    for name, path in modules.items():
        for module, names in _imports(path, top_level_only=False):
            if not module.startswith("aiopipe") or module == name:
                continue
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            # a module of a private package (aiopipe._core.lanes) is fine; `from aiopipe
            # import _core` is the package itself
            private = [n for n in private if f"{module}.{n}" not in modules]
            if private:
                offenders.append(f"{name} imports {private} from {module}")
    assert not offenders, offenders


def test_the_package_has_no_import_cycle() -> None:
    """Only type-only imports may point back up (cycles through ``TYPE_CHECKING``)."""
    modules = _aiopipe_modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for module, names in _imports(path, top_level_only=False):
            if not module.startswith("aiopipe"):
                continue
            if _is_type_only(path, module):
                continue
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]
            edges[name].update(t for t in targets if t in modules and t != name)
    # a package's __init__ re-exports its children: importing a child imports the parent
    # first, so child -> parent edges are implied and not counted as cycles
    cycles = []
    for start in edges:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, trail = stack.pop()
            for nxt in edges[node]:
                if nxt == start and not _is_parent_chain(trail):
                    cycles.append(" -> ".join((*trail, nxt)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*trail, nxt)))
    assert not cycles, sorted(set(cycles))[:10]


def _is_parent_chain(trail: tuple[str, ...]) -> bool:
    return any(b == a.rsplit(".", 1)[0] or a.startswith(b + ".") for a, b in zip(trail, trail[1:]))


def _is_type_only(path: Path, module: str) -> bool:
    all_imports = [m for m, _ in _imports(path, top_level_only=False)]
    runtime = [m for m, _ in _imports(path, top_level_only=True)]
    function_level = _function_level_imports(path)
    return module in all_imports and module not in runtime and module not in function_level


def _function_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom):
                    base = package[: len(package) - node.level + 1] if node.level else []
                    found.add(".".join(base + ([node.module] if node.module else [])))
    return found


# -- the adapter: aiopipe's public surface, torchrec's private helpers in one module ----

ROOT = PACKAGE.parent
ADAPTER = ROOT / "hstu_tasks"
#: The one module that may import torchrec's private helpers (re-exported publicly).
TORCHREC_PRIVATE = ADAPTER / "sparse" / "_torchrec.py"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(tree: ast.AST, package: str) -> list[str]:
    """Private names of ``package`` that ``tree`` imports (a module path component or
    an imported name starting with ``_``) or reaches through an imported name
    (``aiopipe._core``, ``lanes._on_compute_lane``)."""
    found, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package:
                    if any(_is_private(part) for part in alias.name.split(".")):
                        found.append(f"import {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != package:
                continue
            names = [alias.name for alias in node.names]
            if any(_is_private(part) for part in node.module.split(".")) or any(
                _is_private(name) for name in names
            ):
                found.append(f"from {node.module} import {', '.join(names)}")
            bound.update(alias.asname or alias.name for alias in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(ast.unparse(node))
    return found


def _offenders(paths: list[Path], package: str) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}: {use}"
        for path in sorted(paths)
        for use in _private_uses(ast.parse(path.read_text()), package)
    ]


def test_the_private_use_check_sees_each_form() -> None:
    private = (
        "from aiopipe._core.lanes import Lane", "from aiopipe import _core",
        "from aiopipe.lanes import _on_compute_lane", "import aiopipe._core",
        "import aiopipe\naiopipe._core.loops", "from aiopipe import lanes\nlanes._x",
    )  # fmt: skip
    for source in private:
        assert _private_uses(ast.parse(source), "aiopipe"), source
    public = ("from aiopipe import __version__, lanes", "import aiopipe\naiopipe.run",
              "from torchrec import _x", "engine._executor")  # fmt: skip
    for source in public:
        assert not _private_uses(ast.parse(source), "aiopipe"), source


def test_the_adapter_uses_only_aiopipes_public_surface() -> None:
    offenders = _offenders(list(ADAPTER.rglob("*.py")), "aiopipe")
    assert not offenders, offenders


def test_torchrecs_private_helpers_are_imported_in_one_module() -> None:
    assert _private_uses(ast.parse(TORCHREC_PRIVATE.read_text()), "torchrec")  # it is that one
    paths = [
        path
        for folder in ("hstu_tasks", "examples", "benchmarks", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if path != TORCHREC_PRIVATE
    ]
    offenders = _offenders(paths, "torchrec")
    assert not offenders, f"import them through {TORCHREC_PRIVATE.name}: {offenders}"
