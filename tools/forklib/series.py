"""The patch series: ordered git format-patch files that edit upstream files."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from forklib import ForkError

_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_SUBJECT = re.compile(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*)$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Patch:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def text(self) -> str:
        return self.path.read_text()

    @property
    def subject(self) -> str:
        match = _SUBJECT.search(self.text)
        return match.group(1).strip() if match else ""

    @property
    def body(self) -> str:
        """The commit message after the subject, up to the diffstat."""
        header, _, rest = self.text.partition("\n\n")
        return rest.split("\n---\n", 1)[0].strip()

    @property
    def files(self) -> List[str]:
        return sorted({b for _, b in _DIFF_HEADER.findall(self.text)})


def load_series(patches_dir: Path) -> List[Patch]:
    return [Patch(p) for p in sorted(patches_dir.glob("*.patch"))]


def series_digest(series: Sequence[Patch]) -> str:
    digest = hashlib.sha256()
    for patch in series:
        digest.update(patch.name.encode() + b"\0" + patch.path.read_bytes())
    return digest.hexdigest()


def touched_files(series: Iterable[Patch]) -> List[str]:
    return sorted({f for patch in series for f in patch.files})


def _isolated_git_env(workdir: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["GIT_CEILING_DIRECTORIES"] = str(workdir.parent)
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(var, None)
    return env


def run_git(
    args: Sequence[str], cwd: Path, check: bool = True
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["git", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=_isolated_git_env(cwd),
    )
    if check and result.returncode != 0:
        raise ForkError(
            f"git {' '.join(args)} failed in {cwd}:\n{result.stderr.strip()}"
        )
    return result


def describe_apply_failure(patch: Patch, stderr: str) -> str:
    """Name the hunk that no longer applies, from git apply's messages."""
    lines = [l for l in stderr.splitlines() if l.startswith("error:")]
    return f"patch {patch.name} ({patch.subject}) does not apply:\n  " + "\n  ".join(
        lines or stderr.splitlines()
    )


def write_files(root: Path, files: Dict[str, Optional[bytes]]) -> None:
    """Write these files (path relative to root -> bytes) under root; None deletes."""
    for rel, content in files.items():
        target = root / rel
        if content is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)


def apply_in(directory: Path, series: Sequence[Patch]) -> None:
    """Apply the series to the files of this directory, in place."""
    for patch in series:
        result = run_git(
            ["apply", "--verbose", str(patch.path.resolve())], directory, check=False
        )
        if result.returncode != 0:
            raise ForkError(describe_apply_failure(patch, result.stderr))


def apply_series(
    repo_files: Dict[str, Optional[bytes]], series: Sequence[Patch]
) -> Dict[str, Optional[bytes]]:
    """Apply the series to in-memory files (repo-relative path -> bytes, None if absent).

    Returns the post-series content of every file the series touches (None when deleted).
    """
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        write_files(work, repo_files)
        apply_in(work, series)
        return {
            rel: (work / rel).read_bytes() if (work / rel).is_file() else None
            for rel in touched_files(series)
        }


class ScratchRepo:
    """A throwaway git repository holding pristine upstream files, to replay the series as commits.

    Only the files the operation touches are needed: patches and commits carry diffs.
    """

    def __init__(
        self,
        base_files: Dict[str, Optional[bytes]],
        version: str,
        executable: Iterable[str] = (),
    ):
        self._tmp = tempfile.TemporaryDirectory(prefix="fork-scratch-")
        self.path = Path(self._tmp.name) / "upstream"
        self.path.mkdir()
        self.git("init", "-q")
        self.git("config", "user.name", "sglang-fork")
        self.git("config", "user.email", "fork@localhost")
        self.write_files(base_files)
        for rel in executable:
            (self.path / rel).chmod(0o755)
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", f"Upstream SGLang {version}")
        self.base = self.head()

    def close(self) -> None:
        self._tmp.cleanup()

    def __enter__(self) -> "ScratchRepo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def git(self, *args: str, check: bool = True) -> str:
        return run_git(args, self.path, check=check).stdout

    def head(self) -> str:
        return self.git("rev-parse", "HEAD").strip()

    def am(self, patches: Sequence[Patch], three_way: bool = False) -> List[str]:
        """Apply patches as commits; returns their commit ids in order."""
        commits = []
        for patch in patches:
            args = ["am", "-q", "--keep-cr"] + (["-3"] if three_way else [])
            result = run_git([*args, str(patch.path.resolve())], self.path, check=False)
            if result.returncode != 0:
                self.git("am", "--abort", check=False)
                raise ForkError(
                    describe_apply_failure(patch, result.stdout + result.stderr)
                )
            commits.append(self.head())
        return commits

    def write_files(self, files: Dict[str, Optional[bytes]]) -> None:
        write_files(self.path, files)

    def commit_all(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.head()

    def amend_all(self, message: str) -> str:
        """Fold every change into HEAD, with this message."""
        self.git("add", "-A")
        self.git("commit", "-q", "--amend", "--allow-empty", "-m", message)
        return self.head()

    def head_message(self) -> str:
        return self.git("log", "-1", "--format=%B")

    def format_patches(
        self, since: str, out_dir: Path, start_number: int = 1
    ) -> List[Path]:
        out = self.git(
            "format-patch",
            "--no-signature",
            "--zero-commit",
            "-N",
            f"--start-number={start_number}",
            "-o",
            str(out_dir),
            f"{since}..HEAD",
        )
        return [Path(line) for line in out.split()]
