"""docs/troubleshooting.md keeps up with the package: every warning the package emits has an entry, and
every entry quotes a phrase the package's messages still contain.

An entry is a table row whose first cell quotes a phrase of the message in backticks, ``…`` standing for the
parts that change. The phrase is looked up in the string literals of ``lightning_gpuopt/`` (docstrings left
out), a piece between two ``…`` never spanning an f-string's ``{...}``. An argument check's message is
composed as the check composes it, from literals or from a local name bound to one earlier in the function
(``must = "..."; check_arg(ok, "x", x, must)``), as the package's checks are often written.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_gpuopt"
PAGE = ROOT / "docs" / "troubleshooting.md"
#: the calls that emit a warning, by the name they are called under
WARNING_CALLS = {"warn_once", "warn_at_user", "rank_zero_warn", "warn"}
HOLE = "\x00"  # where an f-string or a concatenation puts a value


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _flat(node: ast.AST) -> str | None:
    """The message an expression builds, ``HOLE`` for each value put into it; ``None``: not a string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _norm(node.value)
    if isinstance(node, ast.JoinedStr):
        return _norm("".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _flat(node.left), _flat(node.right)
        if left is None and right is None:
            return None
        return (left or HOLE) + (right or HOLE)
    return None


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _trees() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(ROOT)): ast.parse(p.read_text(encoding="utf-8"))
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _bound(function: ast.AST | None, name: str, line: int) -> str | None:
    """The string ``name`` holds at ``line`` of ``function``: its last ``name = ...`` before the line, with
    the ``name += ...`` that follow it; ``None`` where it is not bound to a string there."""
    if function is None:
        return None
    steps = sorted(
        (
            n
            for n in ast.walk(function)
            if getattr(n, "lineno", line) < line
            and (
                (isinstance(n, ast.Assign) and _assigned(n, name) is not None)
                or (
                    isinstance(n, ast.AugAssign)
                    and isinstance(n.op, ast.Add)
                    and ast.unparse(n.target) == name
                )
            )
        ),
        key=lambda n: n.lineno,
    )
    text = None
    for node in steps:
        if isinstance(node, ast.Assign):
            text = _flat(_assigned(node, name))
        else:
            text = (text or HOLE) + (_flat(node.value) or HOLE)
    return text


def _assigned(node: ast.Assign, name: str) -> ast.expr | None:
    """What ``node`` binds ``name`` to: ``name = value`` or ``a, name = x, value``; None: not ``name``."""
    target = node.targets[0] if len(node.targets) == 1 else None
    if isinstance(target, ast.Name) and target.id == name:
        return node.value
    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
        names = [t.id if isinstance(t, ast.Name) else None for t in target.elts]
        if name in names and len(names) == len(node.value.elts):
            return node.value.elts[names.index(name)]
    return None


def _arg(node: ast.expr, function: ast.AST | None, line: int) -> str | None:
    if isinstance(node, ast.Name):
        return _bound(function, node.id, line)
    return _flat(node)


def _check_message(call: ast.Call, function: ast.AST | None = None) -> str | None:
    """``<name> must be <must>`` of an argument check (``_checks.check_arg``, ``check_int``, ...), which
    composes its message from its arguments; ``None`` for other calls."""
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
    if not name.startswith("check_") or len(call.args) < 2:
        return None
    argument = _arg(call.args[1], function, call.lineno) or HOLE
    must = _arg(call.args[3], function, call.lineno) if name == "check_arg" and len(call.args) > 3 else None
    return f"{argument} must be {must or HOLE}"


