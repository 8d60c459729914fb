"""The code's layout: no import cycle between tg_jax's modules or between its packages, no module
over 600 lines, no function over 80.

Every `import` and `from ... import` of tg_jax counts, at module level, inside functions and
under `if TYPE_CHECKING:` alike (a lazy import that breaks a cycle at run time still ties the
two modules together). Packages are tg_jax's first-level packages and top-level modules
(tg_jax.train, tg_jax.main, ...).
"""

import ast
import collections
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(os.path.join(REPO, "tg_jax")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _targets(mods: dict[str, str], name: str, node: ast.AST) -> list[str]:
    """The tg_jax modules one import statement of module `name` imports."""
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = name.split(".")
            if not mods[name].endswith("__init__.py"):
                pkg = pkg[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        found = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for t in found:
        while t not in mods and "." in t:
            t = t.rsplit(".", 1)[0]
        # A package's __init__ imported by its own modules is not a dependency on them.
        if t in mods and t.startswith("tg_jax.") and t != name and not name.startswith(t + "."):
            out.append(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = collections.defaultdict(set)
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(_targets(mods, name, node))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert cycles(g) == [["a", "b", "c"]]


def test_the_graph_sees_lazy_and_type_checking_imports():
    graph = import_graph()
    # tg_jax.sampling.turn_cache imports the sampler at module level and for typing only.
    assert "tg_jax.sampling.sampler" in graph["tg_jax.sampling.turn_cache"]
    # tg_jax.envs.sandbox imports ns_sandbox; ns_sandbox imports the shared prelude.
    assert "tg_jax.envs.sandbox_prelude" in graph["tg_jax.envs.ns_sandbox"]


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_packages():
    def package(m):
        return ".".join(m.split(".")[:2])

    graph = collections.defaultdict(set)
    for a, bs in import_graph().items():
        for b in bs:
            if package(a) != package(b) and package(b) != "tg_jax":
                graph[package(a)].add(package(b))
    assert cycles(graph) == []


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80  # its signature, docstring and body


def test_no_module_over_600_lines():
    long = {n: c for n, p in _modules().items()
            if (c := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_MODULE_LINES}  # fmt: skip
    assert long == {}


def test_main_is_thin():
    """`python -m tg_jax.main` parses flags and calls the stage: the checks live with the
    config sections (tg_jax.config_lib), the error lines in one place (tg_jax.cli)."""
    with open(_modules()["tg_jax.main"], encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= 100
    assert "try:" not in text


def test_no_function_over_80_lines():
    long = {}
    for name, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name}:{node.lineno}"] = n
    assert long == {}


def test_readme_is_for_users():
    """The README stays a user's page: at most 250 lines, no commit hashes (the dated history
    lives in docs/results.md and docs/experiments.md)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not hashes, hashes


def test_the_files_conftest_orders_exist_and_test_fast_leaves_out_every_marker():
    """conftest's longest-first order and its multiprocess files name test files by string (a
    renamed file would go to the end of the run, or run beside the pods), and `launch/local.sh
    test-fast` must leave out every marker pytest.ini declares."""
    import configparser

    from tests import conftest

    here = os.path.dirname(os.path.abspath(__file__))
    files = set(conftest.LONGEST_FIRST)
    assert sorted(f for f in files if not os.path.isfile(os.path.join(here, f))) == []
    assert len(files) == len(conftest.LONGEST_FIRST)
    ini = configparser.ConfigParser()
    ini.read(os.path.join(here, "..", "pytest.ini"))
    markers = [line.split(":")[0] for line in ini["pytest"]["markers"].split("\n") if line]
    assert markers == ["slow", "e2e", "multiprocess"]
    with open(os.path.join(here, "..", "launch", "local.sh"), encoding="utf-8") as f:
        local = f.read()
    assert '-m "' + " and ".join(f"not {m}" for m in markers) + '"' in local
    # The one unit of work of the multiprocess files: every file with such a test, no other.
    marked = set()
    for name in sorted(os.listdir(here)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(here, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d) == "pytest.mark.multiprocess" for d in node.decorator_list
                ):
                    marked.add(name)
    assert marked == set(conftest.MULTIPROCESS_FILES)


# The methods of the loss sit over one core: rl/tg (TG) and rl/peers (the peers' methods) import
# from rl/ only what lies below them (`RL_CORE`; the peers also TG's teacher path, rl/tg), never
# the door (rl/loss.py), the batch builder (rl/batch.py) or the train step above them.
RL_CORE = ("tg_jax.rl.core", "tg_jax.rl.step_config", "tg_jax.rl.policy_loss")


def rl_back_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) pairs where rl/tg or rl/peers imports an rl/ module above it."""
    out = []
    for name, targets in graph.items():
        if name.startswith("tg_jax.rl.tg"):
            below = (*RL_CORE, "tg_jax.rl.tg")
        elif name.startswith("tg_jax.rl.peers"):
            below = (*RL_CORE, "tg_jax.rl.tg", "tg_jax.rl.peers")
        else:
            continue
        for t in sorted(targets):
            lower = any(t == b or t.startswith(b + ".") for b in below)
            if t.startswith("tg_jax.rl.") and not lower:
                out.append((name, t))
    return sorted(out)


def test_the_back_arrow_finder_finds_them():
    g = {
        "tg_jax.rl.tg.mask": {"tg_jax.rl.step_config", "tg_jax.sampling.trajectory"},
        "tg_jax.rl.tg.budget": {"tg_jax.rl.loss", "tg_jax.rl.tg.mask"},
        "tg_jax.rl.peers.sdar": {"tg_jax.rl.tg.divergence", "tg_jax.rl.core"},
        "tg_jax.rl.peers": {"tg_jax.rl.batch"},
        "tg_jax.rl.loss": {"tg_jax.rl.peers", "tg_jax.rl.tg.loss"},
    }
    assert rl_back_arrows(g) == [
        ("tg_jax.rl.peers", "tg_jax.rl.batch"),
        ("tg_jax.rl.tg.budget", "tg_jax.rl.loss"),
    ]


def test_no_back_arrow_in_rl():
    assert rl_back_arrows(import_graph()) == []
