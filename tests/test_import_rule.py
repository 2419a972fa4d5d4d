"""The layering rule: `core` is the bottom layer (it imports neither torch nor `training`, `index`
or `serving`), and `index` and `serving` import without torch, so a serving image has none.

Each check runs in a fresh interpreter (this test process may already have torch loaded). Every
module under core/, index/ and serving/ is found with pkgutil, so modules added later are covered
too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NAMED = [
    "core",
    "core.artifacts",
    "core.catalog",
    "core.cli",
    "core.config",
    "core.items",
    "core.metrics",
    "core.preprocess",
    "core.progress",
    "core.registry",
    "core.vectors",
    "index",
    "index.build",
    "index.embedder",
    "index.faiss_index",
    "core.artifacts",
    "core.catalog",
    "core.preprocess",
    "core.metrics",
    "core.items",
    "core.config",
    "core.cli",
]

IMPORT_ALL = """
import importlib, json, pkgutil, sys
from pathlib import Path

BLOCK = {block!r}
if BLOCK:
    class NoTorch:
        # Acts as if torch were not installed at all.
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "torchvision"):
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, NoTorch())

imported = []
for name in {named!r}:
    importlib.import_module(name)
    imported.append(name)
packages = {packages!r}
for package in packages:
    module = importlib.import_module(package)
    imported.append(package)
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})
torch_importable = None
if BLOCK:
    try:  # the blocker really hides torch (so the blocked run is not vacuous)
        import torch  # noqa: F401
        torch_importable = True
    except ModuleNotFoundError:
        torch_importable = False
print(json.dumps({{"imported": imported, "heavy": heavy, "torch_importable": torch_importable}}))
"""


TORCH = ("torch", "torchvision")


def run_imports(
    block_torch: bool,
    named: list[str] = NAMED,
    packages: tuple[str, ...] = ("core", "index", "serving"),
    forbidden: tuple[str, ...] = TORCH,
) -> dict:
    code = textwrap.dedent(
        IMPORT_ALL.format(block=block_torch, named=named, packages=list(packages), forbidden=forbidden)
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected_modules(packages: tuple[str, ...] = ("core", "index", "serving")) -> set[str]:
    found = set()
    for package in packages:
        found.add(package)
        for path in (REPO / package).rglob("*.py"):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if all((REPO.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
                found.add(".".join(parts))
    return found


def test_index_and_serving_import_without_loading_torch():
    result = run_imports(block_torch=False)
    assert result["heavy"] == []
    imported = set(result["imported"])
    assert set(NAMED) <= imported
    assert expected_modules() <= imported  # every module file was actually imported


def test_index_and_serving_import_when_torch_is_not_installed():
    result = run_imports(block_torch=True)
    assert result["torch_importable"] is False
    assert result["heavy"] == []
    assert expected_modules() <= set(result["imported"])


def test_core_imports_nothing_above_it_and_no_torch():
    core_named = [name for name in NAMED if name.split(".")[0] == "core"]
    result = run_imports(
        block_torch=True, named=core_named, packages=("core",), forbidden=(*TORCH, "training", "index", "serving")
    )
    assert result["heavy"] == []
    assert expected_modules(("core",)) <= set(result["imported"])
