"""Install pinned wheels from a folder into a target folder, for this interpreter, offline.

    python scripts/install_wheels.py REQUIREMENTS WHEELS TARGET

REQUIREMENTS lists ``name==version`` pins (comments after ``#``; a pin whose comment starts
with "if absent" is skipped where this interpreter already has a distribution of that name).
For each pin the wheel in WHEELS that this interpreter can run (its Python, ABI and platform
tags, glibc for manylinux) is unpacked into TARGET, which the caller then puts first on
PYTHONPATH. No pip, no network, no dependency resolution: the pins are the whole set. One line
a pin; exit 1, saying which pin has no wheel here, when one is missing.

Standard library only: it runs before anything it installs.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
import zipfile
from importlib import metadata
from pathlib import Path


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def read_pins(path: Path) -> list[tuple[str, str, bool]]:
    """(name, version, only if absent) per pin of the requirements file."""
    pins = []
    for line in path.read_text().splitlines():
        spec, _, comment = line.partition("#")
        spec = spec.strip()
        if not spec:
            continue
        name, sep, version = spec.partition("==")
        if not sep or not version.strip():
            raise SystemExit(f"{path}: pins must read name==version, got {spec!r}")
        pins.append((name.strip(), version.strip(), comment.strip().startswith("if absent")))
    return pins


def glibc() -> tuple[int, int]:
    libc, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "glibc 0.0").partition(" ")
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) if libc == "glibc" else (0, 0)


def this_interpreter() -> tuple[tuple[int, int], str, tuple[int, int]]:
    """(Python version, machine, glibc version) of the interpreter running this."""
    return sys.version_info[:2], platform.machine(), glibc()


def runs_here(tags: str, interpreter: tuple[tuple[int, int], str, tuple[int, int]]) -> bool:
    """Whether a wheel's ``python-abi-platform`` tags (each may be dotted) fit ``interpreter``
    (``this_interpreter()``)."""
    python_tags, abi_tags, platform_tags = (part.split(".") for part in tags.split("-"))
    (major, minor), machine, libc = interpreter
    cpython = f"cp{major}{minor}"
    abi3 = "abi3" in abi_tags and any(
        t.startswith(f"cp{major}") and int(t[3:] or 0) <= minor for t in python_tags)
    python_ok = abi3 or any(t in (f"py{major}", f"py{major}{minor}", cpython)
                            for t in python_tags)
    abi_ok = abi3 or any(t in ("none", cpython) for t in abi_tags)

    def platform_ok(tag: str) -> bool:
        if tag == "any":
            return True
        if not tag.endswith("_" + machine):
            return False
        legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
        prefix = tag[: -len(machine) - 1]
        if prefix in legacy:
            return legacy[prefix] <= libc
        found = re.fullmatch(r"manylinux_(\d+)_(\d+)", prefix)
        return bool(found) and (int(found[1]), int(found[2])) <= libc

    return python_ok and abi_ok and any(platform_ok(t) for t in platform_tags)


def wheel_for(wheels: Path, name: str, version: str,
              interpreter: tuple[tuple[int, int], str, tuple[int, int]] | None = None
              ) -> Path | None:
    """The wheel of ``name==version`` in ``wheels`` that ``interpreter`` (default: this one)
    can run, or None."""
    interpreter = interpreter or this_interpreter()
    for path in sorted(wheels.glob("*.whl")):
        parts = path.stem.split("-")
        if len(parts) not in (5, 6):
            continue
        if normalized(parts[0]) == normalized(name) and parts[1] == version and \
                runs_here("-".join(parts[-3:]), interpreter):
            return path
    return None


def unpack(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    # A wheel's <name>.data/purelib and platlib belong in site-packages itself.
    for data in target.glob("*.data"):
        for scheme in ("purelib", "platlib"):
            for item in (data / scheme).glob("*") if (data / scheme).is_dir() else ():
                shutil.move(str(item), str(target / item.name))
        shutil.rmtree(data)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    requirements, wheels, target = (Path(a) for a in argv)
    target.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, version, if_absent in read_pins(requirements):
        if if_absent:
            try:
                present = metadata.version(name)
            except metadata.PackageNotFoundError:
                present = None
            if present is not None:
                print(f"  {name}: {present} already here, {version} not installed")
                continue
        wheel = wheel_for(wheels, name, version)
        if wheel is None:
            missing.append(f"{name}=={version}")
            continue
        unpack(wheel, target)
        print(f"  {name} {version}: {wheel.name}")
    if missing:
        print(f"install_wheels: no wheel in {wheels} for Python "
              f"{platform.python_version()} on {platform.machine()} for "
              f"{', '.join(missing)} (scripts/gpu-check-wheels.sh downloads them)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
