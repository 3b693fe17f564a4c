"""Build the API reference of ``lightning_gpuopt`` from its docstrings with pdoc, and check it.

    python tools/build_api_docs.py               # HTML into docs/api/ (open docs/api/index.html)
    python tools/build_api_docs.py -o /tmp/api   # elsewhere

It documents the package and every public module below it (no part of the dotted name starting with ``_``),
Google-style docstrings, without source. A ``#:`` comment above a module-level assignment is that variable's
docstring (Sphinx's convention, which the package follows), and a variable a package re-exports carries the
docstring of the module that defines it.

The build fails (exit status 1, one line a problem) when pdoc warns while building, when a name a public
package exports (its ``__all__``) has no docstring, when a link in the output points at a page or an anchor
that does not exist, or when a ``lightning_gpuopt.…`` name quoted in a docstring is not a documented object
(pdoc links every name it can resolve and leaves the others as text). Needs ``pip install -e ".[docs]"``.
"""

from __future__ import annotations

import argparse
import ast
import functools
import html
import importlib
import inspect
import pkgutil
import re
import sys
import warnings
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = "lightning_gpuopt"
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "api"

_HREF = re.compile(r'href="([^"]*)"')
_ID = re.compile(r'\bid="([^"]*)"')
_SECTION = re.compile(r'<section id="([^"]*)"')
_LINK = re.compile(r"<a\b[^>]*>.*?</a>", re.S)
_LOCAL_LINK = re.compile(r'<a href="#([^"]*)">(.*?)</a>', re.S)
_CODE = re.compile(r"<code>([^<]*)</code>")
_DOTTED = re.compile(rf"{PACKAGE}(?:\.\w+)+(?:\(\))?")


def public_modules() -> list[str]:
    """The package and every module below it whose dotted name has no part starting with ``_``."""
    package = importlib.import_module(PACKAGE)
    names = [PACKAGE, *(m.name for m in pkgutil.walk_packages(package.__path__, f"{PACKAGE}."))]
    return [n for n in names if not any(part.startswith("_") for part in n.split("."))]


def exported_names(modules: list[str]) -> dict[str, list[str]]:
    """``{package: its __all__}`` for each public package (a module with ``__path__``) that has one."""
    out = {}
    for name in modules:
        module = importlib.import_module(name)
        if hasattr(module, "__path__") and hasattr(module, "__all__"):
            out[name] = list(module.__all__)
    return out


def _comment_docstrings(module: ModuleType) -> dict[str, str]:
    """``{name: text}`` of the ``#:`` comment lines right above each module-level assignment."""
    return _comments_of(module.__name__)


@functools.cache
def _comments_of(name: str) -> dict[str, str]:
    module = sys.modules[name]
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        else:
            continue
        block: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].lstrip().startswith("#:"):
            block.insert(0, lines[i].lstrip()[2:].strip())
            i -= 1
        if block:
            out[name] = "\n".join(block)
    return out


def _module_class() -> type:
    import pdoc.doc

    class Module(pdoc.doc.Module):
        """pdoc's module, whose variables also take their docstrings from ``#:`` comments, and whose
        re-exported variables take them from the module of this package that defines them."""

        @cached_property
        def _var_docstrings(self) -> dict[str, str]:
            out = {**_comment_docstrings(self.obj), **super()._var_docstrings}
            for name in getattr(self.obj, "__all__", ()):
                value = self.obj.__dict__.get(name)
                if name in out or value is None:
                    continue
                for other in list(sys.modules.values()):
                    source = getattr(other, "__name__", "")
                    if (
                        other is not self.obj
                        and source.startswith(f"{PACKAGE}.")
                        and getattr(other, "__dict__", {}).get(name) is value
                    ):
                        text = _comment_docstrings(other).get(name)
                        if text:
                            out[name] = text
                            break
            return out

    return Module


def _specs(modules: list[str]) -> list[str]:
    """What to pass pdoc so that it walks each module once: the package, the modules of packages with an
    ``__all__`` (pdoc walks the others' own), and a pattern leaving the private modules out."""
    specs = []
    for name in modules:
        parent = name.rpartition(".")[0]
        if name == PACKAGE or hasattr(importlib.import_module(parent), "__all__"):
            specs.append(name)
    return [*specs, r"!.*\._"]


