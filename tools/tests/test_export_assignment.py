"""Which exported commit brings in each new file (pure: no wheel, no git)."""

import sys
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from forklib import ForkError  # noqa: E402
from forklib.export import (  # noqa: E402
    assign_new_files,
    is_exported,
    module_name,
    strip_fork_files,
    without_links_to_unexported,
)

A = "python/sglang/srt/speculative/fork_a.py"
A_V2 = "python/sglang/srt/speculative/fork_a_v2.py"
B = "python/sglang/srt/speculative/fork_b.py"
UTIL = "python/sglang/test/fork_util.py"
TEST = "test/registered/unit/spec/test_fork.py"
DOC = "docs/advanced_features/fork.md"
BENCH = "benchmark/fork/bench.py"


def patch(*added: str, trailer: str = "") -> str:
    """A git format-patch text whose diff adds these lines to an upstream file."""
    message = "Subject: [PATCH] Edit upstream\n\nWhy.\n" + (
        f"\n{trailer}\n" if trailer else ""
    )
    edited = "python/sglang/srt/speculative/spec_info.py"
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        f"From: t <t@t>\n{message}---\n"
        f"diff --git a/{edited} b/{edited}\n--- a/{edited}\n+++ b/{edited}\n"
        f"@@ -1 +1,{1 + len(added)} @@\n context\n"
        + "".join(f"+{line}\n" for line in added)
    )


def files(**contents: str):
    return {rel: text.encode() for rel, text in contents.items()}


