"""The subcommands of ``tools/fork``; each returns a process exit code."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path, PurePosixPath
from typing import Dict, List, Optional, Tuple

from forklib import ForkError
from forklib.export import (
    assign_new_files,
    is_exported,
    strip_fork_files,
    without_links_to_unexported,
)
from forklib.layout import UPSTREAM_PACKAGE, Layout
from forklib.pin import Pin, PinnedWheel, write_pin
from forklib.series import (
    Patch,
    ScratchRepo,
    apply_in,
    run_git,
    touched_files,
    write_files,
)
from forklib.tree import (
    State,
    Upstream,
    check_no_shadowing,
    edited_files,
    materialize,
    read_working,
    tracked_files,
)
from forklib.wheel import extract_package, pip_download, sha256_of

EXPORTED_TREES = ("python/sglang", "test", "benchmark", "docs")
TRAILING_FILES_MESSAGE = """Add the docs, benchmarks and tests that no patch needs

New files at their upstream paths that no commit before this one imports:
documentation, benchmark scripts and their tests (with the step traces they
replay), and the tests and test utilities of the series as a whole.
"""


NOT_MATERIALIZED = (
    "upstream SGLang is not materialized in this checkout yet: "
    'run `pip install -e "python[fork-test]"` or `tools/fork sync`'
)


def _materialized_state(layout: Layout, upstream: Upstream) -> State:
    state = State.load(layout)
    if state is None:
        raise ForkError(NOT_MATERIALIZED)
    if state.stamp != upstream.stamp():
        raise ForkError(
            "materialization is stale (pin or series changed): run `tools/fork sync`"
        )
    return state


def _line_delta(old: Optional[bytes], new: Optional[bytes]) -> str:
    old_lines = (old or b"").decode(errors="replace").splitlines()
    new_lines = (new or b"").decode(errors="replace").splitlines()
    diff = list(difflib.unified_diff(old_lines, new_lines, lineterm="", n=0))
    added = sum(1 for l in diff if l.startswith("+") and not l.startswith("+++"))
    removed = sum(1 for l in diff if l.startswith("-") and not l.startswith("---"))
    return f"+{added} -{removed}"


def cmd_sync(layout: Layout, force: bool) -> int:
    print(materialize(layout, force=force, sync=True))
    return 0


def cmd_status(layout: Layout) -> int:
    upstream = Upstream.load(layout)
    state = _materialized_state(layout, upstream)
    print(
        f"upstream {upstream.pin.package} {upstream.pin.version}, {len(upstream.series)} patches"
    )
    patched = upstream.patched()
    for rel in sorted(patched):
        names = ", ".join(p.name for p in upstream.series if rel in p.files)
        delta = _line_delta(upstream.pristine_content(rel), patched[rel])
        print(f"  patched  {rel} ({delta}; {names})")
    edited = edited_files(layout, state)
    expected = {rel: patched.get(rel, upstream.pristine_content(rel)) for rel in edited}
    for rel in edited:
        working = read_working(layout, rel)
        kind = "deleted" if working is None else "edited "
        print(
            f"  {kind}  {rel} ({_line_delta(expected[rel], working)}; "
            "not in the series: `tools/fork save`)"
        )
    ours = [
        f for f in tracked_files(layout, "python/sglang") or [] if f not in state.files
    ]
    print(f"  {len(ours)} files of the fork's own under python/sglang")
    return 0


def _find_patch(series: List[Patch], name: str) -> int:
    matches = [
        i for i, p in enumerate(series) if p.name == name or p.name.startswith(name)
    ]
    if len(matches) != 1:
        raise ForkError(
            f"{name!r} names {len(matches)} patches of the series; give a unique prefix"
        )
    return matches[0]


def cmd_save(
    layout: Layout, subject: Optional[str], body: Optional[str], amend: Optional[str]
) -> int:
    upstream = Upstream.load(layout)
    state = _materialized_state(layout, upstream)
    edited = edited_files(layout, state)
    if not edited:
        raise ForkError("no edits to upstream files to save")
    working = {rel: read_working(layout, rel) for rel in edited}
    series = upstream.series
    with upstream.scratch_repo(set(touched_files(series)) | set(edited)) as repo:
        commits = repo.am(series)
        if amend is None:
            if not subject or not body:
                raise ForkError(
                    "a new patch needs --new SUBJECT and --body saying what and why"
                )
            repo.write_files(working)
            repo.commit_all(f"{subject}\n\n{body.strip()}\n")
            written = repo.format_patches(
                commits[-1] if commits else repo.base,
                layout.patches_dir,
                len(series) + 1,
            )
        else:
            written = _amend(repo, series, commits, _find_patch(series, amend), working)
    print(
        "\n".join(
            f"wrote {p.relative_to(layout.root) if p.is_relative_to(layout.root) else p}"
            for p in written
        )
    )
    print(materialize(layout, force=True))
    return 0


def _amend(
    repo: ScratchRepo,
    series: List[Patch],
    commits: List[str],
    k: int,
    working: Dict[str, Optional[bytes]],
) -> List[Path]:
    """Fold the working edits into patch k and replay the later patches on top."""
    repo.write_files(working)
    delta = repo.git("diff", "--binary")
    repo.git("checkout", "-q", "--", ".")
    repo.git("checkout", "-q", commits[k])
    with tempfile.NamedTemporaryFile("w", suffix=".diff", delete=False) as f:
        f.write(delta)
    result = run_git(["apply", "-3", f.name], repo.path, check=False)
    Path(f.name).unlink()
    if result.returncode != 0:
        raise ForkError(
            f"the edits do not apply on top of {series[k].name}:\n{result.stderr.strip()}"
        )
    repo.git("commit", "-q", "-a", "--amend", "--no-edit")
    for later, commit in zip(series[k + 1 :], commits[k + 1 :]):
        if run_git(["cherry-pick", commit], repo.path, check=False).returncode != 0:
            raise ForkError(
                f"{later.name} no longer applies after amending {series[k].name}"
            )
    with tempfile.TemporaryDirectory() as out:
        fresh = repo.format_patches(f"HEAD~{len(series) - k}", Path(out), k + 1)
        for old, new in zip(series[k:], fresh):
            old.path.write_text(new.read_text())
    return [p.path for p in series[k:]]


def cmd_check(layout: Layout) -> int:
    if State.load(layout) is None:
        print(f"FAIL: {NOT_MATERIALIZED}")
        return 1
    problems: List[str] = []
    upstream = Upstream.load(layout)
    try:
        expected = upstream.expected_files()
    except ForkError as e:
        print(f"FAIL: {e}")
        return 1
    for patch in upstream.series:
        if not patch.body:
            problems.append(
                f"{patch.name}: the commit message needs a body saying what and why"
            )
    mismatched = [
        rel for rel, content in expected.items() if read_working(layout, rel) != content
    ]
    if mismatched:
        problems.append(
            f"{len(mismatched)} upstream files differ from pristine + series "
            f"(`tools/fork status`): " + ", ".join(mismatched[:10])
        )
    try:
        check_no_shadowing(layout, list(expected))
    except ForkError as e:
        problems.append(str(e))
    for problem in problems:
        print(f"FAIL: {problem}")
    if problems:
        return 1
    print(
        f"ok: {len(upstream.series)} patches apply cleanly to {upstream.pin.package} "
        f"{upstream.pin.version}; the working tree matches"
    )
    return 0


def _new_files(layout: Layout, upstream: Upstream) -> Dict[str, bytes]:
    """The fork's own tracked files that an export carries (not benchmark results)."""
    tracked = tracked_files(layout, *EXPORTED_TREES)
    if tracked is None:
        raise ForkError("export needs a git checkout of the fork")
    upstream_paths = set(upstream.pristine_files())
    return {
        rel: _exported_content(rel, (layout.root / rel).read_bytes())
        for rel in tracked
        if rel not in upstream_paths and is_exported(rel)
    }


