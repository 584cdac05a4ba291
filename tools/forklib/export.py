"""Which commit of the exported series brings in each new file of the fork.

A new module enters with the first patch whose added lines import it, directly or
through other new modules. A module that a new library module imports only inside a
function (a path the patches make reachable later, such as a flag value a later patch
accepts) does not enter with it: a patch must bring it, by import or trailer, or the
export fails. A file no patch needs (a test, a test utility) enters with
the latest of the new modules it imports, and brings the test data it names; one
that imports none, benchmarks, what loads them, and docs enter in a final commit
after the series. A patch's ``Fork-Files:`` trailer names files (globs) that enter
with it whatever the imports say, and the new files they need with it at the latest.
"""

from __future__ import annotations

import ast
import fnmatch
import posixpath
import re
from pathlib import PurePosixPath
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from forklib import ForkError
from forklib.layout import UPSTREAM_PACKAGE

FORK_FILES_TRAILER = "Fork-Files:"
_TRAILER = re.compile(rf"^{FORK_FILES_TRAILER}[ \t]*(.*)$", re.MULTILINE)
_DOTTED = re.compile(rf"(?<![\w.]){UPSTREAM_PACKAGE}(?:\.\w+)+")
_FROM_IMPORT = re.compile(
    rf"\bfrom\s+({UPSTREAM_PACKAGE}(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]*)"
)


def is_exported(rel: str) -> bool:
    """Benchmark results (``benchmark/**/results/**``) and the tests of the fork's own
    README (``test/fork/``) stay in the fork."""
    parts = PurePosixPath(rel).parts
    return not (
        (parts[0] == "benchmark" and "results" in parts[1:-1])
        or parts[:2] == ("test", "fork")
    )


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


def _imported_by_patches(
    patch_texts: Sequence[str],
    by_module: Mapping[str, str],
    deps: Mapping[str, Set[str]],
) -> Dict[str, int]:
    """Each new file that a patch imports (through other new files too) -> the first such patch."""
    index: Dict[str, int] = {}
    for k, text in enumerate(patch_texts):
        for rel in _closure(_imports(added_lines(text), by_module), deps):
            index.setdefault(rel, k)
    return index


def _named_by_trailers(
    patch_texts: Sequence[str], new_files: Sequence[str]
) -> Dict[str, int]:
    """Each file a ``Fork-Files:`` trailer names -> the first patch naming it."""
    index: Dict[str, int] = {}
    for k, text in enumerate(patch_texts):
        for rel in _named_by_trailer(text, new_files):
            index.setdefault(rel, k)
    return index


def _with_what_named_files_need(
    index: Dict[str, int], named: Mapping[str, int], deps: Mapping[str, Set[str]]
) -> None:
    """What a file named by a trailer needs enters with it at the latest."""
    for rel, k in named.items():
        for dep in _closure({rel}, deps):
            if index.get(dep, k + 1) > k:
                index[dep] = k


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


def defers_imports(rel: str) -> bool:
    """Library modules may import inside a function what they need only on a path a
    later patch opens; tests and test utilities take all they name along."""
    return rel.startswith(f"python/{UPSTREAM_PACKAGE}/") and not rel.startswith(
        f"python/{UPSTREAM_PACKAGE}/test/"
    )


def split_function_imports(text: str) -> Tuple[str, str]:
    """(the text without its import statements inside functions, those statements)."""
    deferred = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    deferred.update(range(inner.lineno - 1, inner.end_lineno))
    lines = text.splitlines(keepends=True)
    kept = "".join(line for i, line in enumerate(lines) if i not in deferred)
    return kept, "".join(lines[i] for i in sorted(deferred))


def _dependencies(
    rel: str,
    content: bytes,
    new_files: Iterable[str],
    by_module: Mapping[str, str],
) -> Tuple[Set[str], Set[str]]:
    """The new files a new Python file needs: those it imports, the benchmarks it
    loads, and the test data it names (which then enters with it); and those a
    library module imports only inside functions (deferred)."""
    if not rel.endswith(".py"):
        return set(), set()
    text = content.decode(errors="replace")
    deferred_text = ""
    if defers_imports(rel):
        text, deferred_text = split_function_imports(text)
    needed = (
        _imports(text, by_module)
        | _benchmarks_loaded(text, new_files)
        | _test_data_named(text, new_files)
    ) - {rel}
    return needed, _imports(deferred_text, by_module) - needed - {rel}


def _check_deferred(brought: Set[str], deferred: Mapping[str, Set[str]]) -> None:
    """Every module imported inside a function is brought by some patch."""
    for rel, modules in sorted(deferred.items()):
        for module in sorted(modules - brought):
            raise ForkError(
                f"{rel} imports {module} inside a function, and no patch brings "
                f"{module}: import it in the patch that makes that path reachable, "
                f"or name it in that patch's {FORK_FILES_TRAILER} trailer"
            )


def assign_new_files(
    patch_texts: Sequence[str], new_files: Mapping[str, bytes]
) -> List[List[str]]:
    """Group k of the result enters with patch k; the extra last group follows the series."""
    by_module = {module_name(rel): rel for rel in new_files if module_name(rel)}
    deps, deferred = {}, {}
    for rel, content in new_files.items():
        deps[rel], deferred[rel] = _dependencies(rel, content, new_files, by_module)
    named = _named_by_trailers(patch_texts, sorted(new_files))
    index = _imported_by_patches(patch_texts, by_module, deps)
    for rel, k in named.items():
        index[rel] = min(index.get(rel, k), k)
    _check_deferred(index.keys() | _closure(set(named), deps), deferred)
    index.update(_following_imports(index, deps))
    _with_what_named_files_need(index, named, deps)
    groups: List[List[str]] = [[] for _ in range(len(patch_texts) + 1)]
    for rel in sorted(new_files):
        groups[index.get(rel, len(patch_texts))].append(rel)
    return groups
