"""The package layout's one definition, and a checkout used without installing it.

Installed (a wheel, or ``pip install -e``), the repository's folders ``FOLDERS`` are the
sub-packages ``batchgate.<folder>`` through setup.py's package-dir mapping, which reads
``FOLDERS`` from here. A checkout that is not installed (a machine with torch preinstalled that
runs ``python -m batchgate.bench.gpu_check`` from the repository root) has ``batchgate`` on the
path but nothing maps ``batchgate.<folder>`` to its folder: ``install`` adds a finder for
exactly those names, pointing at the checkout that ``batchgate`` itself was imported from, so a
process never mixes one checkout's ``batchgate`` with another's folders. No top-level
``server`` or ``bench`` module appears either way.

Standalone (no batchgate imports): setup.py runs this file by path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

# Repository folders, each installed as batchgate.<folder> with its sub-packages.
FOLDERS = ("server", "batcher", "clients", "bench", "protos")
# The example model repository: installed as data in batchgate/models/, beside the folders, so
# that a path relative to a folder's parent finds it in a checkout and in an install alike.
EXAMPLE_MODELS = "models"


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``batchgate.<folder>`` (``FOLDERS`` only) in one checkout's folders."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, folder = fullname.partition(".")
        if package != "batchgate" or folder not in FOLDERS:
            return None
        init = self.root / folder / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(self.root / folder)])


def is_checkout(package_dir: Path) -> bool:
    """Whether ``package_dir`` (``batchgate/``) lies in a repository checkout rather than an
    installed layout (which holds its sub-packages inside it)."""
    root = package_dir.parent
    return (not (package_dir / FOLDERS[0]).is_dir() and (root / "setup.py").is_file()
            and all((root / folder / "__init__.py").is_file() for folder in FOLDERS))


def install(package_dir: Path) -> bool:
    """Put a ``CheckoutFinder`` for ``package_dir``'s checkout first on ``sys.meta_path``
    (once); False, and nothing changed, outside a checkout."""
    if not is_checkout(package_dir):
        return False
    root = package_dir.parent
    if any(isinstance(f, CheckoutFinder) and f.root == root for f in sys.meta_path):
        return True
    # First: an editable install of another checkout must not serve this checkout's folders.
    sys.meta_path.insert(0, CheckoutFinder(root))
    return True
