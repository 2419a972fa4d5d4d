"""The committed generated code must match what `make protos` produces from the .proto files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], cwd=ROOT, check=True, env=env)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.is_file(), f"{rel} is generated but not committed; run `make protos`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale; run `make protos`"