def _unlink_inherited(page: str, module: Any) -> str:
    """The page without its links to members a class inherits from outside the reference (Lightning's
    ``prepare_data``, ``DataLoader``'s ``pin_memory``): pdoc links a name in a docstring to such a member but
    lists it without an anchor, so the link would lead nowhere; it becomes plain text."""
    import pdoc.doc

    ids = set(_ID.findall(page))

    def inherited(anchor: str) -> bool:
        owner, _, member = anchor.rpartition(".")
        cls = module.get(owner) if owner else None
        return isinstance(cls, pdoc.doc.Class) and member not in {m.name for m in cls.own_members}

    def repl(match: re.Match[str]) -> str:
        anchor = html.unescape(match.group(1))
        return match.group(2) if anchor not in ids and inherited(anchor) else match.group(0)

    return _LOCAL_LINK.sub(repl, page)


def _link_problems(root: Path) -> list[str]:
    """Links to a missing page or anchor, and quoted ``lightning_gpuopt.…`` names pdoc left unlinked."""
    problems = []
    ids: dict[Path, set[str]] = {}

    def anchors(page: Path) -> set[str]:
        if page not in ids:
            ids[page] = set(_ID.findall(page.read_text(encoding="utf-8")))
        return ids[page]

    for page in sorted(root.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        rel = page.relative_to(root).as_posix()
        for match in _HREF.finditer(text):
            href = html.unescape(match.group(1))
            if not href or "://" in href or href.startswith(("mailto:", "data:", "${")):
                continue
            file, _, anchor = href.partition("#")
            target = (page.parent / file).resolve() if file else page
            sections = _SECTION.findall(text, 0, match.start())
            where = f"{rel} (in {sections[-1]})" if sections else rel
            if not target.is_file():
                problems.append(f"{where}: link {href!r}: no page {file}")
            elif anchor and anchor not in anchors(target):
                problems.append(
                    f"{where}: link {href!r}: no {anchor!r} on that page (a name in a docstring that pdoc "
                    "took for a member it does not document: quote it differently or name it in full)"
                )
        plain = _LINK.sub("", text)
        for match in _CODE.finditer(plain):
            code = html.unescape(match.group(1))
            if _DOTTED.fullmatch(code):
                sections = _SECTION.findall(plain, 0, match.start())
                where = f"{rel} (in {sections[-1]})" if sections else rel
                problems.append(f"{where}: `{code}` names nothing documented (a renamed or private object?)")
    return problems


def build(output: str | Path = DEFAULT_OUTPUT, search: bool = True) -> list[str]:
    """Write the HTML reference into ``output`` (with ``search``, its search index too); return the problems
    found, one line each (empty: a clean build)."""
    try:
        import pdoc.doc
        import pdoc.extract
        import pdoc.render
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"{err}; install it with `pip install -e '.[docs]'`") from err
    output = Path(output)
    problems: list[str] = []
    modules = public_modules()
    exports = exported_names(modules)
    for package, names in exports.items():  # resolve lazy exports (PEP 562), as a user's access would
        for name in names:
            try:
                getattr(importlib.import_module(package), name)
            except Exception as err:  # a broken export: reported, the rest is still built
                problems.append(f"{package}.__all__ names {name!r}, which does not import: {err}")
    module_class = _module_class()
    pdoc.render.configure(docformat="google", show_source=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = {
            name: module_class(pdoc.extract.load_module(name))
            for name in pdoc.extract.walk_specs(_specs(modules))
        }
        for doc in docs.values():
            page = output / f"{doc.fullname.replace('.', '/')}.html"
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(_unlink_inherited(pdoc.render.html_module(doc, docs), doc), encoding="utf-8")
        (output / "index.html").write_text(pdoc.render.html_index(docs), encoding="utf-8")
        if search:
            (output / "search.js").write_text(pdoc.render.search_index(docs), encoding="utf-8")
    problems += [f"pdoc: {w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught]
    for package, names in exports.items():
        for name in names:
            member = docs[package].get(name) if package in docs else None
            if member is None or not member.docstring.strip():
                problems.append(f"{package}.{name}: no docstring (exported by {package}.__all__)")
    return list(dict.fromkeys(problems + _link_problems(output)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="folder for the HTML (docs/api)"
    )
    args = parser.parse_args(argv)
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # the checkout's package, also where it is not installed
        sys.path.insert(0, root)
    problems = build(args.output)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s); the reference was written to {args.output}", file=sys.stderr)
        return 1
    print(f"API reference: {args.output / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
