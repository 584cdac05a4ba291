"""Fetching the pinned upstream wheel, verifying it and extracting its package."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List, Optional

from forklib import ForkError
from forklib.layout import UPSTREAM_PACKAGE, Layout
from forklib.pin import Pin, PinnedWheel, current_python_tag

OFFLINE_WHEEL_ENV = "SGLANG_FORK_UPSTREAM_WHEEL"

MANYLINUX_PLATFORMS = [
    f"manylinux_2_{minor}_x86_64" for minor in (34, 28, 27, 24, 17)
] + ["manylinux2014_x86_64"]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_wheel(path: Path, expected: PinnedWheel) -> Path:
    actual = sha256_of(path)
    if actual != expected.sha256:
        raise ForkError(
            f"sha256 mismatch for {path}: expected {expected.sha256} (upstream.toml), "
            f"got {actual}; refusing to use it"
        )
    return path


def pip_download(
    requirement: str, dest: Path, python_version: Optional[str] = None
) -> List[Path]:
    """Download one wheel (no dependencies) with pip, for this or another Python."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--dest", str(dest), "--quiet", requirement]
    if python_version:
        cmd += ["--python-version", python_version, "--implementation", "cp"]
        for platform in MANYLINUX_PLATFORMS:
            cmd += ["--platform", platform]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ForkError(
            f"pip could not download {requirement}:\n{result.stderr.strip()}"
        )
    return sorted(p for p in dest.glob("*.whl") if p not in before)


def obtain_wheel(layout: Layout, pin: Pin) -> Path:
    """The verified upstream wheel for this interpreter (offline when the env var names one)."""
    offline = os.environ.get(OFFLINE_WHEEL_ENV)
    if offline:
        path = Path(offline)
        if not path.is_file():
            raise ForkError(f"{OFFLINE_WHEEL_ENV}={offline} is not a file")
        return verify_wheel(path, pin.wheel_named(path.name))

    expected = pin.wheel_for(current_python_tag())
    cached = layout.state_dir / "wheels" / expected.file
    if cached.is_file():
        return verify_wheel(cached, expected)
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(f"{pin.package}=={pin.version}", Path(tmp))
        downloaded = Path(tmp) / expected.file
        if not downloaded.is_file():
            got = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
            raise ForkError(
                f"pip downloaded {got}, expected the pinned {expected.file}"
            )
        verify_wheel(downloaded, expected)
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(downloaded), cached)
    return cached


def extract_package(wheel: Path, dest_parent: Path) -> Path:
    """Extract the wheel's top-level package into ``dest_parent/<package>`` once."""
    target = dest_parent / UPSTREAM_PACKAGE
    if (dest_parent / ".complete").is_file():
        return target
    if dest_parent.exists():
        shutil.rmtree(dest_parent)
    with zipfile.ZipFile(wheel) as archive:
        members = [
            m
            for m in archive.infolist()
            if m.filename.startswith(f"{UPSTREAM_PACKAGE}/")
        ]
        for member in members:
            path = archive.extract(member, dest_parent)
            mode = member.external_attr >> 16
            if mode & 0o111:
                os.chmod(path, 0o755)
    (dest_parent / ".complete").write_text(wheel.name + "\n")
    return target


def pristine_package(layout: Layout, pin: Pin) -> Path:
    """The pristine upstream package directory for this interpreter's wheel."""
    wheel = obtain_wheel(layout, pin)
    sha = pin.wheel_named(wheel.name).sha256
    return extract_package(wheel, layout.state_dir / "pristine" / sha[:16])
