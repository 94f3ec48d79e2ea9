"""The package layout: one room per concern, and every import points to an earlier room (DESIGN-NOTES.md,
"Layout (the map)").

Every module of fspec/ and kernels/ (installed as fspec.kernels) is parsed with `ast`, imports inside
functions included, and each imported fspec module is mapped to its room. The import order is

    kernels -> core -> ops -> models -> draft -> compile -> serve -> train -> api -> cli

where `api` is fspec/__init__.py (it re-exports from every room but cli; cli uses the public API). A module
imports only its own room and earlier ones, kernels imports nothing of fspec but fspec.kernels, and the module
import graph has no cycle, within a room either. (Importing `a.b.c` also runs `a.b`'s __init__: such implicit
parent imports are not edges here, or every package that imports its own submodules would be a cycle.)
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("kernels", "core", "ops", "models", "draft", "compile", "serve", "train", "api", "cli")
SUBPACKAGES = ("core", "ops", "models", "compile", "serve", "train")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported fspec module
    where: str  # "path:line: statement"


def module_files() -> dict[str, Path]:
    """Module name -> file, for fspec/ (not its kernels link, which a checkout may have) and kernels/."""
    found: dict[str, Path] = {}
    for top, package in ((ROOT / "fspec", "fspec"), (ROOT / "kernels", "fspec.kernels")):
        for dirpath, dirnames, filenames in os.walk(top):
            here = Path(dirpath)
            dirnames[:] = sorted(
                d for d in dirnames if d != "__pycache__" and not (here == ROOT / "fspec" and d == "kernels")
            )
            parts = here.relative_to(top).parts
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                stem = name[: -len(".py")]
                dotted = ".".join((package, *parts) if stem == "__init__" else (package, *parts, stem))
                found[dotted] = here / name
    return found


def room(module: str) -> str:
    """The room of an fspec module (ValueError for a module outside the map)."""
    parts = module.split(".")
    if parts[0] != "fspec":
        raise ValueError(f"{module}: not an fspec module")
    if len(parts) == 1:
        return "api"
    if parts[1] in ("kernels", *SUBPACKAGES) or (len(parts) == 2 and parts[1] in ("draft", "cli")):
        return parts[1]
    raise ValueError(f"{module}: in no room of the layout {ORDER}")


def imports_of(module: str, source: str, path: str, modules: set[str]) -> list[Import]:
    """The fspec modules `source` (the text of `module`, at `path`) imports, at any depth of its code."""
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from a import b` imports module a.b when there is one, else the name b of module a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        where = f"{path}:{node.lineno}: {ast.unparse(node)}"
        out += [Import(module, t, where) for t in dict.fromkeys(targets) if t.split(".")[0] == "fspec"]
    return out


def all_imports() -> tuple[dict[str, Path], list[Import]]:
    files = module_files()
    found = []
    for module, path in files.items():
        rel = path.relative_to(ROOT).as_posix()
        found += imports_of(module, path.read_text(), rel, set(files))
    return files, found


def order_violations(imports: list[Import]) -> list[str]:
    """Each import of a room later than the importer's own (and each of fspec outside kernels by kernels)."""
    bad = []
    for imp in imports:
        own, theirs = room(imp.source), room(imp.target)
        if own == "kernels" and theirs != "kernels":
            bad.append(f"{imp.where}: kernels imports {imp.target} (kernels imports nothing of fspec)")
        elif ORDER.index(theirs) > ORDER.index(own):
            bad.append(f"{imp.where}: room {own} imports {imp.target} of the later room {theirs}")
    return bad


def cycles(imports: list[Import]) -> list[str]:
    """One description per cycle found in the module import graph (depth-first search)."""
    edges: dict[str, list[Import]] = {}
    for imp in imports:
        if imp.target != imp.source:
            edges.setdefault(imp.source, []).append(imp)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []  # the modules on the current path
    path: list[Import] = []  # the imports between them
    found = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for imp in edges.get(module, []):
            if state.get(imp.target) == 1:
                loop = [*path[stack.index(imp.target) :], imp]
                chain = " -> ".join([loop[0].source, *(p.target for p in loop)])
                found.append(chain + "".join(f"\n    {p.where}" for p in loop))
            elif imp.target not in state:
                path.append(imp)
                visit(imp.target)
                path.pop()
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return found


def test_every_module_lies_in_a_room_and_fspec_itself_is_small():
    files = module_files()
    assert "fspec.kernels.ops" in files and "fspec.serve.engine" in files and "fspec.core.state" in files
    unplaced = []
    for module, path in files.items():
        try:
            room(module)
        except ValueError as e:
            unplaced.append(f"{path.relative_to(ROOT)}: {e}")
    assert unplaced == []
    top = sorted(p.name for p in (ROOT / "fspec").glob("*.py"))
    assert len(top) <= 6, f"fspec/ holds {top}: new modules belong in a room (fspec/core/, fspec/ops/, ...)"


def test_kernels_import_nothing_of_fspec_but_themselves():
    _, imports = all_imports()
    bad = [
        f"{imp.where}: kernels imports {imp.target}"
        for imp in imports
        if room(imp.source) == "kernels" and room(imp.target) != "kernels"
    ]
    assert bad == [], "\n".join(bad)


def test_no_module_imports_a_later_room():
    _, imports = all_imports()
    assert any(imp.source == "fspec.serve.rounds" and room(imp.target) == "compile" for imp in imports)
    bad = order_violations(imports)
    assert bad == [], "imports against the order " + " -> ".join(ORDER) + ":\n" + "\n".join(bad)


def test_the_module_import_graph_has_no_cycle():
    _, imports = all_imports()
    found = cycles(imports)
    assert found == [], "import cycles:\n" + "\n".join(found)


def test_the_checks_name_the_file_and_the_import_they_refuse():
    """The checks themselves, on made-up modules: a late import inside a function, a relative import out of
    kernels, and a two-module cycle are each reported with the file, line and statement."""
    modules = {"fspec.core.state", "fspec.core.metadata", "fspec.serve.engine", "fspec.kernels.ops", "fspec"}
    late_import = "def f():\n    from fspec.serve.engine import generate\n"
    late = imports_of("fspec.core.state", late_import, "fspec/core/state.py", modules)
    assert order_violations(late) == [
        "fspec/core/state.py:2: from fspec.serve.engine import generate: "
        "room core imports fspec.serve.engine of the later room serve"
    ]
    out_of_kernels = imports_of("fspec.kernels.ops", "from .. import core\n", "kernels/ops.py", modules)
    assert [i.target for i in out_of_kernels] == ["fspec"]
    assert "kernels imports fspec" in order_violations(out_of_kernels)[0]
    loop = imports_of("fspec.core.state", "import fspec.core.metadata\n", "fspec/core/state.py", modules)
    loop += imports_of(
        "fspec.core.metadata", "from fspec.core import state\n", "fspec/core/metadata.py", modules
    )
    assert order_violations(loop) == []
    (cycle,) = cycles(loop)
    assert cycle.startswith("fspec.core.metadata -> fspec.core.state -> fspec.core.metadata")
    assert "fspec/core/state.py:1: import fspec.core.metadata" in cycle
    assert "fspec/core/metadata.py:1: from fspec.core import state" in cycle
