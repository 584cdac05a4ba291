"""Which commit of the exported series brings in each new file of the fork.

A new module enters with the first patch whose added lines import it, directly or
through other new modules. A file no patch needs (a test, a test utility) enters with
the latest of the new modules it imports, and brings the test data it names; one
that imports none, benchmarks, what loads them, and docs enter in a final commit
after the series. A patch's ``Fork-Files:`` trailer names files (globs) that enter
with it whatever the imports say.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from pathlib import PurePosixPath
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set

from forklib import ForkError
from forklib.layout import UPSTREAM_PACKAGE

FORK_FILES_TRAILER = "Fork-Files:"
_TRAILER = re.compile(rf"^{FORK_FILES_TRAILER}[ \t]*(.*)$", re.MULTILINE)
_DOTTED = re.compile(rf"(?<![\w.]){UPSTREAM_PACKAGE}(?:\.\w+)+")
_FROM_IMPORT = re.compile(
    rf"\bfrom\s+({UPSTREAM_PACKAGE}(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]*)"
)


def is_exported(rel: str) -> bool:
    """Benchmark results (``benchmark/**/results/**``) stay in the fork."""
    parts = PurePosixPath(rel).parts
    return not (parts[0] == "benchmark" and "results" in parts[1:-1])


_MARKDOWN_LINK = re.compile(
    r"(?P<paren>\s*\(\s*)?(?P<image>!)?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)"
    r"(?(paren)\s*\))"
)


def without_links_to_unexported(markdown: str, rel: str) -> str:
    """``markdown`` (the file ``rel``) with its relative links into files an export
    leaves behind taken out: a link becomes its text, a parenthesized link or an
    image goes."""

    def rewrite(match: re.Match) -> str:
        target = match["target"].split("#", 1)[0]
        if not target or "://" in target:
            return match[0]
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
        if is_exported(resolved):
            return match[0]
        return "" if match["paren"] or match["image"] else match["text"]

    return _MARKDOWN_LINK.sub(rewrite, markdown)


def follows_imports(rel: str) -> bool:
    """Benchmarks measure the whole series: no patch takes them in for their imports."""
    return PurePosixPath(rel).parts[0] != "benchmark"


def module_name(rel: str) -> Optional[str]:
    """``python/sglang/a/b.py`` -> ``sglang.a.b`` (a package for ``__init__.py``)."""
    path = PurePosixPath(rel)
    if path.suffix != ".py" or path.parts[:2] != ("python", UPSTREAM_PACKAGE):
        return None
    parts = path.with_suffix("").parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(text: str, modules: Set[str]) -> Set[str]:
    """The modules of ``modules`` that ``text`` names: dotted, or as ``from PKG import NAME``."""
    found = set()
    for dotted in _DOTTED.findall(text):
        parts = dotted.split(".")
        found.update(".".join(parts[:n]) for n in range(2, len(parts) + 1))
    for package, names in _FROM_IMPORT.findall(text):
        for name in re.sub(r"#[^\n]*", "", names).strip("()").split(","):
            if name.split():
                found.add(f"{package}.{name.split()[0]}")
    return found & modules


def added_lines(patch_text: str) -> str:
    diff = patch_text[patch_text.find("\ndiff --git ") + 1 :]
    return "\n".join(
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++ ")
    )


def commit_message(patch_text: str) -> str:
    return patch_text.split("\n---\n", 1)[0]


def strip_fork_files(message: str) -> str:
    """The commit message without its ``Fork-Files:`` trailer lines."""
    return _TRAILER.sub("", message).rstrip() + "\n"


def _named_by_trailer(patch_text: str, new_files: Sequence[str]) -> Set[str]:
    named = set()
    for globs in _TRAILER.findall(commit_message(patch_text)):
        for glob in globs.split():
            matched = fnmatch.filter(new_files, glob)
            if not matched:
                raise ForkError(
                    f"{FORK_FILES_TRAILER} {glob} matches no new file of the fork"
                )
            named.update(matched)
    return named


def _closure(start: Set[str], deps: Mapping[str, Set[str]]) -> Set[str]:
    seen, todo = set(), list(start)
    while todo:
        rel = todo.pop()
        if rel not in seen:
            seen.add(rel)
            todo.extend(deps[rel])
    return seen


def _imports(text: str, by_module: Mapping[str, str]) -> Set[str]:
    """The new files that ``text`` imports."""
    return {by_module[m] for m in imported_modules(text, set(by_module))}


def _needed_by_patches(
    patch_texts: Sequence[str],
    new_files: Sequence[str],
    by_module: Mapping[str, str],
    deps: Mapping[str, Set[str]],
) -> Dict[str, int]:
    """Each new file that a patch imports (through other new files too) -> the first such patch.

    Files that a ``Fork-Files:`` trailer names go with the first patch naming them.
    """
    named = [_named_by_trailer(text, new_files) for text in patch_texts]
    index: Dict[str, int] = {}
    for k, rels in enumerate(named):
        index.update({rel: k for rel in rels if rel not in index})
    for k, text in enumerate(patch_texts):
        for rel in _closure(_imports(added_lines(text), by_module) | named[k], deps):
            index.setdefault(rel, k)
    return index


def _following_imports(
    index: Mapping[str, int], deps: Mapping[str, Set[str]]
) -> Dict[str, int]:
    """Files no patch needs -> the latest patch of the new files they import.

    A file that imports no such file either, but that one of these needs (a test
    utility), goes with the first of them that needs it. A file that needs a
    benchmark follows the series with the benchmarks.
    """
    closures = {
        rel: _closure({rel}, deps)
        for rel in deps.keys() - index.keys()
        if follows_imports(rel)
    }
    closures = {
        rel: closure
        for rel, closure in closures.items()
        if all(follows_imports(d) for d in closure)
    }
    following = {
        rel: max(index[d] for d in closure if d in index)
        for rel, closure in closures.items()
        if closure & index.keys()
    }
    needed = {}
    for rel in closures.keys() - following.keys():
        needed_by = [k for g, k in following.items() if rel in closures[g]]
        if needed_by:
            needed[rel] = min(needed_by)
    return {**following, **needed}


def _test_data_named(text: str, new_files: Iterable[str]) -> Set[str]:
    """The new files under test/ other than Python ones whose names ``text`` spells."""
    return {
        rel
        for rel in new_files
        if rel.startswith("test/")
        and not rel.endswith(".py")
        and PurePosixPath(rel).name in text
    }


_BENCHMARK_LOAD = re.compile(r"load_benchmark_(?:script|package)\(\s*[\"'](\w+)[\"']")


def _benchmarks_loaded(text: str, new_files: Iterable[str]) -> Set[str]:
    """The benchmark files that ``text`` loads (``sglang.test.spec_engine_utils``'s
    ``load_benchmark_script`` / ``load_benchmark_package``, by script or package name).
    """
    names = set(_BENCHMARK_LOAD.findall(text))
    return {
        rel
        for rel in new_files
        if not follows_imports(rel)
        and names & {PurePosixPath(rel).stem, *PurePosixPath(rel).parts[:-1]}
    }


def _dependencies(
    rel: str,
    content: bytes,
    new_files: Iterable[str],
    by_module: Mapping[str, str],
) -> Set[str]:
    """The new files a new Python file needs: those it imports, the benchmarks it
    loads, and the test data it names (which then enters with it)."""
    if not rel.endswith(".py"):
        return set()
    text = content.decode(errors="replace")
    return (
        _imports(text, by_module)
        | _benchmarks_loaded(text, new_files)
        | _test_data_named(text, new_files)
    ) - {rel}


def assign_new_files(
    patch_texts: Sequence[str], new_files: Mapping[str, bytes]
) -> List[List[str]]:
    """Group k of the result enters with patch k; the extra last group follows the series."""
    by_module = {module_name(rel): rel for rel in new_files if module_name(rel)}
    deps = {
        rel: _dependencies(rel, content, new_files, by_module)
        for rel, content in new_files.items()
    }
    index = _needed_by_patches(patch_texts, sorted(new_files), by_module, deps)
    index.update(_following_imports(index, deps))
    groups: List[List[str]] = [[] for _ in range(len(patch_texts) + 1)]
    for rel in sorted(new_files):
        groups[index.get(rel, len(patch_texts))].append(rel)
    return groups