def _exported_content(rel: str, content: bytes) -> bytes:
    """Docs lose their links into benchmark results, which stay in the fork."""
    if not rel.endswith(".md"):
        return content
    return without_links_to_unexported(content.decode(), rel).encode()


def cmd_export(layout: Layout, out_dir: Path, test_each: bool = False) -> int:
    upstream = Upstream.load(layout)
    ours = _new_files(layout, upstream)
    groups = assign_new_files([p.text for p in upstream.series], ours)
    out_dir.mkdir(parents=True, exist_ok=True)
    with upstream.scratch_repo(touched_files(upstream.series)) as repo:
        for patch, rels in zip(upstream.series, groups):
            repo.am([patch])
            repo.write_files({rel: ours[rel] for rel in rels})
            repo.amend_all(strip_fork_files(repo.head_message()))
        if groups[-1]:
            repo.write_files({rel: ours[rel] for rel in groups[-1]})
            repo.commit_all(TRAILING_FILES_MESSAGE)
        written = repo.format_patches(repo.base, out_dir)
    for path, rels in zip(written, groups):
        print(f"  {path.name}: {len(rels)} new files")
    print(
        f"exported {len(written)} commits to {out_dir} "
        f"(apply with `git am` on upstream {upstream.pin.version})"
    )
    return _test_each_commit(layout, upstream, ours, groups) if test_each else 0


