"""``benchmarks/results/`` keeps what the documentation cites, one folder a subject, with an index
(``benchmarks/results/README.md``) naming the pages that cite each file; the pages' links resolve."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
#: a kept file's name in its subject folder: ``<date>-<subject>[-<detail>]-<machine>.<json|log>``
NAME = r"\d{{4}}-\d{{2}}-\d{{2}}-{subject}(?:-[a-z0-9]+)*-(?:[a-z]\d+(?:x\d+)?|cpu)\.(?:json|log)"
#: a results file as a page or the code names it: a path under ``benchmarks/results/``, or a dated name
RESULT_PATH = re.compile(r"benchmarks/results/([\w./-]*[\w/])")
DATED_NAME = re.compile(r"(?<![\w/.-])\d{4}-\d{2}-\d{2}-[\w.-]*?\.(?:json|log)(?![\w-])")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _pages(root: Path) -> dict[str, str]:
    """The pages that may cite a result: README.md, CONTRIBUTING.md and docs/*.md."""
    paths = [root / "README.md", root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in paths if p.is_file()}


def _index(root: Path) -> dict[str, set[str]]:
    """The index's rows: ``<subject>/<file>`` -> the pages its "cited by" cell links to (repository paths)."""
    index = root / RESULTS / "README.md"
    rows: dict[str, set[str]] = {}
    subject = None
    for line in index.read_text(encoding="utf-8").splitlines():
        if m := re.fullmatch(r"## ([\w-]+)/", line):
            subject = m.group(1)
        elif subject and (m := re.match(r"\| `([^`]+)` \|.*\|([^|]*)\|$", line)):
            pages = {(index.parent / t).resolve().relative_to(root.resolve()).as_posix()
                     for t in re.findall(r"\]\(([^)#]+)", m.group(2))}  # fmt: skip
            rows[f"{subject}/{m.group(1)}"] = pages
    return rows


def result_problems(root: Path) -> list[str]:
    """What breaks the rule: a kept file misnamed, without its row in the index, cited by other pages than its
    row names or by none; a row without its file; a results file a page or the code names that is not kept."""
    results = root / RESULTS
    kept = sorted(p.relative_to(results).as_posix() for p in results.glob("*/**/*") if p.is_file())
    index, pages = _index(root), _pages(root)
    problems = []
    for rel in kept:
        subject, _, name = rel.partition("/")
        if not re.fullmatch(NAME.format(subject=re.escape(subject)), name):
            problems.append(f"{rel}: not named {subject}/<date>-{subject}[-<detail>]-<machine>.<json|log>")
        citing = {page for page, text in pages.items() if name in text}
        if not citing:
            problems.append(f"{rel}: no page cites it; cite it or delete it (git rm)")
        if rel not in index:
            problems.append(f"{rel}: no row in {RESULTS}/README.md")
        elif index[rel] != citing:
            problems.append(
                f"{rel}: the index says it is cited by {sorted(index[rel])}, it is by {sorted(citing)}"
            )
    problems += [f"{RESULTS}/README.md: a row for {rel}, no such file" for rel in index if rel not in kept]
    names = [Path(rel).name for rel in kept]
    problems += [
        f"{name}: in two subject folders" for name in sorted({n for n in names if names.count(n) > 1})
    ]
    texts = {**pages, "CHANGELOG.md": (root / "CHANGELOG.md").read_text(encoding="utf-8")}
    for path in [*(root / "benchmarks").glob("*.py"), *(root / "benchmarks").glob("*.sh"),
                 *(root / "lightning_gpuopt").rglob("*.py")]:  # fmt: skip
        texts[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
    for where, text in texts.items():
        missing = {p for p in RESULT_PATH.findall(text) if not (results / p).exists()}
        missing |= {n for n in DATED_NAME.findall(text) if n not in names}
        problems += [f"{where}: names {p}, which {RESULTS}/ does not keep" for p in sorted(missing)]
    return problems


def test_every_kept_result_is_indexed_and_cited_and_every_cited_result_is_kept() -> None:
    problems = result_problems(REPO)
    assert not problems, "\n".join(problems)


def _tree(root: Path) -> None:
    """A repository of one page citing one kept result, indexed."""
    (root / "docs").mkdir()
    (root / "lightning_gpuopt").mkdir()
    (root / "benchmarks" / "results" / "peers").mkdir(parents=True)
    (root / "benchmarks" / "results" / "peers" / "2026-01-02-peers-h200.json").write_text("{}")
    (root / "README.md").write_text("Measured: `benchmarks/results/peers/2026-01-02-peers-h200.json`.\n")
    (root / "CHANGELOG.md").write_text("# Changelog\n")
    (root / "benchmarks" / "results" / "README.md").write_text(
        "# Results\n\n## peers/\n\n| file | what | machine | cited by |\n|---|---|---|---|\n"
        "| `2026-01-02-peers-h200.json` | rows | H200 | [README.md](../../README.md) |\n"
    )


def test_a_stray_an_uncited_or_a_missing_result_is_named(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert result_problems(tmp_path) == []
    peers = tmp_path / RESULTS / "peers"
    (peers / "stray.json").write_text("{}")
    (peers / "2026-01-03-peers-h100.log").write_text("")
    (tmp_path / "docs" / "x.md").write_text("See `2026-01-04-jpeg-h200.json` and benchmarks/results/jpeg/.\n")
    problems = result_problems(tmp_path)
    assert any(p.startswith("peers/stray.json: not named") for p in problems), problems
    assert "peers/stray.json: no row in benchmarks/results/README.md" in problems
    assert "peers/2026-01-03-peers-h100.log: no page cites it; cite it or delete it (git rm)" in problems
    assert "docs/x.md: names 2026-01-04-jpeg-h200.json, which benchmarks/results/ does not keep" in problems
    assert "docs/x.md: names jpeg/, which benchmarks/results/ does not keep" in problems
    # a page citing a file its row does not name
    (tmp_path / "docs" / "x.md").write_text("`2026-01-02-peers-h200.json`\n")
    assert "docs/x.md" in "".join(p for p in result_problems(tmp_path) if "the index says" in p)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(text), flags=re.MULTILINE):
        slug, n = _slug(heading), 1
        while slug in anchors:  # a repeated heading gets -1, -2, ...
            slug, n = f"{_slug(heading)}-{n}", n + 1
        anchors.add(slug)
    return anchors


def _prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def test_links_of_the_docs_resolve() -> None:
    """Each relative link of README.md, CONTRIBUTING.md, CHANGELOG.md, docs/*.md and the results index leads to
    a file that exists and, with ``#anchor``, to a heading of it."""
    pages = [*_pages(REPO), "CHANGELOG.md", f"{RESULTS}/README.md"]
    broken = []
    for page in pages:
        path = REPO / page
        for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{page}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{page}: {target}: no heading #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)
