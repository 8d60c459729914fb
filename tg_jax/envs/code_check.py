"""Whether model-written code is a valid action of the coding environment, read without
running it (`CodingEnv.valid_action`).

Valid code parses, binds the function the task names (`f`) at module level (a `def`, a
lambda, an import, or an alias of another name: `f = abs`), and reads no name that neither it
nor Python's builtins bind (a NameError waiting to happen, at load time or when f is called).
Junk such as `a`, `x = `, `pass`, `def g(x): ...`, `f = 0` or `def f(x): return y` is not
valid; a wrong but honest attempt (`def f(x): return 0`) is. The check is static, so it does
not depend on the executor (sandbox or trusted) and cannot time out.
"""

from __future__ import annotations

import ast
import builtins
import symtable
import threading

# CPython 3.11 keeps the AST constructor's recursion depth in per-interpreter state, so two
# threads building ASTs at once (the rollout's environment steps run in a thread pool, beside
# the sampling loop's thread) can fail with "SystemError: AST constructor recursion depth
# mismatch". Every AST the coding environment builds goes through this lock.
AST_LOCK = threading.Lock()
FUNCTION = "f"  # the name every coding task asks for (tg_jax.envs.tasks)
_BUILTINS = frozenset(dir(builtins))
_BLOCKS = (ast.If, ast.Try, ast.With, ast.For, ast.While)  # module-level compound statements


def problem(code: str, name: str = FUNCTION) -> str | None:
    """Why `code` is not a valid action, or None when it is (see the module docstring).

    Args:
      code: the Python source a turn runs.
      name: the function the task names.

    Returns:
      None, or a short reason: "no code", "does not parse", "does not define f",
      "undefined name 'y'".
    """
    if not code.strip():
        return "no code"
    try:
        with AST_LOCK:
            tree = ast.parse(code)
            table = symtable.symtable(code, "solution.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return "does not parse"
    if not any(_binds(stmt, name) for stmt in _module_statements(tree.body)):
        return f"does not define {name}"
    if any(a.name == "*" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names):
        return None  # a star import may bind anything
    missing = _undefined(table)
    return f"undefined name {min(missing)!r}" if missing else None


def _module_statements(body: list[ast.stmt]):
    """The module's statements, inside if/try/with/for/while blocks too (not defs or classes)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, _BLOCKS):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_statements(getattr(stmt, field, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _module_statements(handler.body)


def _binds(stmt: ast.stmt, name: str) -> bool:
    """Whether `stmt` binds `name` to something callable: a def, an import, a lambda or another
    name (`f = abs`); `f = 0` does not."""
    if isinstance(stmt, ast.FunctionDef):
        return stmt.name == name
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
    targets = (
        stmt.targets
        if isinstance(stmt, ast.Assign)
        else [stmt.target]
        if isinstance(stmt, ast.AnnAssign) and stmt.value is not None
        else []
    )
    callable_value = isinstance(getattr(stmt, "value", None), ast.Lambda | ast.Name | ast.Attribute)
    return callable_value and any(isinstance(t, ast.Name) and t.id == name for t in targets)


def _undefined(top: symtable.SymbolTable) -> set[str]:
    """Names read as globals (in any scope) that the module never binds and are not builtins."""
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    read: set[str] = set()
    stack = [top]
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        for s in table.get_symbols():
            if s.is_declared_global() and s.is_assigned():  # `global g; g = 1` in a function
                bound.add(s.get_name())
            elif s.is_global() and s.is_referenced():
                read.add(s.get_name())
    return read - bound - _BUILTINS
