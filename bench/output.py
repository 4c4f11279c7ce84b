"""What a benchmark's command prints: progress lines on stderr, its table on stdout, its report
as JSON where asked (``--json``), the same way for every benchmark in ``bench/``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def progress(name: str) -> Callable[[str], None]:
    """A function printing ``[name] message`` lines on stderr as the run goes."""

    def say(message: str) -> None:
        print(f"[{name}] {message}", file=sys.stderr, flush=True)

    return say


def emit(report: dict[str, Any], render: Callable[[dict[str, Any]], str],
         json_path: Path | None) -> int:
    """Print ``render(report)``, write ``report`` to ``json_path`` when given; exit status 0.
    Values JSON has no type for (paths, for one) are written as their text."""
    print(render(report))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return 0