class TestAssignNewFiles(unittest.TestCase):
    def test_a_module_enters_with_the_first_patch_that_imports_it(self):
        uses_a = "from sglang.srt.speculative.fork_a import A"
        groups = assign_new_files(
            [patch("import os"), patch(uses_a), patch(uses_a)], files(**{A: "A = 1\n"})
        )
        self.assertEqual(groups, [[], [A], [], []])

    def test_from_package_import_names_the_module(self):
        added = (
            "from sglang.srt.speculative import (",
            "    eagle_utils,  # upstream's",
            "    fork_a,",
            ")",
        )
        groups = assign_new_files([patch(*added)], files(**{A: "A = 1\n"}))
        self.assertEqual(groups, [[A], []])

    def test_a_module_whose_name_prefixes_another_is_not_imported_by_it(self):
        groups = assign_new_files(
            [patch("from sglang.srt.speculative.fork_a_v2 import V2")],
            files(**{A: "A = 1\n", A_V2: "V2 = 2\n"}),
        )
        self.assertEqual(groups, [[A_V2], [A]])

    def test_modules_a_patch_imports_enter_with_it_transitively(self):
        groups = assign_new_files(
            [
                patch("from sglang.srt.speculative.fork_b import B"),
                patch("from sglang.srt.speculative.fork_a import A"),
            ],
            files(**{A: "A = 1\n", B: "from sglang.srt.speculative.fork_a import A\n"}),
        )
        self.assertEqual(groups, [[A, B], [], []])

    def test_a_module_imported_inside_a_function_enters_with_the_patch_that_imports_it(
        self,
    ):
        b = (
            "import os\n\n\ndef make(flag):\n"
            "    if flag == 'a':\n"
            "        from sglang.srt.speculative.fork_a import A\n\n"
            "        return A\n"
        )
        groups = assign_new_files(
            [
                patch("from sglang.srt.speculative.fork_b import make"),
                patch("from sglang.srt.speculative.fork_a import A"),
            ],
            files(**{A: "A = 1\n", B: b}),
        )
        self.assertEqual(groups, [[B], [A], []])

    def test_a_module_imported_only_inside_a_function_must_be_brought_by_a_patch(self):
        b = "def make():\n    from sglang.srt.speculative.fork_a import A\n"
        with self.assertRaisesRegex(ForkError, f"{B} imports {A} inside a function"):
            assign_new_files(
                [patch("from sglang.srt.speculative.fork_b import make")],
                files(**{A: "A = 1\n", B: b}),
            )

    def test_a_module_imported_inside_a_function_may_come_with_a_named_test(self):
        b = "def make():\n    from sglang.srt.speculative.fork_a import A\n"
        test = "from sglang.srt.speculative.fork_a import A\n"
        groups = assign_new_files(
            [
                patch("from sglang.srt.speculative.fork_b import make"),
                patch("import os", trailer=f"Fork-Files: {TEST}"),
            ],
            files(**{A: "A = 1\n", B: b, TEST: test}),
        )
        self.assertEqual(groups, [[B], [A, TEST], []])

    def test_a_test_takes_along_what_it_imports_inside_functions(self):
        test = (
            "from sglang.srt.speculative.fork_b import B\n\n\n"
            "def test_a():\n    from sglang.srt.speculative.fork_a import A\n"
        )
        groups = assign_new_files(
            [
                patch("from sglang.srt.speculative.fork_b import B"),
                patch("from sglang.srt.speculative.fork_a import A"),
            ],
            files(**{A: "A = 1\n", B: "B = 2\n", TEST: test}),
        )
        self.assertEqual(groups, [[B], [A, TEST], []])

    def test_a_test_enters_with_the_latest_module_it_imports_and_brings_its_utilities(
        self,
    ):
        test = (
            "from sglang.srt.speculative.fork_a import A\n"
            "from sglang.srt.speculative import fork_b\n"
            "from sglang.test.fork_util import helper\n"
        )
        groups = assign_new_files(
            [
                patch("from sglang.srt.speculative.fork_a import A"),
                patch("from sglang.srt.speculative.fork_b import B"),
                patch("import os"),
            ],
            files(
                **{A: "A = 1\n", B: "B = 2\n", UTIL: "def helper(): ...\n", TEST: test}
            ),
        )
        self.assertEqual(groups, [[A], [B, UTIL, TEST], [], []])

    def test_a_test_brings_the_test_data_it_names(self):
        data = "test/registered/unit/spec/traces/run.jsonl.gz"
        test = (
            "from sglang.srt.speculative.fork_a import A\n"
            'TRACE = os.path.join(HERE, "traces", "run.jsonl.gz")\n'
        )
        groups = assign_new_files(
            [patch("import os"), patch("from sglang.srt.speculative.fork_a import A")],
            {**files(**{A: "A = 1\n", TEST: test}), data: b"\x1f\x8b\xff"},
        )
        self.assertEqual(groups, [[], [A, TEST, data], []])

    def test_a_test_of_a_benchmark_follows_the_series_with_it(self):
        test = (
            "from sglang.srt.speculative.fork_a import A\n"
            'bench = load_benchmark_script("bench")\n'
        )
        groups = assign_new_files(
            [patch("from sglang.srt.speculative.fork_a import A")],
            files(**{A: "A = 1\n", TEST: test, BENCH: "import os\n"}),
        )
        self.assertEqual(groups, [[A], [BENCH, TEST]])

    def test_what_nothing_needs_and_imports_nothing_new_follows_the_series(self):
        groups = assign_new_files(
            [patch("from sglang.srt.speculative.fork_a import A")],
            files(
                **{
                    A: "A = 1\n",
                    UTIL: "import os\n",
                    DOC: "Uses `sglang.srt.speculative.fork_a`.\n",
                    BENCH: "from sglang.test.fork_util import os\n",
                }
            ),
        )
        self.assertEqual(groups, [[A], [BENCH, DOC, UTIL]])

    def test_a_benchmark_follows_the_series_whatever_it_imports(self):
        groups = assign_new_files(
            [patch("from sglang.srt.speculative.fork_a import A")],
            files(
                **{A: "A = 1\n", BENCH: "from sglang.srt.speculative import fork_a\n"}
            ),
        )
        self.assertEqual(groups, [[A], [BENCH]])

    def test_fork_files_trailer_names_files_entering_with_its_patch(self):
        groups = assign_new_files(
            [
                patch(
                    "Fork-Files: in-the-diff-is-no-trailer",
                    trailer=f"Fork-Files: {A} docs/*",
                ),
                patch("from sglang.srt.speculative.fork_a import A"),
            ],
            files(**{A: "A = 1\n", DOC: "A doc.\n", BENCH: "import os\n"}),
        )
        self.assertEqual(groups, [[DOC, A], [], [BENCH]])

    def test_a_utility_enters_with_the_first_test_needing_it_not_a_later_named_one(
        self,
    ):
        later = "test/registered/unit/spec/test_fork_later.py"
        uses = "from sglang.srt.speculative.fork_a import A\nfrom sglang.test.fork_util import h\n"
        groups = assign_new_files(
            [
                patch("from sglang.srt.speculative.fork_a import A"),
                patch("import os", trailer=f"Fork-Files: {later}"),
            ],
            files(**{A: "A = 1\n", UTIL: "def h(): ...\n", TEST: uses, later: uses}),
        )
        self.assertEqual(groups, [[A, UTIL, TEST], [later], []])

    def test_a_named_file_brings_what_it_needs_that_would_come_later(self):
        test = "from sglang.test.fork_util import h\n"
        groups = assign_new_files(
            [patch("import os", trailer=f"Fork-Files: {TEST}")],
            files(**{UTIL: "def h(): ...\n", TEST: test, DOC: "A doc.\n"}),
        )
        self.assertEqual(groups, [[UTIL, TEST], [DOC]])

    def test_a_fork_files_glob_that_matches_nothing_is_an_error(self):
        with self.assertRaisesRegex(ForkError, "docs/typo.md matches no new file"):
            assign_new_files(
                [patch("import os", trailer="Fork-Files: docs/typo.md")],
                files(**{DOC: "A doc.\n"}),
            )


