"""Where the fork keeps things, relative to the repository root."""

from __future__ import annotations

import dataclasses
from pathlib import Path

UPSTREAM_PACKAGE = "sglang"


@dataclasses.dataclass(frozen=True)
class Layout:
    root: Path

    @classmethod
    def find(cls) -> "Layout":
        return cls(Path(__file__).resolve().parents[2])

    @property
    def pin_file(self) -> Path:
        return self.root / "upstream.toml"

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def python_dir(self) -> Path:
        """The directory holding the ``sglang`` package, as in upstream's repo."""
        return self.root / "python"

    @property
    def state_dir(self) -> Path:
        """Ignored: wheel cache, pristine extractions, materialization state."""
        return self.python_dir / ".fork"

    def repo_path(self, python_relpath: str) -> str:
        """``sglang/x.py`` -> ``python/sglang/x.py`` (paths used in patches)."""
        return f"python/{python_relpath}"
