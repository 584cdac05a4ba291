"""The fork's markdown (README, docs, benchmark results and their NOTES) links only
to files that exist: its docs cite results directories by relative path, and a
moved or renamed one would leave a user at a dead link."""

import os
import re
import tempfile
import unittest
from pathlib import Path
from typing import Iterator, List, Tuple

from readme_commands import REPO_ROOT

from sglang.test.test_utils import CustomTestCase

MARKDOWN_ROOTS = ("docs", "benchmark", "test")
# [text](target) and ![alt](target); the target ends at the first space or ")".
LINK = re.compile(r"\]\(([^)\s]+)\)")
# http:, https:, mailto: ... and links inside the page.
NOT_A_FILE = re.compile(r"^([a-z][a-z0-9+.-]*:|#)")


def fork_markdown() -> List[Path]:
    root = Path(REPO_ROOT)
    files = [root / "README.md"]
    for top in MARKDOWN_ROOTS:
        files += sorted((root / top).rglob("*.md"))
    return files


def relative_links(markdown: Path) -> Iterator[Tuple[str, Path]]:
    """(link as written, the file it names) for each link to a file."""
    for target in LINK.findall(markdown.read_text()):
        if not NOT_A_FILE.match(target):
            yield target, markdown.parent / target.split("#", 1)[0]


def dead_links(markdown: Path) -> List[str]:
    return [link for link, path in relative_links(markdown) if not path.exists()]


class TestDocLinks(CustomTestCase):
    def test_every_relative_link_names_a_file_that_exists(self):
        files = fork_markdown()
        self.assertIn(
            Path(
                REPO_ROOT, "docs/advanced_features/load_aware_speculative_decoding.md"
            ),
            files,
        )
        self.assertGreater(sum(len(list(relative_links(f))) for f in files), 50)
        dead = {
            os.path.relpath(f, REPO_ROOT): links
            for f in files
            if (links := dead_links(f))
        }
        self.assertEqual(dead, {})

    def test_only_links_to_missing_files_are_dead(self):
        with tempfile.TemporaryDirectory() as root:
            Path(root, "there").mkdir()
            Path(root, "there", "NOTES.md").write_text("")
            page = Path(root, "page.md")
            page.write_text(
                "[ok](there/NOTES.md#readings), ![plot](there/plot.png), "
                "[web](https://docs.sglang.ai/a.md), [here](#flags),\n"
                "[gone](../gone/NOTES.md) (not a link)"
            )
            self.assertEqual(dead_links(page), ["there/plot.png", "../gone/NOTES.md"])


if __name__ == "__main__":
    unittest.main()
