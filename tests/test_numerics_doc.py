"""The repository's own contract (docs/numerics.md) is what code comments cite; every citation
must point at a section or numbered rule that exists there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r"numerics\.md §(\d+)(?:\.(\d+))?")


def _sections(text: str) -> set:
    found, current = set(), None
    for line in text.splitlines():
        m = re.match(r"^## (\d+)\. ", line)
        if m:
            current = int(m.group(1))
            found.add((current, None))
            continue
        m = re.match(r"^(\d+)\. ", line)
        if m and current is not None:
            found.add((current, int(m.group(1))))
    return found


def test_every_citation_names_an_existing_rule():
    doc = (ROOT / "docs" / "numerics.md").read_text()
    sections = _sections(doc)
    assert {(1, None), (2, None), (3, None), (4, None), (5, None), (2, 7)} <= sections
    cited = []
    for path in [*ROOT.glob("jaxquant/**/*.py"), *ROOT.glob("csrc/**/*.*"), *ROOT.glob("docs/*.md"),
                 *ROOT.glob("tests/*.py"), ROOT / "README.md"]:
        for m in CITE.finditer(path.read_text(errors="replace")):
            rule = (int(m.group(1)), int(m.group(2)) if m.group(2) else None)
            cited.append(rule)
            assert rule in sections, \
                f"{path.relative_to(ROOT)} cites docs/numerics.md §{m.group(0)[14:]}, which does not exist"
    assert len(cited) > 20   # the code does cite the contract


def test_no_citation_of_a_file_outside_the_repository():
    for path in [*ROOT.glob("jaxquant/**/*.py"), *ROOT.glob("csrc/**/*.*"), *ROOT.glob("docs/*.md"),
                 ROOT / "README.md"]:
        text = path.read_text(errors="replace")
        assert not re.search(r"\bSPEC(\.md)? §", text), \
            f"{path.relative_to(ROOT)} cites SPEC instead of docs/numerics.md"
