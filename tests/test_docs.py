"""The docs hold together: the reference tables equal their definitions, every link resolves.

The flag and parameter tables of docs/configuration.md are generated (``python -m
batchgate.server.config.reference --write``); a flag or key added without regenerating them fails here. Every
relative link of the Markdown files points at a file (and heading) that exists, every ``.md``
path the code names exists, and no docstring carries a dated measurement.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from batchgate.server.config import reference
from batchgate.server.config.model_parameters import PARAMETERS, TRITON_PARAMETERS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
CODE_FOLDERS = ("server", "batcher", "clients", "bench", "models")


def tracked(pattern: str) -> list[Path]:
    """The repository's tracked files (and new ones not ignored) matching a git pathspec; in a
    copy without git, the files under the root outside virtual environments and builds."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                              "--", pattern], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", "build", ".git", ".tools", ".pytest_cache", "node_modules"}
        folder, _, name = pattern.rpartition("/")
        found = (ROOT / folder).rglob(name) if folder else ROOT.rglob(name)
        return sorted(p for p in found
                      if p.is_file() and not skip & set(p.relative_to(ROOT).parts))
    return sorted({ROOT / line for line in out.splitlines() if (ROOT / line).is_file()})


MARKDOWN = tracked("*.md")


@pytest.mark.parametrize("table", reference.TABLES)
def test_the_reference_tables_are_generated_from_their_definitions(table):
    documented = reference.documented(CONFIGURATION, table)
    assert documented is not None, f"docs/configuration.md lacks the {table} table's markers"
    assert documented == reference.generated(table), (
        f"docs/configuration.md's {table} table differs from its definition: run "
        "python -m batchgate.server.config.reference --write")


def test_the_tables_name_every_flag_and_key():
    flags = reference.documented(CONFIGURATION, "flags")
    parameters = reference.documented(CONFIGURATION, "parameters")
    for flag in ("--grpc-port", "--frontend", "--admin-token-file", "--no-reflection",
                 "--device-pool-permissive"):
        assert f"| `{flag}` |" in flags
    missing = [key for key in [*PARAMETERS, *TRITON_PARAMETERS]
               if f"| `{key}` |" not in parameters]
    assert not missing, f"the parameters table lacks {missing}"


def test_rewrite_replaces_a_stale_table_and_keeps_the_rest():
    begin, end = reference.markers("flags")
    text = CONFIGURATION.replace(reference.documented(CONFIGURATION, "flags"), "| stale |")
    assert reference.documented(text, "flags") == "| stale |"

    rewritten = reference.rewrite(text)
    assert rewritten == CONFIGURATION
    assert reference.rewrite(rewritten) == rewritten
    with pytest.raises(ValueError, match="lacks the markers of the flags table"):
        reference.rewrite(text.replace(begin, ""))


def test_readme_gives_the_two_commands():
    assert "make serve" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_for_users_and_short():
    assert len(README.splitlines()) <= 300
    for section in ("## The two commands", "## Calling it", "## Headline figures",
                    "## Documentation"):
        assert section in README


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, links and code marks dropped, punctuation
    but ``-`` and ``_`` removed, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        base = slug(line.lstrip("#"))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_slug_follows_github():
    assert slug("`python -m batchgate.bench.deadline_sim`: the same comparison on a simulated clock") == \
        "python--m-batchgatebenchdeadline_sim-the-same-comparison-on-a-simulated-clock"
    assert slug("## `parameters` keys".lstrip("#")) == "parameters-keys"
    assert slug("Goodput at 5 × capacity") == "goodput-at-5--capacity"


