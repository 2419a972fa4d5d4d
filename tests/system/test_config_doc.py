"""docs/configuration.md is generated from the option schemas and must match them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_matches_the_option_schemas():
    done = subprocess.run(
        [sys.executable, "-m", "scripts.gen_config_doc", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_flag_of_a_command_is_in_the_reference():
    from core.config import options
    from scripts import gen_config_doc

    text = (ROOT / "docs" / "configuration.md").read_text()
    for command, _, cls, exclude in gen_config_doc.command_tables():
        section = text.split(f"## `{command}`", 1)[1].split("\n## ", 1)[0]
        for opt in options(cls):
            if opt.name not in exclude and opt.cli:
                assert f"`{opt.flag}`" in section, (command, opt.flag)


def test_every_command_has_a_section_and_every_argument_a_row():
    """Commands whose flags are plain argparse arguments (`serving query`, `index list`, …) too."""
    from scripts import gen_config_doc

    text = (ROOT / "docs" / "configuration.md").read_text()
    plain = gen_config_doc.plain_commands()
    assert {
        "simsearch query",
        "simsearch info",
        "simsearch index list",
        "simsearch index rollback",
    } <= {command for command, _, _ in plain}
    for command, _, parser in plain:
        section = text.split(f"## `{command}`", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--verbose"):
                    assert f"`{flag}`" in section, (command, flag)
