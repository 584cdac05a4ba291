"""PEP 517 backend: materialize pinned upstream SGLang + the patch series, then build.

Wraps setuptools so that ``pip install -e python`` on a fresh clone needs no other
step. Materialization is idempotent; set ``SGLANG_FORK_UPSTREAM_WHEEL`` to a pinned
wheel file to work offline.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from forklib import ForkError  # noqa: E402
from forklib.layout import Layout  # noqa: E402
from forklib.tree import materialize  # noqa: E402
from setuptools import build_meta as _setuptools  # noqa: E402


def _materialize() -> None:
    try:
        print(f"sglang-fork: {materialize(Layout.find())}", file=sys.stderr)
    except ForkError as e:
        raise SystemExit(
            f"sglang-fork: cannot materialize upstream SGLang: {e}"
        ) from None


def _materializing(hook):
    def wrapped(*args, **kwargs):
        _materialize()
        return hook(*args, **kwargs)

    wrapped.__name__ = hook.__name__
    return wrapped


get_requires_for_build_wheel = _setuptools.get_requires_for_build_wheel
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
prepare_metadata_for_build_wheel = _materializing(
    _setuptools.prepare_metadata_for_build_wheel
)
prepare_metadata_for_build_editable = _materializing(
    _setuptools.prepare_metadata_for_build_editable
)
build_wheel = _materializing(_setuptools.build_wheel)
build_editable = _materializing(_setuptools.build_editable)
build_sdist = _materializing(_setuptools.build_sdist)
