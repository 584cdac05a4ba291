"""The README's serve section, as argvs: the fork's own docs, so its tests stay in
the fork (tools/fork export leaves test/fork/ out)."""

import os
import shlex
from typing import List

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README_SERVE_SECTION = "Serve with load-aware speculative decoding"
README_OUT_DIR = "/tmp/synth"


def markdown_commands(markdown_path: str, section: str) -> List[List[str]]:
    """The shell commands of the first bash block under ``## section`` of a markdown
    file, each as an argv (backslash continuations joined)."""
    with open(markdown_path) as f:
        text = f.read()
    body = text.split(f"## {section}\n", 1)[1]
    block = body.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines()]


def readme_serve_commands() -> List[List[str]]:
    """(the synthetic pair's generate command, the serve command) of the README."""
    return markdown_commands(os.path.join(REPO_ROOT, "README.md"), README_SERVE_SECTION)
