"""Package rules, read from the source: every module of the project's packages is parsed with `ast`,
none is imported, so a rule holds for code no test runs (lazy imports inside functions included).

The rules: the core packages (`scheduler`, `storage`, `engine`)
import neither Ray nor the layers above them; the planners (`scheduler`) import no model, storage or
actors and do no file I/O a caller could do; storage holds no native-kernel build helper; the Serve
entry points do not pull in the benchmarks; benchmarks do not monkeypatch the project; modules stay
under 650 lines and open with a docstring, which in `scheduler` and `engine` says early on what the
module deliberately knows nothing about.
"""

from __future__ import annotations

import ast
import pkgutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "scheduler", "storage", "engine", "deploy", "bench")
CORE = ("scheduler", "storage", "engine")
MAX_LINES = 650
SERVE_ENTRY_POINTS = ("deploy.serve_app", "deploy.server")


@dataclass(frozen=True, slots=True)
class Module:
    name: str  # dotted name, e.g. "scheduler.pipeline"; a package is its __init__.py
    path: Path
    tree: ast.Module
    n_lines: int

    @property
    def package(self) -> str:
        return self.name.split(".")[0]

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def empty(self) -> bool:
        """A package marker with no code at all."""
        return not self.tree.body


def _walk(name: str, directory: Path):
    """(dotted name, path) of the package `name` at `directory` and of everything under it."""
    yield name, directory / "__init__.py"
    for info in pkgutil.iter_modules([str(directory)]):
        sub = f"{name}.{info.name}"
        if info.ispkg:
            yield from _walk(sub, directory / info.name)
        elif (directory / f"{info.name}.py").is_file():
            yield sub, directory / f"{info.name}.py"


def _load() -> dict[str, Module]:
    out = {}
    for pkg in PACKAGES:
        for name, path in _walk(pkg, ROOT / pkg):
            text = path.read_text(encoding="utf-8")
            out[name] = Module(name, path, ast.parse(text, filename=str(path)), len(text.splitlines()))
    return out


MODULES = _load()


