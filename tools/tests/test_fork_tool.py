"""The fork tooling on a scratch copy of the repository (no GPU, pinned wheel cached)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from forklib.layout import Layout  # noqa: E402
from forklib.pin import load_pin  # noqa: E402
from forklib.wheel import extract_package, obtain_wheel  # noqa: E402

# The real series is left out: each test builds the series it needs.
FORK_FILES = [
    "tools",
    "upstream.toml",
    "python/pyproject.toml",
    "python/build_backend",
    ".gitignore",
]
EDITED = "python/sglang/srt/speculative/spec_info.py"
SECOND = "python/sglang/srt/speculative/spec_utils.py"
THIRD = "python/sglang/srt/speculative/eagle_info.py"


def git(cwd: Path, *args: str) -> str:
    """Run git with a fixed identity (commits in scratch repositories)."""
    identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
    return subprocess.run(
        ["git", *identity, *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


class ScratchFork:
    """A throwaway git checkout of the fork's tooling files, sharing the cached wheel."""

    def __init__(self, wheel: Path):
        self._tmp = tempfile.TemporaryDirectory(prefix="fork-test-")
        self.root = Path(self._tmp.name) / "fork"
        for rel in FORK_FILES:
            src, dst = REPO / rel, self.root / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(
                    src, dst, ignore=shutil.ignore_patterns("__pycache__", "tests")
                )
            elif src.exists():
                shutil.copy2(src, dst)
        (self.root / "patches").mkdir(exist_ok=True)
        git(self.root, "init", "-q")
        git(self.root, "add", "-A")
        git(self.root, "commit", "-qm", "fork")
        self.env = dict(os.environ, SGLANG_FORK_UPSTREAM_WHEEL=str(wheel))

    def fork(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, str(self.root / "tools" / "fork"), *args],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
        )
        if ok and result.returncode != 0:
            raise AssertionError(
                f"tools/fork {' '.join(args)} failed:\n{result.stdout}{result.stderr}"
            )
        return result

    def path(self, rel: str) -> Path:
        return self.root / rel

    def close(self) -> None:
        self._tmp.cleanup()


