"""Guard: the repository holds our own work only, never upstream's files."""

import collections
import subprocess
import sys
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from forklib.layout import Layout  # noqa: E402
from forklib.pin import load_pin  # noqa: E402
from forklib.wheel import pristine_package  # noqa: E402

# A tracked file sharing more than this share of its distinct lines with one upstream
# file is a near copy.
NEAR_COPY_SHARE = 0.5
MIN_LINES = 8


def distinct_lines(data: bytes) -> set:
    lines = (line.strip() for line in data.decode(errors="replace").splitlines())
    return {
        line
        for line in lines
        if len(line) > 15 and not line.startswith(("#", "import ", "from "))
    }


class TestNoVendoring(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        layout = Layout.find()
        pristine = pristine_package(layout, load_pin(layout.pin_file))
        cls.upstream = {
            p.relative_to(pristine.parent).as_posix(): p.read_bytes()
            for p in pristine.rglob("*")
            if p.is_file()
        }
        cls.line_index = collections.defaultdict(set)
        for rel, data in cls.upstream.items():
            for line in distinct_lines(data):
                cls.line_index[line].add(rel)
        listed = subprocess.run(
            ["git", "ls-files", "python/sglang"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        cls.ours = {rel: (REPO / rel).read_bytes() for rel in listed.stdout.split()}

    def test_no_tracked_file_is_an_upstream_file(self):
        upstream_contents = set(self.upstream.values())
        for rel, data in self.ours.items():
            self.assertNotIn(
                rel.removeprefix("python/"),
                self.upstream,
                f"{rel} shadows an upstream path",
            )
            self.assertNotIn(
                data, upstream_contents, f"{rel} is byte-identical to an upstream file"
            )

    def test_no_tracked_file_is_a_near_copy(self):
        for rel, data in self.ours.items():
            lines = distinct_lines(data)
            if len(lines) < MIN_LINES:
                continue
            shared = collections.Counter(
                f for line in lines for f in self.line_index.get(line, ())
            )
            if shared:
                source, count = shared.most_common(1)[0]
                self.assertLess(
                    count / len(lines),
                    NEAR_COPY_SHARE,
                    f"{rel} is a near copy of upstream {source}",
                )

    def test_guard_detects_a_copy(self):
        rel, data = next(
            (r, d)
            for r, d in sorted(self.upstream.items())
            if r.endswith(".py") and len(distinct_lines(d)) > 50
        )
        lines = distinct_lines(data)
        shared = collections.Counter(f for line in lines for f in self.line_index[line])
        self.assertGreaterEqual(shared[rel] / len(lines), NEAR_COPY_SHARE)


if __name__ == "__main__":
    unittest.main()
