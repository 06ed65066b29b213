"""The docs are product: every ```bash and ```python block of README.md and docs/*.md runs, as written, in a
fresh folder holding the files the pages name (tests/docs_runner.py says how and why); the blocks that
cannot run here are marked with the reason and listed in docs/testing.md; the README's script is a real
file; every figure the pages print equals the measurement it came from (tests/docs_checks.py)."""

from __future__ import annotations

import re
from pathlib import Path

import docs_checks
import docs_runner
import pytest
from docs_runner import REPO, blocks, pages

PAGES_THAT_RUN = [p for p in pages() if any(docs_runner.runnable(b) for b in blocks(p))]


@pytest.mark.slow
# The timeout's reason: a page runs up to a dozen launches one after another, each a few seconds on 2 idle
# cores and several times that on a loaded machine; a hung block is also killed by the runner's own limit.
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "page", PAGES_THAT_RUN, ids=[str(p.relative_to(REPO)) for p in PAGES_THAT_RUN]
)
def test_every_block_of_the_page_runs_as_written(page: Path):
    for block, status, output, seconds in docs_runner.run_page(page):
        assert status == 0, (
            f"{block.where} ({block.lang}) exited {status} after {seconds:.1f} s:\n"
            f"{block.source}\n--- its output (last 60 lines)\n"
            + "\n".join(output.splitlines()[-60:])
        )


def test_fences_name_a_known_language_and_markers_sit_on_code():
    for page in pages():
        for block in blocks(page):
            assert block.lang in docs_runner.KNOWN, (
                f"{block.where}: ```{block.lang} - use ```bash for commands to run, ```text or a plain fence for output"
            )
            assert block.skip is None or block.lang in docs_runner.RUN, (
                f"{block.where}: a not-run marker on a {block.lang or 'plain'} block"
            )


#: A line of an output sample that is really a command: it belongs in a ```bash block (or after "$ ").
COMMAND_IN_OUTPUT = re.compile(
    r"^(multigpu|python|pip|make|torchrun|srun|sbatch|bash)\s+(?![\d.]+\b)[^\s:]+(\s|$)"
)


def test_commands_are_not_hidden_in_output_samples():
    for page in pages():
        for block in blocks(page):
            if block.lang in ("", "text"):
                for offset, line in enumerate(block.source.splitlines(), 1):
                    assert not COMMAND_IN_OUTPUT.match(line), (
                        f"{block.page}:{block.line + offset}: {line!r} is a command in an output sample: put it in a "
                        "```bash block (run by this test, or marked not run with the reason), or write it as '$ ...'"
                    )


def test_docs_testing_md_lists_every_block_not_run():
    text = (REPO / "docs" / "testing.md").read_text()
    found = re.search(r"<!-- blocks table start -->\n(.*?)\n<!-- blocks table end -->", text, re.S)
    assert found, "docs/testing.md has no blocks table between its markers"
    assert found.group(1).strip() == docs_runner.table(), (
        "docs/testing.md's table of doc blocks is out of date; replace it with `python tests/docs_runner.py --table`"
    )


def test_the_readmes_script_is_examples_quickstart_train_py():
    readme = [b for b in blocks(REPO / "README.md") if b.lang == "python"]
    script = (REPO / "examples" / "quickstart" / "train.py").read_text()
    assert len(readme) == 1 and readme[0].source == script, (
        "README.md's python block must be examples/quickstart/train.py, all of it (copy the file into the block)"
    )


def test_every_figure_matches_its_measurement():
    problems = docs_checks.figure_problems(pages())
    assert not problems, "\n".join(problems)


def test_every_glossary_term_is_linked_at_its_first_use_on_each_page():
    problems = docs_checks.glossary_problems(pages())
    assert not problems, "\n".join(problems)