def _inside(functions: list[ast.AST], node: ast.AST) -> ast.AST | None:
    """The innermost of ``functions`` that holds ``node``."""
    inside = [f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
    return inside[-1] if inside else None


def _literals(trees: dict[str, ast.Module]) -> list[str]:
    """Every string the package's code builds (not its docstrings), flattened, and the messages of its
    argument checks."""
    out = []
    for tree in trees.values():
        skip = _docstrings(tree)
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            text = None
            if id(node) not in skip and isinstance(node, (ast.Constant, ast.JoinedStr)):
                text = _flat(node)
            elif isinstance(node, ast.Call):
                text = _check_message(node, _inside(functions, node))
            if text:
                out.append(text)
    return out


def _message(call: ast.Call, function: ast.AST | None) -> str | None:
    """The message a warning call emits; ``None`` where it forwards a parameter of its function (as
    ``warn_once`` itself does)."""
    arg = call.args[0]
    if isinstance(arg, ast.Name) and function is not None:
        params = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}  # type: ignore[attr-defined]
        if arg.id in params:
            return None
        values = [
            n.value
            for n in ast.walk(function)
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == arg.id for t in n.targets)
        ]
        arg = values[-1] if values else arg
    text = _flat(arg)
    assert text is not None, f"cannot read the message of {ast.unparse(call)}: build it as a literal string"
    return text


def _warnings(trees: dict[str, ast.Module]) -> list[tuple[str, str]]:
    """``(file:line, message)`` of every call that emits a warning."""
    out = []
    for path, tree in trees.items():
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name not in WARNING_CALLS or (name == "warn" and ast.unparse(node.func) != "warnings.warn"):
                continue
            message = _message(node, _inside(functions, node))
            if message is not None:
                out.append((f"{path}:{node.lineno}", message))
    return out


def _phrases() -> list[str]:
    """The phrase each entry of the page quotes: the first code span of a table row's first cell."""
    out = []
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            span = re.search(r"`([^`]+)`", cells[1])
            if span:
                out.append(_norm(span.group(1)))
    return out


def _says(text: str, phrase: str) -> bool:
    """Whether ``text`` holds the pieces of ``phrase`` (split at ``…``) in order, none across a value."""
    at = 0
    for piece in (p.strip() for p in phrase.split("…")):
        if not piece:
            continue
        found = text.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True


@pytest.fixture(scope="module")
def trees():
    return _trees()


def test_the_page_has_entries_in_every_section():
    phrases = _phrases()
    assert len(phrases) > 100
    assert len(set(phrases)) == len(phrases), [p for p in phrases if phrases.count(p) > 1]


def test_every_warning_has_an_entry(trees):
    warnings = _warnings(trees)
    assert len(warnings) > 20  # the scan finds them: warn_once, rank_zero_warn, warnings.warn
    phrases = _phrases()
    missing = [
        f"{where}: {message}" for where, message in warnings if not any(_says(message, p) for p in phrases)
    ]
    assert missing == [], (
        "warnings without an entry in docs/troubleshooting.md (add a row quoting a phrase of each):\n"
        + "\n".join(missing)
    )


def test_every_entry_quotes_a_message_the_package_still_has(trees):
    literals = _literals(trees)
    stale = [p for p in _phrases() if not any(_says(text, p) for text in literals)]
    assert stale == [], f"entries whose phrase no message of the package contains any more: {stale}"


def test_a_phrase_matches_in_order_and_never_across_a_value():
    message = _norm(f"GPUStatsMonitor: the {HOLE} has no logger, so the metrics are kept in history")
    assert _says(message, "has no logger, so the metrics")
    assert _says(message, "GPUStatsMonitor: the … has no logger")
    assert not _says(message, "the Trainer has no logger")  # a value, not text of the message
    assert not _says(message, "has no logger … GPUStatsMonitor")  # out of order
    tree = ast.parse(
        'def f(x):\n    msg = f"left {x} unfused: " + "why"\n    warn_once(msg)\n    warn_once(x)\n'
    )
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "warn_once"
    ]
    assert [_message(c, tree.body[0]) for c in calls] == [f"left {HOLE} unfused: why", None]


def test_a_check_message_is_composed_from_a_name_bound_earlier():
    tree = ast.parse(
        'def f(x):\n    must = "at most 4 per CPU"\n    must += " (the cores)"\n'
        '    check_arg(ok, "num_workers", x, must, fix)\n    must, fix = f"{x} again", "z"\n'
        '    check_arg(ok, "y", x, must)\n'
    )
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    got = sorted(_check_message(c, tree.body[0]) for c in calls)
    assert got == ["num_workers must be at most 4 per CPU (the cores)", f"y must be {HOLE} again"]
