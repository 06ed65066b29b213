"""Checks of the docs' text that need no process: figures against their measurements, glossary links.

Figures. A number the docs print from a measurement carries a marker just before it:

    **<!-- figure: startup.ratio -->1.06**              benchmarks/results/startup.json, figures["ratio"]
    <!-- constant: tests/test_equivalence.py TOLERANCE -->1e-7     a test's bound, read from its source

A results file is written by the benchmark itself (benchmarks/record.py): the date, the versions, the
command, and the SHA-256 of the benchmark's files. The check fails when a printed figure differs from its
file (to the printed precision), when the page does not print the file's date, or when a benchmark's
files changed since they measured (so a changed benchmark forces a new measurement).

Glossary. Each term of :data:`TERMS` is a link to its entry in docs/glossary.md at its first use in the
prose of every page (code, headings, comments and other links' text do not count as uses).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NUMBER = r"([-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)"
FIGURE = re.compile(r"<!--\s*figure:\s*([\w-]+)\.([\w.]+)\s*-->\s*(?:\*\*)?" + NUMBER)
CONSTANT = re.compile(r"<!--\s*constant:\s*(\S+)\s+(\w+)\s*-->\s*(?:\*\*)?" + NUMBER)


def files_hash(files: Iterable[str]) -> str:
    """The SHA-256 of the named files (paths relative to the repository) with their names: the same
    function as benchmarks/record.py's, so that a results file names the code that measured it."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + (REPO / name).read_bytes() + b"\0")
    return digest.hexdigest()


def agrees(printed: str, value: float) -> bool:
    """``printed`` is ``value`` rounded to the precision printed (``1.06`` for 1.0573, ``6e-8`` for 5.9e-8)."""
    text = printed.replace(",", "")
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    step = 10.0 ** (int(exponent or 0) - decimals)
    return abs(float(text) - float(value)) <= step / 2 * (1 + 1e-9)


def _constant(path: str, name: str) -> float:
    tree = ast.parse((REPO / path).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return float(ast.literal_eval(node.value))
    raise KeyError(f"{path} has no module-level constant {name}")


def results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def result_problems() -> list[str]:
    """Every results file names its date, versions and command, and the code that measured is unchanged."""
    problems = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        for key in ("date", "python", "torch", "command", "files", "sha256", "figures"):
            if key not in data:
                problems.append(f"{path.relative_to(REPO)}: no {key!r}")
        if "files" in data and "sha256" in data:
            missing = [f for f in data["files"] if not (REPO / f).is_file()]
            if missing:
                problems.append(
                    f"{path.relative_to(REPO)}: measured with {missing}, which no longer exist(s)"
                )
            elif files_hash(data["files"]) != data["sha256"]:
                problems.append(
                    f"{path.relative_to(REPO)}: {', '.join(data['files'])} changed since it measured on "
                    f"{data.get('date')}: measure again with `{data.get('command')}`"
                )
    return problems


def figure_problems(pages: Iterable[Path]) -> list[str]:
    problems = result_problems()
    for page in pages:
        text = page.read_text()
        where = page.relative_to(REPO)
        for match in FIGURE.finditer(text):
            name, key, printed = match.groups()
            line = text.count("\n", 0, match.start()) + 1
            try:
                data = results(name)
                value = data["figures"][key]
            except (OSError, KeyError, ValueError) as exc:
                problems.append(
                    f"{where}:{line}: figure {name}.{key}: {exc!r} (benchmarks/results/{name}.json)"
                )
                continue
            if not agrees(printed, value):
                problems.append(
                    f"{where}:{line}: prints {printed} for {name}.{key}, measured {value} on {data['date']}"
                )
            if data["date"] not in text:
                problems.append(
                    f"{where}:{line}: {name}.{key} was measured on {data['date']}; the page does not say so"
                )
        for match in CONSTANT.finditer(text):
            path, name, printed = match.groups()
            line = text.count("\n", 0, match.start()) + 1
            try:
                value = _constant(path, name)
            except (OSError, KeyError, ValueError, SyntaxError) as exc:
                problems.append(f"{where}:{line}: constant {path} {name}: {exc}")
                continue
            if not agrees(printed, value):
                problems.append(
                    f"{where}:{line}: prints {printed} for {path}'s {name}, which is {value}"
                )
    return problems


# ----------------------------------------------------------------------------------------- glossary

#: Glossary anchor -> the words that use the term (case-sensitive where the term is an acronym).
TERMS: dict[str, str] = {
    "all-reduce": r"\ball-reduces?\b",
    "asdf": r"\bASDF\b",
    "bus-bandwidth": r"\bbus bandwidth\b",
    "c10d": r"\bc10d\b",
    "dcp": r"\bDCP\b",
    "ddp": r"\bDDP\b",
    "devicemesh": r"\bDeviceMesh\b",
    "elastic-agent": r"\belastic agent\b",
    "ex_tempfail": r"\bEX_TEMPFAIL\b",
    "flight-recorder": r"\bflight recorder\b",
    "fsdp": r"\bFSDP2?\b",
    "gloo": r"\bgloo\b",
    "global-batch": r"\bglobal batch\b",
    "gradient-accumulation": r"\baccumulation\b",
    "hsdp": r"\bHSDP\b",
    "mfu": r"\bMFU\b",
    "nccl": r"\bNCCL\b",
    "process-group": r"\bprocess groups?\b",
    "rank": r"\branks?\b",
    "rendezvous": r"\b[Rr]endezvous\b",
    "speechbrain": r"\bSpeechBrain\b",
    "tensor-parallelism": r"\btensor[- ]parallel(?:ism)?\b",
    "world-size": r"\bworld size\b",
    "xid": r"\bXID\b",
}

LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s]*)\)")