class TestForkTool(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        layout = Layout.find()
        cls.wheel = obtain_wheel(layout, load_pin(layout.pin_file))

    def setUp(self):
        self.repo = ScratchFork(self.wheel)
        self.addCleanup(self.repo.close)
        self.repo.fork("sync")

    def series_files(self):
        return sorted(self.repo.path("patches").glob("*.patch"))

    def edit(self, rel: str, line: str) -> None:
        with open(self.repo.path(rel), "a") as f:
            f.write(line)

    def test_materialized_tree_is_invisible_to_git_but_new_files_are_not(self):
        self.assertTrue(self.repo.path(EDITED).is_file())
        self.assertEqual(git(self.repo.root, "status", "--porcelain"), "")
        self.repo.path("python/sglang/srt/speculative/new_module.py").write_text(
            "X = 1\n"
        )
        self.assertEqual(
            git(
                self.repo.root, "status", "--porcelain", "--untracked-files=all"
            ).strip(),
            "?? python/sglang/srt/speculative/new_module.py",
        )

    def test_saved_edit_survives_materialization_from_scratch(self):
        self.edit(EDITED, "\n# fork edit one\n")
        self.assertIn("edited", self.repo.fork("status").stdout)
        before = {p.name for p in self.series_files()}
        self.repo.fork(
            "save", "--new", "Add a marker", "--body", "Because a test needs it."
        )
        (added,) = [p for p in self.series_files() if p.name not in before]
        self.assertTrue(added.name.endswith("-Add-a-marker.patch"))
        self.edit(EDITED, "# fork edit two\n")
        self.repo.fork("save", "--amend", added.name[:4])
        self.assertEqual(len(self.series_files()), len(before) + 1)

        shutil.rmtree(self.repo.path("python/sglang"))
        shutil.rmtree(self.repo.path("python/.fork"))
        self.repo.fork("sync")
        text = self.repo.path(EDITED).read_text()
        self.assertTrue(text.endswith("\n# fork edit one\n# fork edit two\n"))
        self.assertIn(
            f"ok: {len(before) + 1} patches apply cleanly",
            self.repo.fork("check").stdout,
        )

    def test_sync_refuses_to_discard_unsaved_edits(self):
        self.edit(EDITED, "# unsaved\n")
        result = self.repo.fork("sync", ok=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn(EDITED, result.stderr)
        self.assertIn("unsaved edits", result.stderr)
        self.repo.fork("sync", "--force")
        self.assertNotIn("# unsaved", self.repo.path(EDITED).read_text())

    def test_check_fails_on_unsaved_edit_and_on_a_stale_patch(self):
        self.edit(EDITED, "# unsaved\n")
        self.assertEqual(self.repo.fork("check", ok=False).returncode, 1)
        self.repo.fork("sync", "--force")
        stale = self.repo.path("patches/0001-Stale.patch")
        stale.write_text(
            "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            "From: t <t@t>\nSubject: [PATCH] Stale\n\nA patch whose context is gone.\n---\n"
            f"diff --git a/{EDITED} b/{EDITED}\n--- a/{EDITED}\n+++ b/{EDITED}\n"
            "@@ -1,2 +1,2 @@\n-this line is not upstream\n+replacement\n context\n"
        )
        result = self.repo.fork("check", ok=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn("0001-Stale.patch", result.stdout)
        self.assertIn("patch failed", result.stdout)

    def test_check_on_a_fresh_clone_says_it_is_not_materialized(self):
        clone = ScratchFork(self.wheel)
        self.addCleanup(clone.close)
        result = clone.fork("check", ok=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn("not materialized", result.stdout)
        self.assertIn('pip install -e "python[fork-test]"', result.stdout)
        self.assertIn("tools/fork sync", result.stdout)
        self.assertNotIn("differ", result.stdout)

    def test_rebase_onto_the_pinned_release_replays_every_patch_unchanged(self):
        # Fetches the pinned wheels for every Python tag, as a real rebase does: from
        # the repository's download cache where its install filled it, else PyPI.
        del self.repo.env["SGLANG_FORK_UPSTREAM_WHEEL"]
        if (REPO / "python/.fork/wheels").is_dir():
            shutil.copytree(
                REPO / "python/.fork/wheels",
                self.repo.path("python/.fork/wheels"),
                dirs_exist_ok=True,
            )
        patches_before = {p.name: p.read_bytes() for p in self.series_files()}
        pin_before = self.repo.path("upstream.toml").read_bytes()
        result = self.repo.fork("rebase", load_pin(REPO / "upstream.toml").version)
        self.assertEqual(result.stdout.count("clean "), len(patches_before))
        self.assertEqual(
            {p.name: p.read_bytes() for p in self.series_files()}, patches_before
        )
        self.assertEqual(self.repo.path("upstream.toml").read_bytes(), pin_before)

    def replace_lines(self, rel: str, marks: dict) -> None:
        """Append a marker to some lines of a materialized file (line number -> marker)."""
        lines = self.repo.path(rel).read_text().splitlines(keepends=True)
        for number, mark in marks.items():
            lines[number] = lines[number].rstrip("\n") + f"  # {mark}\n"
        self.repo.path(rel).write_text("".join(lines))

    def fixture_wheel(self, version: str, files: dict) -> Path:
        """A wheel of VERSION holding these upstream files (repo path -> text)."""
        wheel = self.repo.root.parent / self.wheel.name.replace(
            load_pin(REPO / "upstream.toml").version, version
        )
        with zipfile.ZipFile(wheel, "w") as archive:
            for rel, text in files.items():
                archive.writestr(rel.removeprefix("python/"), text)
        return wheel

    def test_rebase_dry_run_reports_each_patch_and_changes_nothing(self):
        pristine = {
            rel: self.repo.path(rel).read_text() for rel in (EDITED, SECOND, THIRD)
        }
        self.replace_lines(EDITED, {20: "fork"})
        self.repo.fork("save", "--new", "Clean", "--body", "Upstream moved it.")
        self.replace_lines(SECOND, {40: "fork"})
        self.repo.fork(
            "save", "--new", "Merged", "--body", "Upstream edited its context."
        )
        self.replace_lines(THIRD, {30: "fork", 200: "fork"})
        self.repo.fork(
            "save", "--new", "Conflict", "--body", "Upstream edited its lines."
        )
        for rel, text in pristine.items():
            self.repo.path(rel).write_text(text)
        self.replace_lines(SECOND, {42: "upstream"})
        self.replace_lines(THIRD, {30: "upstream", 200: "upstream"})
        new_files = {
            rel: ("# upstream moved everything down\n" if rel == EDITED else "")
            + self.repo.path(rel).read_text()
            for rel in pristine
        }
        wheel = self.fixture_wheel("0.5.99", new_files)
        self.repo.fork("sync", "--force")
        patches_before = {p.name: p.read_bytes() for p in self.series_files()}
        pin_before = self.repo.path("upstream.toml").read_bytes()
        tree_before = {rel: self.repo.path(rel).read_bytes() for rel in pristine}

        result = self.repo.fork("rebase", "0.5.99", "--dry-run", "--wheel", str(wheel))
        self.assertIn("clean    0001-Clean.patch", result.stdout)
        self.assertIn("merged   0002-Merged.patch", result.stdout)
        self.assertIn(f"CONFLICT 0003-Conflict.patch: {THIRD} (2 hunks)", result.stdout)
        self.assertIn(
            "1 of 3 patches conflict with 0.5.99; nothing changed", result.stdout
        )
        self.assertEqual(
            {p.name: p.read_bytes() for p in self.series_files()}, patches_before
        )
        self.assertEqual(self.repo.path("upstream.toml").read_bytes(), pin_before)
        self.assertEqual(
            {rel: self.repo.path(rel).read_bytes() for rel in pristine}, tree_before
        )
        self.assertIn("ok: 3 patches apply cleanly", self.repo.fork("check").stdout)

    def test_rebase_wheel_is_refused_without_dry_run_or_for_another_version(self):
        wheel = self.fixture_wheel("0.5.99", {EDITED: "X = 1\n"})
        result = self.repo.fork("rebase", "0.5.99", "--wheel", str(wheel), ok=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn("--wheel goes with --dry-run", result.stderr)
        result = self.repo.fork(
            "rebase", "0.6.0", "--dry-run", "--wheel", str(wheel), ok=False
        )
        self.assertEqual(result.returncode, 1)
        self.assertIn("is not a sglang 0.6.0 wheel", result.stderr)

    def test_tampered_wheel_is_refused(self):
        tampered = Path(self.repo.root.parent) / self.wheel.name
        tampered.write_bytes(self.wheel.read_bytes() + b"\0")
        self.repo.env["SGLANG_FORK_UPSTREAM_WHEEL"] = str(tampered)
        result = self.repo.fork("sync", ok=False)
        self.assertIn("sha256 mismatch", result.stderr)

    def test_export_brings_each_new_file_with_the_patch_that_needs_it(self):
        spec = "python/sglang/srt/speculative"
        new_files = {
            f"{spec}/fork_only.py": "FORK_ONLY = True\n",
            f"{spec}/fork_later.py": "LATER = True\n",
            "test/registered/unit/spec/test_fork_only.py": (
                "from sglang.srt.speculative.fork_only import FORK_ONLY\n"
            ),
            "test/registered/unit/spec/test_by_trailer.py": "import os\n",
            "docs/fork.md": "How to use `sglang.srt.speculative.fork_only`.\n",
            "benchmark/dynamic_spec/bench.py": "import os\n",
        }
        results = "benchmark/dynamic_spec/results/run/raw.json"
        for rel, text in {**new_files, results: "{}\n"}.items():
            self.repo.path(rel).parent.mkdir(parents=True, exist_ok=True)
            self.repo.path(rel).write_text(text)
        git(self.repo.root, "add", *new_files, results)
        self.edit(EDITED, "from sglang.srt.speculative.fork_only import FORK_ONLY\n")
        self.repo.fork(
            "save", "--new", "Use the fork-only module", "--body", "To test export."
        )
        self.edit(SECOND, "from sglang.srt.speculative.fork_later import LATER\n")
        self.repo.fork(
            "save",
            "--new",
            "Use the later module",
            "--body",
            "To test export.\n\n"
            "Fork-Files: test/registered/unit/spec/test_by_trailer.py",
        )
        out = self.repo.root.parent / "export"
        self.repo.fork("export", str(out))

        exported = sorted(out.glob("*.patch"))
        self.assertEqual(
            [
                set(re.findall(r"^diff --git a/(\S+) ", p.read_text(), re.M))
                for p in exported
            ],
            [
                {
                    EDITED,
                    f"{spec}/fork_only.py",
                    "test/registered/unit/spec/test_fork_only.py",
                },
                {
                    SECOND,
                    f"{spec}/fork_later.py",
                    "test/registered/unit/spec/test_by_trailer.py",
                },
                {"benchmark/dynamic_spec/bench.py", "docs/fork.md"},
            ],
        )
        self.assertIn(
            "Subject: [PATCH] Use the later module\n\nTo test export.\n---\n",
            exported[1].read_text(),
        )
        self.assertNotIn("Fork-Files", "".join(p.read_text() for p in exported))

        upstream = self.repo.root.parent / "upstream"
        extract_package(self.wheel, upstream / "python")
        (upstream / "python" / ".complete").unlink()
        git(upstream, "init", "-q")
        git(upstream, "add", "-A")
        git(upstream, "commit", "-qm", "upstream")
        git(upstream, "am", *map(str, exported))
        self.assertEqual(len(git(upstream, "log", "--oneline").splitlines()), 4)
        for rel, text in new_files.items():
            self.assertEqual((upstream / rel).read_text(), text)
        self.assertFalse((upstream / results).exists())
        for rel in (EDITED, SECOND):
            self.assertEqual(
                (upstream / rel).read_text(), self.repo.path(rel).read_text()
            )

    def test_export_runs_each_commits_tests_on_the_tree_at_that_commit(self):
        def test_reading(rel: str, line: str) -> str:
            return (
                "from pathlib import Path\n\n\ndef test_line():\n"
                f"    assert {line!r} in Path({rel!r}).read_text()\n"
            )

        tests = "test/registered/unit/spec"
        first, too_early = f"{tests}/test_first.py", f"{tests}/test_too_early.py"
        self.repo.path(tests).mkdir(parents=True)
        self.repo.path(first).write_text(test_reading(EDITED, "FIRST = 1"))
        self.repo.path(too_early).write_text(test_reading(SECOND, "SECOND = 2"))
        git(self.repo.root, "add", first, too_early)
        self.edit(EDITED, "FIRST = 1\n")
        self.repo.fork(
            "save", "--new", "First", "--body", f"Why.\n\nFork-Files: {first}"
        )
        self.edit(SECOND, "SECOND = 2\n")
        self.repo.fork(
            "save", "--new", "Second", "--body", f"Why.\n\nFork-Files: {too_early}"
        )
        out = self.repo.root.parent / "export"
        result = self.repo.fork("export", str(out), "--test-each")
        self.assertIn("ok: every commit's tests pass", result.stdout)
        self.assertIn("commit 2: 1 test files: 1 passed", result.stdout)

        patch = self.series_files()[0]
        patch.write_text(patch.read_text().replace(first, f"{first} {too_early}"))
        result = self.repo.fork("export", str(out), "--test-each", ok=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn("commit 1: 2 test files: 1 failed, 1 passed", result.stdout)
        self.assertIn("FAIL: the tests of commits [1] fail", result.stdout)


if __name__ == "__main__":
    unittest.main()