def test_every_relative_link_resolves():
    assert ROOT / "README.md" in MARKDOWN and len([p for p in MARKDOWN if "docs" in p.parts]) > 5
    broken = []
    for path in MARKDOWN:
        for target in links(path):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_name_only_documents_in_the_repository():
    """Every ``something.md`` the code or the docs name is a file of the repository."""
    sources = MARKDOWN + [p for folder in CODE_FOLDERS for p in tracked(f"{folder}/*.py")]
    missing = []
    for path in sources:
        for name in re.findall(r"[\w./-]*[A-Za-z_-]\.md\b", path.read_text()):
            name = name.lstrip("./") if name.startswith("./") else name
            if not any((base / name).exists() for base in (ROOT, path.parent)):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "documents that are not in the repository:\n" + "\n".join(missing)


def test_no_docstring_or_comment_carries_a_date():
    """Dated measurements belong in docs/benchmarks.md, whose tables say their date; code says
    why, not when."""
    dated = []
    for folder in CODE_FOLDERS:
        for path in tracked(f"{folder}/*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\b20\d\d-\d\d-\d\d\b", line):
                    dated.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not dated, "dated lines:\n" + "\n".join(dated)


BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def benchmark_sections() -> dict[str, list[str]]:
    """docs/benchmarks.md's ``## `` sections: heading -> its lines (fenced blocks included)."""
    sections: dict[str, list[str]] = {}
    heading, in_code = None, False
    for line in BENCHMARKS.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("## "):
            heading = line[3:]
            sections[heading] = []
        elif heading is not None:
            sections[heading].append(line)
    return sections


def runnable_benchmarks() -> list[str]:
    """The command of every benchmark in bench/: ``python -m batchgate.bench.NAME`` for each
    module or package that runs as a program, ``batchgate bench`` for the load generator."""
    bench = ROOT / "bench"
    names = [p.stem for p in sorted(bench.glob("*.py"))
             if 'if __name__ == "__main__"' in p.read_text()]
    names += [p.parent.name for p in sorted(bench.glob("*/__main__.py"))]
    return sorted("batchgate bench" if name == "loadgen" else f"python -m batchgate.bench.{name}"
                  for name in names)


def test_every_benchmark_has_a_section_with_its_command():
    sections = benchmark_sections()
    commands = runnable_benchmarks()
    assert "python -m batchgate.bench.serving" in commands and "batchgate bench" in commands
    missing = [c for c in commands if not any(h.startswith(f"`{c}`") for h in sections)]
    assert not missing, f"benchmarks without a section in docs/benchmarks.md: {missing}"
    for heading, lines in sections.items():
        command = heading.split("`")[1]
        blocks = re.findall(r"```.*?```", "\n".join(lines), flags=re.S)
        shown = command.replace("python -m ", "")
        assert any(shown in block or "gpu-check.sh" in block for block in blocks), \
            f"{heading}: no code block gives its command"


def test_each_benchmark_keeps_one_latest_run_dated_on_a_named_machine():
    """The page is a manual: per benchmark one latest run, with its date and machine, and at
    most one table of figures; no dated figures elsewhere (earlier runs live in git)."""
    for heading, lines in benchmark_sections().items():
        subsections = [i for i, line in enumerate(lines) if line.startswith("### ")]
        latest = [i for i in subsections if lines[i] == "### Latest run"]
        assert len(latest) == 1, f"{heading}: {len(latest)} '### Latest run' subsections"
        start = latest[0]
        end = next((i for i in subsections if i > start), len(lines))
        run, rest = lines[start + 1:end], lines[:start] + lines[end:]
        text = "\n".join(run)
        assert DATE.search(text), f"{heading}: its latest run has no date"
        assert re.search(r"\bVM\b|GPU", text), f"{heading}: its latest run names no machine"
        outside_fences = re.sub(r"```.*?```", "", text, flags=re.S)
        tables = len(re.findall(r"^\|[-| :]+\|$", outside_fences, flags=re.M))
        assert tables <= 1, f"{heading}: {tables} tables in its latest run"
        assert tables == 1 or "```" in text, f"{heading}: its latest run has no figures"
        dated = [line for line in rest if DATE.search(line)]
        assert not dated, f"{heading}: dated lines outside its latest run: {dated}"
