"""docs/configuration.md is generated from the option schemas and must match them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_matches_the_option_schemas():
    done = subprocess.run(
        [sys.executable, "scripts/gen_config_doc.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_flag_of_a_command_is_in_the_reference():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_config_doc

    from core.config import options

    text = (ROOT / "docs" / "configuration.md").read_text()
    for command, _, cls, exclude in gen_config_doc.command_tables():
        section = text.split(f"## `{command}`", 1)[1].split("\n## ", 1)[0]
        for opt in options(cls):
            if opt.name not in exclude and opt.cli:
                assert f"`{opt.flag}`" in section, (command, opt.flag)
