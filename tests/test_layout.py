"""The package's tree reads as the architecture: folders in one order, imports only downwards.

Every import counts, also those inside functions (they are how a circle hides). The order is
the one ``megatron_streaming/__init__.py`` states and docs/DESIGN.md draws; an entry point
(a ``__main__`` module, or a top-level module kept so that an old ``python -m`` still runs) may
import from anywhere.
"""

import ast

from harness import REPO

PACKAGE = "megatron_streaming"
ORDER = ["errors", "config", "parallel", "comm", "worker", "data", "streaming", "checkpoint",
         "job", "cli", "run", "plan"]
# Kept at the top for ``python -m megatron_streaming.<tool>`` of existing scripts.
FORWARDING = {"plot": "cli.plot", "simulate": "plan.simulate", "rendezvous": "job.rendezvous"}


def _modules():
    out = {}
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name, is_package, source, modules):
    """The package's modules (keys of ``modules``) that ``source``, module ``name`` (a
    package's ``__init__`` when ``is_package``), imports anywhere in its body: at the top and
    inside functions alike."""
    def owner(imported):
        while imported and imported not in modules:
            imported = imported.rpartition(".")[0]
        return imported

    here = name.split(".") if is_package else name.split(".")[:-1]
    deps = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            deps.update(owner(a.name) for a in node.names if a.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]) \
                if node.level else node.module or ""
            base = base.rstrip(".")
            if base.startswith(PACKAGE):
                deps.update(owner(f"{base}.{a.name}") for a in node.names)
    deps.discard(name)
    deps.discard("")
    return deps


def import_graph():
    """Module -> the package's modules it imports (anywhere in its body)."""
    modules = _modules()
    return {name: _imports(name, path.name == "__init__.py", path.read_text(), modules)
            for name, path in modules.items()}


def _folder(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_entry_point(module):
    return module.endswith(".__main__") or module.split(".", 1)[-1] in FORWARDING


def test_every_module_lives_in_a_folder_of_the_order():
    loose = [m for m in import_graph() if m != PACKAGE and not _is_entry_point(m)
             and _folder(m) not in ORDER]
    assert loose == []
    tops = sorted(m.split(".", 1)[1] for m in import_graph() if m.count(".") == 1
                  and (REPO / PACKAGE / f"{m.split('.', 1)[1]}.py").is_file())
    assert tops == sorted(["errors", *FORWARDING])
    for package in ORDER[1:]:  # each folder says in its first line what it holds
        assert ast.get_docstring(ast.parse((REPO / PACKAGE / package / "__init__.py")
                                           .read_text())), package


def _upward(graph):
    """(module, what it imports) for every import of ``graph`` that runs up the order."""
    return [(m, d) for m, deps in sorted(graph.items()) if not _is_entry_point(m)
            for d in sorted(deps) if _folder(d) in ORDER and _folder(m) in ORDER
            and ORDER.index(_folder(d)) > ORDER.index(_folder(m))]


def test_imports_run_down_the_order_and_close_no_circle():
    graph = import_graph()
    assert _upward(graph) == []

    # No circle among modules either (within a folder): depth-first search for a back edge.
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                circles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert circles == []


def test_an_import_inside_a_function_counts_as_one_at_the_top():
    """The way an upward import hides: inside a function. ``cli`` importing ``run`` there is
    caught; ``cli`` importing ``checkpoint`` there (``megatron_flags``' Megatron-LM check of a
    --load) runs down the order, as any later folder's import of an earlier one does."""
    modules = _modules()
    module = f"{PACKAGE}.cli.example"
    up = "def act():\n    from ..run.train import pretrain\n"
    down = "def act(cfg):\n    from ..checkpoint.megatron_lm import is_megatron_lm\n"
    assert _imports(module, False, up, modules) == {f"{PACKAGE}.run.train"}
    assert _upward({module: _imports(module, False, up, modules)}) == [
        (module, f"{PACKAGE}.run.train")]
    assert _imports(module, False, down, modules) == {f"{PACKAGE}.checkpoint.megatron_lm"}
    assert _upward({module: _imports(module, False, down, modules)}) == []


def test_the_order_is_the_one_the_package_and_design_state():
    stated = " -> ".join(f"``{f}``" for f in ORDER)
    assert stated in " ".join((REPO / PACKAGE / "__init__.py").read_text().split())
    design = (REPO / "docs" / "DESIGN.md").read_text()
    assert " -> ".join(ORDER) in " ".join(design.split())


def test_the_quick_tier_touches_every_folder():
    """``-m quick`` imports from every folder of the package, so a broken folder shows in
    the inner loop's tier too."""
    from conftest import QUICK_FILES

    reached = set()
    for name in QUICK_FILES:
        for node in ast.walk(ast.parse((REPO / "tests" / name).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                module = node.module
                reached.add(_folder(module) if module != PACKAGE else "")
                if module == PACKAGE:
                    reached.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                reached.update(_folder(a.name) for a in node.names
                               if a.name.startswith(PACKAGE + "."))
    assert set(ORDER) - reached == set()