def _top(name: str) -> str:
    return name.split(".")[0]


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom reads from."""
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    base = base[: len(base) - node.level + (1 if mod.is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mod: Module) -> set[str]:
    """Every module `mod` imports, anywhere in the file: `import a.b` gives "a.b"; `from a import b` gives
    "a.b" when that is a project module, else "a"; `importlib.import_module("x")` and `__import__("x")`
    with a literal name give "x"."""
    out: set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            out.add(node.args[0].value)
    return out


def _in(*packages: str) -> list[Module]:
    return [m for m in MODULES.values() if m.package in packages]


def _report(offenders: list[str]) -> str:
    return "\n  " + "\n  ".join(offenders)


# -- imports ------------------------------------------------------------------------------------------


def test_every_package_is_found():
    assert {m.package for m in MODULES.values()} == set(PACKAGES)
    assert {"scheduler.pipeline", "engine.context", "deploy.serve_app", "deploy.server"} <= MODULES.keys()


def test_core_packages_import_neither_ray_nor_the_layers_above():
    bad = [f"{m.name} imports {i}" for m in _in(*CORE) for i in sorted(imports(m))
           if _top(i) in ("ray", "deploy", "bench", "actors")]
    assert not bad, _report(bad)


def test_scheduler_imports_no_model_storage_or_actors():
    bad = [f"{m.name} imports {i}" for m in _in("scheduler") for i in sorted(imports(m))
           if _top(i) in ("ray", "torch", "transformers", "engine", "storage", "actors", "deploy", "bench")]
    assert not bad, _report(bad)


def test_storage_holds_no_native_kernel_build_helper():
    """Building and loading C is the engine's business: no `storage/native.py`, and no storage module
    runs a compiler (`subprocess`)."""
    bad = [m.name for m in _in("storage") if m.name == "storage.native"]
    bad += [f"{m.name} imports subprocess" for m in _in("storage") if "subprocess" in imports(m)]
    assert not bad, _report(bad)


def _project_closure(start: str) -> dict[str, str]:
    """Project modules reachable by imports from `start`, each with the module that first imports it.
    Importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` too."""
    seen = {start: ""}
    todo = [start]
    while todo:
        name = todo.pop()
        for i in imports(MODULES[name]):
            parts = i.split(".")
            for k in range(1, len(parts) + 1):
                target = ".".join(parts[:k])
                if target in MODULES and target not in seen:
                    seen[target] = name
                    todo.append(target)
    return seen


def test_serve_entry_points_do_not_import_bench():
    bad = []
    for start in SERVE_ENTRY_POINTS:
        seen = _project_closure(start)
        for name in sorted(n for n in seen if _top(n) == "bench"):
            chain = [name]
            while seen[chain[-1]]:
                chain.append(seen[chain[-1]])
            bad.append(" <- ".join(chain))
    assert not bad, _report(bad)


# -- benchmarks do not monkeypatch ----------------------------------------------------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _scope_nodes(scope: ast.AST):
    """Nodes of `scope` itself, nested functions and classes yielded but not entered."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _root(node: ast.AST) -> str | None:
    """`a` for `a`, `a.b`, `a.b.c`; None for anything else (a call, a subscript...)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _project_names(nodes) -> set[str]:
    """Names bound by imports of project modules among `nodes`."""
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if _top(a.name) in PACKAGES)
        elif isinstance(node, ast.ImportFrom) and (node.level or _top(node.module or "") in PACKAGES):
            names.update(a.asname or a.name for a in node.names)
    return names


def _patches(scope: ast.AST, inherited: frozenset[str], where: str) -> list[str]:
    """Assignments to attributes of project modules or classes within `scope` and the scopes in it."""
    nodes = list(_scope_nodes(scope))
    imported = _project_names(nodes)
    rebound = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        rebound.update(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x)
    for node in nodes:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With, ast.NamedExpr)):
            for t in ast.walk(node):
                if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store):
                    rebound.add(t.id)
    tracked = set(inherited - rebound) | imported
    changed = True
    while changed:  # plain aliases: `G = mod.Class` makes `G` a project object too
        changed = False
        for node in nodes:
            if isinstance(node, ast.Assign) and _root(node.value) in tracked:
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id not in tracked:
                        tracked.add(t.id)
                        changed = True
    bad = []
    for node in nodes:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args and _root(node.args[0]) in tracked):
            bad.append(f"{where}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
        for t in targets:
            for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                if isinstance(e, ast.Attribute) and _root(e) in tracked:
                    bad.append(f"{where}:{node.lineno} {ast.unparse(e)} = ...")
    for node in nodes:
        if isinstance(node, _SCOPES):
            bad += _patches(node, frozenset(tracked), where)
    return bad


def test_benchmarks_do_not_monkeypatch_the_project():
    """A benchmark that needs another behaviour asks for it through a parameter or a registry; it does
    not assign to attributes of project modules or classes (`mod.Class.method = ...`)."""
    bad = [b for m in _in("bench") for b in _patches(m.tree, frozenset(), str(m.path.relative_to(ROOT)))]
    assert not bad, _report(bad)


# -- pure modules do no file I/O ------------------------------------------------------------------------

_FILE_MODULES = {"sqlite3", "shutil", "tempfile", "pathlib", "glob", "fcntl", "mmap", "io", "pickle", "dbm",
                 "shelve"}
_OS_FILE_FUNCS = {"open", "fdopen", "read", "write", "pread", "pwrite", "remove", "unlink", "rename", "replace",
                  "renames", "mkdir", "makedirs", "rmdir", "removedirs", "listdir", "scandir", "walk", "stat",
                  "lstat", "fstat", "fsync", "fdatasync", "truncate", "ftruncate", "link", "symlink", "readlink",
                  "chmod", "chown", "utime", "access", "mkfifo", "posix_fadvise", "sendfile", "getcwd", "chdir"}
_PATH_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "open", "mkdir", "unlink", "touch",
                 "iterdir", "glob", "rglob", "rmdir", "exists", "is_file", "is_dir", "tofile"}
_NUMPY_FILE_FUNCS = {"save", "savez", "savez_compressed", "savetxt", "load", "loadtxt", "genfromtxt", "fromfile",
                     "memmap"}


def _file_io(mod: Module) -> list[str]:
    bad = [f"{mod.name} imports {i}" for i in sorted(imports(mod)) if _top(i) in _FILE_MODULES]
    for node in ast.walk(mod.tree):
        if not isinstance(node, ast.Call):
            continue
        f, where = node.func, f"{mod.name}:{node.lineno} {ast.unparse(node.func)}("
        if isinstance(f, ast.Name) and f.id == "open":
            bad.append(where)
        elif isinstance(f, ast.Attribute):
            owner = ast.unparse(f.value)
            if owner == "os" and f.attr in _OS_FILE_FUNCS or owner == "os.path":
                bad.append(where)
            elif owner == "json" and f.attr in ("dump", "load"):
                bad.append(where)
            elif owner in ("np", "numpy") and f.attr in _NUMPY_FILE_FUNCS:
                bad.append(where)
            elif f.attr in _PATH_METHODS and owner not in ("np", "numpy"):
                bad.append(where)
    return bad


def test_scheduler_does_no_file_io():
    """Planners take numbers and return decisions; reading and writing files (profiles, logs, state) is
    the caller's, which passes the contents in (e.g. `CostProfile.from_json(text)`)."""
    bad = [b for m in _in("scheduler") for b in _file_io(m)]
    assert not bad, _report(bad)


# -- size and docstrings --------------------------------------------------------------------------------


def test_no_module_is_over_650_lines():
    bad = [f"{m.path.relative_to(ROOT)}: {m.n_lines} lines" for m in MODULES.values() if m.n_lines > MAX_LINES]
    assert not bad, _report(sorted(bad))


def test_every_module_has_a_docstring():
    bad = [str(m.path.relative_to(ROOT)) for m in MODULES.values()
           if not m.empty and not (ast.get_docstring(m.tree) or "").strip()]
    assert not bad, _report(sorted(bad))


def test_scheduler_and_engine_docstrings_say_what_they_do_not_know():
    """Within its first lines: what the module is, and what it deliberately knows nothing about."""
    bad = []
    for m in _in("scheduler", "engine"):
        if m.empty:
            continue
        head = " ".join((ast.get_docstring(m.tree) or "").splitlines()[:8])
        if "deliberately knows nothing" not in head:
            bad.append(str(m.path.relative_to(ROOT)))
    assert not bad, _report(sorted(bad))
