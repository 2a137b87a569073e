"""The library's import graph: arrows run one way, and never up to the app.

`gemjax`, `sharding` and `pallas_kernels` are the library; `configs`,
`benchmarks`, `notebooks` and `tests` are the app that uses it. The library
never imports the app (named configs are loaded by path), no two library
modules import each other through any chain (a cycle makes import order
matter and hides which module owns what), and the model, serving and
sharding reach the kernels only through `pallas_kernels`' public ops (never
a family's kernel or reference module). Imports inside functions count:
they are arrows too, only later.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[1]
LIBRARY = ("gemjax", "sharding", "pallas_kernels")
APP = ("configs", "benchmarks", "notebooks", "tests")


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {
    _module_name(p): p for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py")
  }


def _imports(name: str, path: pathlib.Path) -> set[str]:
  """Every module `name` imports, anywhere in its body, as absolute names
  (`from a import b` yields `a.b` as well as `a`: `b` may be a module)."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      out.add(base)
      out.update(f"{base}.{a.name}" for a in node.names)
  return out


def _graph() -> dict[str, set[str]]:
  """Edges between library modules. An import of `a.b.c` also runs the
  `__init__` of `a` and `a.b`, but those package edges are left out: a
  package's `__init__` re-exporting its submodules is not a cycle."""
  mods = _modules()
  graph = {}
  for name, path in mods.items():
    graph[name] = {
      m for m in _imports(name, path) if m in mods and m != name
    } - {p for p in _parents(name)}
  return graph


def _parents(name: str) -> list[str]:
  parts = name.split(".")
  return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_the_library_never_imports_the_app():
  bad = sorted(
    f"{name} imports {m}"
    for name, path in _modules().items()
    for m in _imports(name, path)
    if m.split(".")[0] in APP
  )
  assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles_among_library_modules():
  assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(graph) == [["a", "b", "c"]]


def test_the_library_calls_kernels_through_public_ops():
  """A kernel family's files, its reference included, are its own business:
  the model, serving and sharding name only what `pallas_kernels/__init__.py`
  exports."""
  mods = _modules()
  bad = sorted(
    f"{name} imports {m}"
    for name, path in mods.items()
    if name.split(".")[0] != "pallas_kernels"
    for m in _imports(name, path)
    if m.startswith("pallas_kernels.") and m in mods
  )
  assert not bad, "\n".join(bad)
