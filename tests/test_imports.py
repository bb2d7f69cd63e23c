"""No module of glmjax/ or pallas_kernels/ is part of an import cycle. Static, from the source: every `import` /
`from ... import` of a glmjax.* / pallas_kernels.* module counts, at the top of a file or inside a function (a
lazy import hides a cycle without removing it), and so does importlib.import_module("a.literal.name"). A package is
its __init__.py, which an import of one of its modules from outside the package runs first."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("glmjax", "pallas_kernels")


def module_files(root: str = ROOT) -> dict[str, str]:
    """{module name: path} of every .py under the packages; a package is its __init__.py ("glmjax.model")."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for f in files:
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, f)
    return out


def imported_modules(module: str, path: str, known) -> list[tuple[str, int]]:
    """(imported module, line) for every import in `path` of a known module. `from a.b import c` imports the
    module a.b.c if there is one, else (a name defined in it) a.b; `import a.b.c` imports a.b.c; both also import
    the packages a and a.b (their __init__ runs first) unless `module` is inside them."""
    def resolve(name: str) -> str | None:  # the longest known module prefix of a dotted name
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from its own package upwards
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        for target in filter(None, map(resolve, names)):
            # importing a.b.c also runs the __init__ of a and a.b (for a module outside them)
            parts = target.split(".")
            for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                if m in known and m != module and not module.startswith(m + "."):
                    out.append((m, node.lineno))
    return out


def import_graph(root: str = ROOT) -> dict[str, dict[str, int]]:
    """{module: {imported module: line of the first such import}}."""
    files = module_files(root)
    graph = {m: {} for m in files}
    for m, path in files.items():
        for dep, line in imported_modules(m, path, files):
            graph[m].setdefault(dep, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted, sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(component: list[str], graph, files) -> str:
    edges = [f"    {m} -> {d}  ({os.path.relpath(files[m], ROOT)}:{line})"
             for m in component for d, line in sorted(graph[m].items()) if d in component]
    return f"  cycle of {len(component)} modules: {', '.join(component)}\n" + "\n".join(edges)


def test_cycles_are_found_with_lazy_and_package_imports(tmp_path):
    """The checker itself, on a made-up tree: a lazy import inside a function closes a cycle through a package's
    __init__ re-export; the acyclic chain b -> c -> d (a relative import) is not reported."""
    def write(rel, text):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    write("glmjax/__init__.py", "")
    write("glmjax/a/__init__.py", "from glmjax.a.core import f\n")
    write("glmjax/a/core.py", "def f():\n    from glmjax.b import g\n    return g\n")
    write("glmjax/b.py", "from glmjax import a\nimport glmjax.c\n")
    write("glmjax/c.py", "from .d import x\n")
    write("glmjax/d.py", "x = 1\n")
    write("pallas_kernels/__init__.py", "import jax\n")
    graph = import_graph(str(tmp_path))
    assert graph["glmjax.c"] == {"glmjax.d": 1} and graph["glmjax.b"] == {"glmjax.a": 1, "glmjax.c": 2}
    assert cycles(graph) == [["glmjax.a", "glmjax.a.core", "glmjax.b"]]


def test_no_import_cycles():
    files, graph = module_files(), import_graph()
    found = cycles(graph)
    assert not found, "import cycles (every import counts, lazy ones too):\n" + "\n".join(
        describe(c, graph, files) for c in found)
