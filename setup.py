"""The package layout: the repository's folders, installed under one namespace of their own.

`server/`, `batcher/`, `clients/`, `bench/` and `protos/` become `batchgate.server`,
`batchgate.batcher`, ... (setuptools' package-dir mapping), and `models/` (the example
repository) becomes data in `batchgate/models/`; an installed batchgate has no top-level module
but `batchgate`. Everything else about the distribution is in pyproject.toml.
"""

import runpy
from pathlib import Path

from setuptools import find_packages, setup

# Repository folders, each installed as batchgate.<folder> with its sub-packages, and the example
# repository's folder; declared once, in batchgate/_checkout.py (which also finds the folders in
# a checkout that is not installed).
ROOT = Path(__file__).resolve().parent
_LAYOUT = runpy.run_path(str(ROOT / "batchgate" / "_checkout.py"))
FOLDERS, EXAMPLE_MODELS = _LAYOUT["FOLDERS"], _LAYOUT["EXAMPLE_MODELS"]


def layout() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    packages, package_dir = ["batchgate"], {"batchgate": "batchgate"}
    for folder in FOLDERS:
        package_dir[f"batchgate.{folder}"] = folder
        packages.append(f"batchgate.{folder}")
        packages += [f"batchgate.{folder}.{sub}" for sub in find_packages(folder)]
    # The example repository, as data: batchgate/models/ is where an installed server and the
    # benchmarks look when no repository is given (a folder's parent, as in a checkout).
    # Each model's folder is named a package only so that setuptools copies its files.
    models = f"batchgate.{EXAMPLE_MODELS}"
    package_dir[models] = EXAMPLE_MODELS
    packages.append(models)
    package_data = {"batchgate.protos": ["*.proto"],
                    # The serving benchmark's all-C++ yardstick is built where it runs.
                    "batchgate.bench.floor": ["server.cc"],
                    models: ["README.md"]}
    for config in sorted((ROOT / EXAMPLE_MODELS).glob("*/config.pbtxt")):
        packages.append(f"{models}.{config.parent.name}")
        package_data[f"{models}.{config.parent.name}"] = ["config.pbtxt", "*/*.py"]
    return packages, package_dir, package_data


if __name__ == "__main__":
    packages, package_dir, package_data = layout()
    setup(packages=packages, package_dir=package_dir, package_data=package_data)