def _is_test(rel: str) -> bool:
    path = PurePosixPath(rel)
    return path.parts[0] == "test" and path.match("test_*.py")


def _test_each_commit(
    layout: Layout, upstream: Upstream, ours: Dict[str, bytes], groups: List[List[str]]
) -> int:
    """Run the tests each exported commit brings on the tree at that commit: pristine
    upstream, the patches so far and the new files so far (this interpreter's pytest,
    the repository's pytest.ini and conftest.py)."""
    failed = []
    with tempfile.TemporaryDirectory(prefix="fork-export-tests-") as tmp:
        tree = Path(tmp)
        shutil.copytree(upstream.pristine_dir, tree / "python" / UPSTREAM_PACKAGE)
        for name in ("pytest.ini", "conftest.py"):
            if (layout.root / name).is_file():
                shutil.copy(layout.root / name, tree)
        for k, rels in enumerate(groups):
            apply_in(tree, upstream.series[k : k + 1])
            write_files(tree, {rel: ours[rel] for rel in rels})
            tests = [rel for rel in rels if _is_test(rel)]
            if not tests:
                continue
            result = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                + ["--tb=short", *tests],
                cwd=tree,
                env={**os.environ, "PYTHONPATH": str(tree / "python")},
                capture_output=True,
                text=True,
            )
            summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
            print(f"  commit {k + 1}: {len(tests)} test files: {summary}")
            if result.returncode != 0:
                failed.append(k + 1)
                print(result.stdout[-4000:] + result.stderr[-2000:])
    if failed:
        print(f"FAIL: the tests of commits {failed} fail on the tree at their commit")
        return 1
    print("ok: every commit's tests pass on the tree at that commit")
    return 0


def _download_wheel(package: str, version: str, tag: str, dest: Path) -> Path:
    python_version = f"{tag[2]}.{tag[3:]}"
    files = pip_download(f"{package}=={version}", dest, python_version=python_version)
    if len(files) != 1:
        raise ForkError(
            f"expected one {package} {version} wheel for {tag}, pip gave {files}"
        )
    return files[0]


def _download_pin(pin: Pin, version: str, dest: Path) -> Pin:
    wheels = {}
    for tag in pin.wheels:
        wheel = _download_wheel(pin.package, version, tag, dest)
        wheels[tag] = PinnedWheel(file=wheel.name, sha256=sha256_of(wheel))
    return Pin(package=pin.package, version=version, wheels=wheels)


def _check_given_wheel(path: Path, package: str, version: str) -> None:
    if not path.is_file():
        raise ForkError(f"--wheel {path} is not a file")
    if not path.name.startswith(f"{package}-{version}-"):
        raise ForkError(f"--wheel {path.name} is not a {package} {version} wheel")


def _replay_onto(
    repo: ScratchRepo, series: List[Patch], new_pristine: Path, version: str
) -> Tuple[str, List[str]]:
    """Commit VERSION's copy of the touched files on the old base and replay the series 3-way on it.

    Returns the new base commit and the conflicting patches. The series is applied
    to the old base first so that 3-way merges find every patch's preimage.
    """
    repo.am(series)
    repo.git("checkout", "-q", "-b", "rebased", repo.base)
    repo.write_files(
        {
            rel: _read_optional(new_pristine.parent / rel.removeprefix("python/"))
            for rel in touched_files(series)
        }
    )
    repo.commit_all(f"Upstream SGLang {version}")
    new_base = repo.head()
    return new_base, _replay_three_way(repo, series)


