"""The materialized tree: pristine upstream + the series, written under python/sglang."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from forklib import ForkError
from forklib.layout import Layout
from forklib.pin import Pin, load_pin
from forklib.series import (
    Patch,
    ScratchRepo,
    apply_series,
    load_series,
    series_digest,
    touched_files,
)
from forklib.wheel import pristine_package

EXCLUDE_BEGIN = "# >>> sglang-fork: materialized upstream files (tools/fork) >>>"
EXCLUDE_END = "# <<< sglang-fork <<<"


def _sha(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


@dataclasses.dataclass
class Upstream:
    """Pristine upstream and what the series makes of it; paths are repo-relative."""

    layout: Layout
    pin: Pin
    pristine_dir: Path  # .../sglang
    series: List[Patch]

    @classmethod
    def load(cls, layout: Layout) -> "Upstream":
        pin = load_pin(layout.pin_file)
        return cls(
            layout, pin, pristine_package(layout, pin), load_series(layout.patches_dir)
        )

    def pristine_files(self) -> List[str]:
        base = self.pristine_dir.parent
        return sorted(
            self.layout.repo_path(p.relative_to(base).as_posix())
            for p in self.pristine_dir.rglob("*")
            if p.is_file()
        )

    def pristine_content(self, rel: str) -> Optional[bytes]:
        path = self.pristine_dir.parent / rel.removeprefix("python/")
        return path.read_bytes() if path.is_file() else None

    def patched(
        self, series: Optional[List[Patch]] = None
    ) -> Dict[str, Optional[bytes]]:
        """Post-series content of the files the series touches."""
        series = self.series if series is None else series
        touched = touched_files(series)
        return apply_series(self.pristine_subset(touched), series)

    def pristine_subset(self, rels) -> Dict[str, Optional[bytes]]:
        return {rel: self.pristine_content(rel) for rel in rels}

    def is_executable(self, rel: str) -> bool:
        path = self.pristine_dir.parent / rel.removeprefix("python/")
        return path.is_file() and os.access(path, os.X_OK)

    def scratch_repo(self, rels) -> ScratchRepo:
        """A scratch repository holding these pristine files, modes included."""
        rels = sorted(rels)
        executable = [rel for rel in rels if self.is_executable(rel)]
        return ScratchRepo(self.pristine_subset(rels), self.pin.version, executable)

    def expected_files(self) -> Dict[str, Optional[bytes]]:
        """Every upstream path -> the content the working tree should hold."""
        patched = self.patched()
        expected: Dict[str, Optional[bytes]] = {}
        for rel in self.pristine_files():
            expected[rel] = (
                patched[rel] if rel in patched else self.pristine_content(rel)
            )
        for rel, content in patched.items():
            expected.setdefault(rel, content)
        return expected

    def stamp(self) -> Dict[str, str]:
        return {
            "pristine": str(self.pristine_dir),
            "series": series_digest(self.series),
        }


@dataclasses.dataclass
class State:
    """What the last materialization wrote (path -> sha256), to spot unsaved edits."""

    stamp: Dict[str, str]
    files: Dict[str, str]

    @staticmethod
    def path(layout: Layout) -> Path:
        return layout.state_dir / "state.json"

    @classmethod
    def load(cls, layout: Layout) -> Optional["State"]:
        path = cls.path(layout)
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(stamp=data["stamp"], files=data["files"])

    def save(self, layout: Layout) -> None:
        self.path(layout).parent.mkdir(parents=True, exist_ok=True)
        self.path(layout).write_text(
            json.dumps({"stamp": self.stamp, "files": self.files})
        )


def read_working(layout: Layout, rel: str) -> Optional[bytes]:
    path = layout.root / rel
    return path.read_bytes() if path.is_file() else None


def edited_files(layout: Layout, state: State) -> List[str]:
    """Upstream files whose working content differs from what was materialized."""
    edited = []
    for rel, sha in state.files.items():
        content = read_working(layout, rel)
        if content is None or _sha(content) != sha:
            edited.append(rel)
    return edited


def _git_output(layout: Layout, *args: str) -> Optional[str]:
    """Output of a git command in the fork's checkout; None without git or a checkout."""
    try:
        result = subprocess.run(
            ["git", *args], cwd=layout.root, capture_output=True, text=True
        )
    except FileNotFoundError:
        return None
    return result.stdout if result.returncode == 0 else None


