"""The README documents every setting: each CLI flag and each config parameter key."""

from __future__ import annotations

import argparse
from pathlib import Path

from server import cli
from server.model_parameters import PARAMETERS, TRITON_PARAMETERS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def serve_flags() -> list[str]:
    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    return [opt for action in parser._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"]


def test_every_flag_is_documented():
    missing = [flag for flag in serve_flags() if f"`{flag}`" not in README]
    assert not missing, f"README lacks flags {missing}"


def test_every_parameter_key_is_documented():
    missing = [key for key in [*PARAMETERS, *TRITON_PARAMETERS] if f"`{key}`" not in README]
    assert not missing, f"README lacks parameter keys {missing}"


def test_readme_gives_the_two_commands():
    assert "make serve" in README and "make test" in README
    assert "make test" in (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