def masked(text: str) -> str:
    """``text`` with everything that is not prose blanked out (same length, so positions hold): fenced
    blocks, headings, HTML comments, inline code, and the text and target of links."""

    def blank(match: re.Match) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    text = re.sub(r"^(\s*)(```+).*?^\s*\2\s*$", blank, text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.S)
    text = re.sub(r"^#.*$", blank, text, flags=re.M)
    text = re.sub(r"`[^`\n]*`", blank, text)
    return LINK.sub(blank, text)


def glossary_link(page: Path, anchor: str) -> str:
    prefix = "" if page.parent == REPO / "docs" else "docs/"
    return f"{prefix}glossary.md#{anchor}"


def first_uses(page: Path) -> dict[str, tuple[int, int, str]]:
    """For each term: where its first use in the page's prose is (start, end, line), glossary links included."""
    text = page.read_text()
    prose = masked(text)
    links = [m for m in LINK.finditer(text) if "glossary.md#" in m.group(2)]
    found = {}
    for anchor, pattern in TERMS.items():
        hits = [(m.start(), m.end()) for m in re.finditer(pattern, prose)]
        # a use inside a glossary link counts too (its text is blanked in `prose`)
        for link in links:
            if link.group(2).endswith(f"#{anchor}") and re.search(pattern, link.group(1)):
                hits.append((link.start(), link.end()))
        if hits:
            start, end = min(hits)
            found[anchor] = (start, end, f"{text.count(chr(10), 0, start) + 1}")
    return found


def glossary_problems(pages: Iterable[Path]) -> list[str]:
    glossary = (REPO / "docs" / "glossary.md").read_text()
    anchors = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^## (.+)$", glossary, flags=re.M)
    }
    problems = [f"docs/glossary.md: no entry for {a!r}" for a in TERMS if a not in anchors]
    for page in pages:
        if page.name == "glossary.md":
            continue
        text = page.read_text()
        for anchor, (start, end, line) in first_uses(page).items():
            link = LINK.match(text, start)
            if not (link and link.group(2) == glossary_link(page, anchor)):
                problems.append(
                    f"{page.relative_to(REPO)}:{line}: the first use of {text[start:end]!r} is not a link "
                    f"to {glossary_link(page, anchor)}"
                )
    return problems


def formatted_like(printed: str, value: float) -> str:
    """``value`` written with the precision and style of ``printed`` (decimals, thousands commas, e-notation)."""
    mantissa, _, exponent = printed.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    if exponent:
        return f"{value:.{decimals}e}".replace("e-0", "e-").replace("e+0", "e")
    return f"{value:,.{decimals}f}" if "," in printed else f"{value:.{decimals}f}"


def update_figures(pages: Iterable[Path]) -> list[str]:
    """Rewrite every marked figure from its results file (after a benchmark ran again); returns what changed.
    The dates on the pages are not touched: the check says which ones to update by hand."""
    changed = []
    for page in pages:
        text = page.read_text()

        def replace(match: re.Match, page: Path = page) -> str:
            name, key, printed = match.groups()
            try:
                value = results(name)["figures"][key]
            except (OSError, KeyError, ValueError):
                return match.group(0)  # the check reports it
            new = formatted_like(printed, value)
            if new != printed:
                changed.append(f"{page.relative_to(REPO)}: {name}.{key} {printed} -> {new}")
            return match.group(0)[: match.start(3) - match.start(0)] + new

        page.write_text(FIGURE.sub(replace, text))
    return changed


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from docs_runner import pages as all_pages

    if sys.argv[1:] == ["--update"]:
        print("\n".join(update_figures(all_pages())) or "no figure changed")
    else:
        print(
            "\n".join(figure_problems(all_pages()) + glossary_problems(all_pages()))
            or "figures and glossary links agree"
        )
