"""The pin: which upstream release we build on and the wheels allowed for it."""

from __future__ import annotations

import dataclasses
import sys
import tomllib
from pathlib import Path
from typing import Dict

from forklib import ForkError


@dataclasses.dataclass(frozen=True)
class PinnedWheel:
    file: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class Pin:
    package: str
    version: str
    wheels: Dict[str, PinnedWheel]

    def wheel_for(self, python_tag: str) -> PinnedWheel:
        if python_tag not in self.wheels:
            raise ForkError(
                f"upstream.toml pins no {self.package} {self.version} wheel for "
                f"{python_tag}; pinned tags: {', '.join(sorted(self.wheels))}"
            )
        return self.wheels[python_tag]

    def wheel_named(self, file_name: str) -> PinnedWheel:
        for wheel in self.wheels.values():
            if wheel.file == file_name:
                return wheel
        raise ForkError(
            f"{file_name} is not a wheel pinned in upstream.toml "
            f"({', '.join(w.file for w in self.wheels.values())})"
        )


def current_python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def load_pin(path: Path) -> Pin:
    data = tomllib.loads(path.read_text())["upstream"]
    wheels = {
        tag: PinnedWheel(file=entry["file"], sha256=entry["sha256"])
        for tag, entry in data["wheels"].items()
    }
    return Pin(package=data["package"], version=data["version"], wheels=wheels)


def write_pin(path: Path, pin: Pin) -> None:
    lines = [
        "# The upstream SGLang release this fork is built on, materialized at install time.",
        "# Only the wheels listed here may be used; each is verified against its sha256.",
        "# Update with `tools/fork rebase VERSION`.",
        "[upstream]",
        f'package = "{pin.package}"',
        f'version = "{pin.version}"',
    ]
    for tag in sorted(pin.wheels):
        wheel = pin.wheels[tag]
        lines += [
            "",
            f"[upstream.wheels.{tag}]",
            f'file = "{wheel.file}"',
            f'sha256 = "{wheel.sha256}"',
        ]
    path.write_text("\n".join(lines) + "\n")
