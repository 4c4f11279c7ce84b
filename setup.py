"""The package layout: the repository's folders, installed under one namespace of their own.

`server/`, `batcher/`, `clients/`, `bench/` and `protos/` become `batchgate.server`,
`batchgate.batcher`, ... (setuptools' package-dir mapping); an installed batchgate has no
top-level module but `batchgate`. Everything else about the distribution is in pyproject.toml.
"""

import runpy
from pathlib import Path

from setuptools import find_packages, setup

# Repository folders, each installed as batchgate.<folder> with its sub-packages; declared once,
# in batchgate/_checkout.py (which also finds them in a checkout that is not installed).
FOLDERS = runpy.run_path(str(Path(__file__).resolve().parent / "batchgate" / "_checkout.py"))[
    "FOLDERS"]


def layout() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = ["batchgate"], {"batchgate": "batchgate"}
    for folder in FOLDERS:
        package_dir[f"batchgate.{folder}"] = folder
        packages.append(f"batchgate.{folder}")
        packages += [f"batchgate.{folder}.{sub}" for sub in find_packages(folder)]
    return packages, package_dir


if __name__ == "__main__":
    packages, package_dir = layout()
    setup(packages=packages, package_dir=package_dir)
