"""CPU tests through real triton kernels, in triton's interpreter.

The interpreter runs kernels on CPU tensors, but it must be chosen before any
kernel is defined (``TRITON_INTERPRET=1`` at import time), so a test that wants
it runs its module again in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import unittest

IN_TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def run_in_triton_interpreter(
    test_case: unittest.TestCase, node_id: str, timeout_s: int = 600
) -> None:
    """Run the pytest ``node_id`` in a fresh process with triton's interpreter;
    fail ``test_case`` unless it ran and passed."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node_id],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    test_case.assertEqual(result.returncode, 0, result.stdout[-4000:])
    test_case.assertIn(" passed", result.stdout)
