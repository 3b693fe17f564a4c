"""The API reference (``python tools/build_api_docs.py``) builds cleanly: pdoc raises no warning, every name
a public package exports has a docstring, and no link or quoted ``lightning_gpuopt.`` name is broken."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("pdoc", reason="the API reference needs pdoc: pip install -e '.[docs]'")

TOOL = Path(__file__).resolve().parent.parent / "tools" / "build_api_docs.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("build_api_docs", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_builds_without_a_problem(tool, tmp_path):
    """Builds the whole reference (about 10 s of CPU, most of it pdoc rendering Lightning's inherited
    members); the search index is left out, the pages are the ones the command writes."""
    problems = tool.build(tmp_path, search=False)
    assert problems == [], "\n".join(problems)
    assert (tmp_path / "index.html").is_file()
    page = (tmp_path / "lightning_gpuopt.html").read_text(encoding="utf-8")
    assert 'id="GPUStatsMonitor"' in page and 'id="OptimizedDataModule"' in page
    # a #: comment is a variable's docstring, also where a package re-exports the variable (KINDS)
    advisor = (tmp_path / "lightning_gpuopt" / "observe" / "advisor.html").read_text(encoding="utf-8")
    assert "Every verdict kind, in report order" in advisor
    # every public module has a page, private ones have none
    assert (tmp_path / "lightning_gpuopt" / "observe" / "host_cpu.html").is_file()
    assert not list(tmp_path.rglob("_*.html"))


def test_dead_links_and_unresolved_names_are_reported(tool, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.html").write_text(
        '<section id="Thing"><div id="Thing.go"></div>'
        '<a href="b.html#Other">ok</a> <a href="b.html#Gone">gone</a> <a href="c.html">missing page</a>'
        ' <code>lightning_gpuopt.nowhere.Thing</code> <code><a href="#Thing.go">lightning_gpuopt.a.Thing</a></code>'
        ' <a href="https://pytorch.org">outside</a> <a href="#Thing.go">here</a></section>'
    )
    (tmp_path / "pkg" / "b.html").write_text('<section id="Other"></section>')
    problems = tool._link_problems(tmp_path)
    assert len(problems) == 3, problems
    assert "'b.html#Gone'" in problems[0] and "pkg/a.html (in Thing)" in problems[0]
    assert "no page c.html" in problems[1]
    assert "`lightning_gpuopt.nowhere.Thing` names nothing documented" in problems[2]


def test_comment_docstrings_are_read_above_assignments(tool):
    comments = tool._comment_docstrings(importlib.import_module("lightning_gpuopt.observe.host_cpu"))
    assert comments["CPU_KEYS"].startswith("Keys ``HostCPUReader.window()`` returns")
    assert "_NOT_BUSY" in comments and "PACKAGE" not in comments