def tracked_files(layout: Layout, *pathspecs: str) -> Optional[List[str]]:
    """Files git tracks under the pathspecs, or None outside a git checkout."""
    listed = _git_output(layout, "ls-files", "-z", "--", *pathspecs)
    return None if listed is None else [p for p in listed.split("\0") if p]


def check_no_shadowing(layout: Layout, upstream_paths: List[str]) -> None:
    tracked = tracked_files(layout, "python/sglang") or []
    shadowed = sorted(set(tracked) & set(upstream_paths))
    if shadowed:
        raise ForkError(
            "these tracked files are upstream files (the repo must not vendor upstream; "
            "edit them through the patch series instead):\n  " + "\n  ".join(shadowed)
        )


def write_git_exclude(layout: Layout, upstream_paths: List[str]) -> None:
    """List materialized files in .git/info/exclude so git status shows our work only."""
    git_path = _git_output(layout, "rev-parse", "--git-path", "info/exclude")
    if git_path is None:
        return
    exclude = layout.root / git_path.strip()
    kept = []
    if exclude.is_file():
        inside = False
        for line in exclude.read_text().splitlines():
            if line == EXCLUDE_BEGIN:
                inside = True
            elif line == EXCLUDE_END:
                inside = False
            elif not inside:
                kept.append(line)
    escaped = [
        "/" + "".join("\\" + c if c in "[]*?!#\\ " else c for c in p)
        for p in upstream_paths
    ]
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("\n".join(kept + [EXCLUDE_BEGIN, *escaped, EXCLUDE_END]) + "\n")


def materialize(layout: Layout, force: bool = False, sync: bool = False) -> str:
    """Write pristine upstream + series under python/sglang. Idempotent.

    Without ``force``, refuses to overwrite upstream files edited since the last
    materialization (save them into the series first). ``sync`` re-materializes
    even when nothing changed, which also restores deleted files.
    """
    upstream = Upstream.load(layout)
    state = State.load(layout)
    edited = edited_files(layout, state) if state else []
    if state and state.stamp == upstream.stamp() and not sync:
        return "up to date" + (
            f" ({len(edited)} upstream files edited)" if edited else ""
        )
    if edited and not force:
        raise ForkError(
            "working tree has unsaved edits to upstream files (`tools/fork save` them, "
            "or pass --force to discard):\n  " + "\n  ".join(edited)
        )
    expected = upstream.expected_files()
    check_no_shadowing(layout, list(expected))
    for rel in (state.files if state else {}):
        if rel not in expected:
            (layout.root / rel).unlink(missing_ok=True)
    written: Dict[str, str] = {}
    for rel, content in expected.items():
        target = layout.root / rel
        if content is None:
            target.unlink(missing_ok=True)
            continue
        if not target.is_file() or target.read_bytes() != content:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            if upstream.is_executable(rel):
                target.chmod(0o755)
        written[rel] = _sha(content)
    State(stamp=upstream.stamp(), files=written).save(layout)
    write_git_exclude(layout, sorted(written))
    return (
        f"materialized {upstream.pin.package} {upstream.pin.version}: {len(written)} files, "
        f"{len(upstream.series)} patches"
    )


def clean(layout: Layout) -> None:
    """Remove everything materialization wrote (used before a re-materialization from scratch)."""
    state = State.load(layout)
    for rel in (state.files if state else {}):
        (layout.root / rel).unlink(missing_ok=True)
    State.path(layout).unlink(missing_ok=True)
    shutil.rmtree(layout.state_dir / "pristine", ignore_errors=True)