def cmd_rebase(
    layout: Layout, version: str, dry_run: bool = False, wheel: Optional[Path] = None
) -> int:
    upstream = Upstream.load(layout)
    if dry_run:
        return _rebase_dry_run(upstream, version, wheel)
    if wheel is not None:
        raise ForkError(
            "--wheel goes with --dry-run: a rebase pins the wheels it downloads "
            "for every Python tag"
        )
    _materialized_state(layout, upstream)
    with tempfile.TemporaryDirectory() as tmp:
        new_pin = _download_pin(upstream.pin, version, Path(tmp) / "wheels")
        new_wheel = Path(tmp) / "wheels" / next(iter(new_pin.wheels.values())).file
        new_pristine = extract_package(new_wheel, Path(tmp) / "pristine")
        with upstream.scratch_repo(touched_files(upstream.series)) as repo:
            new_base, conflicts = _replay_onto(
                repo, upstream.series, new_pristine, version
            )
            if conflicts:
                print(
                    f"rebase onto {version} stopped: {len(conflicts)} patches "
                    "conflict; nothing changed"
                )
                return 1
            with tempfile.TemporaryDirectory() as out:
                fresh = repo.format_patches(new_base, Path(out))
                for old, new in zip(upstream.series, fresh):
                    old.path.write_text(new.read_text())
    write_pin(layout.pin_file, new_pin)
    print(
        f"pin moved to {upstream.pin.package} {version}; "
        "update python/pyproject.toml dependencies to its METADATA"
    )
    print(materialize(layout, force=True))
    return 0


def _rebase_dry_run(upstream: Upstream, version: str, wheel: Optional[Path]) -> int:
    """Report how the series replays onto VERSION; changes nothing, conflicts included."""
    package, series = upstream.pin.package, upstream.series
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            tag = next(iter(upstream.pin.wheels))
            wheel = _download_wheel(package, version, tag, Path(tmp) / "wheels")
        else:
            _check_given_wheel(wheel, package, version)
        new_pristine = extract_package(wheel, Path(tmp) / "pristine")
        print(f"dry run: replaying {len(series)} patches onto {package} {version}")
        with upstream.scratch_repo(touched_files(series)) as repo:
            _, conflicts = _replay_onto(repo, series, new_pristine, version)
    print(
        f"{len(conflicts)} of {len(series)} patches conflict with {version}; nothing changed"
    )
    return 0


def _read_optional(path: Path) -> Optional[bytes]:
    return path.read_bytes() if path.is_file() else None


def _replay_three_way(repo: ScratchRepo, series: List[Patch]) -> List[str]:
    """Apply every patch with a 3-way merge; print one line per patch; return the
    conflicting ones."""
    conflicts = []
    for patch in series:
        clean = (
            run_git(
                ["apply", "--check", str(patch.path.resolve())], repo.path, check=False
            ).returncode
            == 0
        )
        result = run_git(
            ["am", "-q", "-3", str(patch.path.resolve())], repo.path, check=False
        )
        if result.returncode == 0:
            print(f"  {'clean   ' if clean else 'merged  '} {patch.name}")
            continue
        files = repo.git("diff", "--name-only", "--diff-filter=U").split()
        described = [_describe_conflict(repo.path, rel) for rel in files]
        print(
            f"  CONFLICT {patch.name}: {', '.join(described) or result.stderr.strip()}"
        )
        conflicts.append(patch.name)
        repo.git("am", "--skip", check=False)
    return conflicts


def _describe_conflict(repo_path: Path, rel: str) -> str:
    """``rel (N hunks)``, counting the conflict markers git left in the file."""
    path = repo_path / rel
    text = path.read_text(errors="replace") if path.is_file() else ""
    hunks = sum(1 for line in text.splitlines() if line.startswith("<<<<<<< "))
    if not hunks:
        return rel
    return f"{rel} ({hunks} hunk{'' if hunks == 1 else 's'})"
