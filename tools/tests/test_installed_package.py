"""The installed fork imports and its server CLI runs on a machine without a GPU."""

import subprocess
import sys
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, cwd="/"
    )


class TestInstalledPackage(unittest.TestCase):
    def test_server_args_import_from_the_materialized_tree(self):
        result = run_python(
            "-c", "import sglang, sglang.srt.server_args as sa; print(sa.__file__)"
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(
            Path(result.stdout.strip()), REPO / "python/sglang/srt/server_args.py"
        )

    def test_launch_server_help(self):
        result = run_python("-m", "sglang.launch_server", "--help")
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("--speculative-algorithm", result.stdout)
        for flag in (
            "--speculative-disable-batch-threshold",
            "--speculative-enable-batch-threshold",
        ):
            self.assertIn(flag, result.stdout)


if __name__ == "__main__":
    unittest.main()