class TestExportHelpers(unittest.TestCase):
    def test_strip_fork_files_keeps_the_rest_of_the_message(self):
        message = "Subject line\n\nWhy it matters.\n\nFork-Files: docs/*.md test/x.py\n"
        self.assertEqual(strip_fork_files(message), "Subject line\n\nWhy it matters.\n")

    def test_benchmark_results_are_not_exported(self):
        self.assertFalse(is_exported("benchmark/dynamic_spec/results/run/raw.json"))
        self.assertFalse(is_exported("benchmark/results/raw.json"))
        self.assertTrue(is_exported("benchmark/dynamic_spec/bench_sweep.py"))
        self.assertTrue(is_exported("benchmark/dynamic_spec/results"))
        self.assertTrue(is_exported("docs/results/page.md"))

    def test_the_tests_of_the_forks_readme_are_not_exported(self):
        self.assertFalse(is_exported("test/fork/test_readme_serve_args.py"))
        self.assertTrue(is_exported("test/registered/unit/spec/test_fork.py"))

    def test_docs_lose_their_links_into_benchmark_results(self):
        doc = "docs/advanced_features/page.md"
        results = "../../benchmark/dynamic_spec/results/run"
        markdown = (
            f"Faster at every C\n  ([results]({results}/NOTES.md)). See\n"
            f"[the NOTES]({results}/NOTES.md#c16), [the sweep](../../benchmark/x.py),\n"
            f"[flags](#flags) and [upstream](https://docs.sglang.ai/a.md).\n\n"
            f"![plot]({results}/throughput.png)\n"
        )
        self.assertEqual(
            without_links_to_unexported(markdown, doc),
            "Faster at every C. See\n"
            "the NOTES, [the sweep](../../benchmark/x.py),\n"
            "[flags](#flags) and [upstream](https://docs.sglang.ai/a.md).\n\n\n",
        )

    def test_module_name(self):
        self.assertEqual(module_name(A), "sglang.srt.speculative.fork_a")
        self.assertEqual(
            module_name("python/sglang/srt/pkg/__init__.py"), "sglang.srt.pkg"
        )
        self.assertIsNone(module_name("python/sglang/srt/pkg/config.json"))
        self.assertIsNone(module_name(TEST))


if __name__ == "__main__":
    unittest.main()
