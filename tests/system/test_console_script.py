"""`simsearch`, the one command `pip install` puts on PATH (issue 63): installed from this tree as
pip installs the project, it runs each package's commands (`simsearch index --help`, `simsearch
serve --help`) from outside the checkout, and a command it does not know is one error line and
exit code 2."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def simsearch(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The installed `simsearch` script, run with this venv's packages under the installed copy.
    Installed from a copy of the packages pyproject.toml names, so no build output lands in the
    checkout, and into a folder of its own, so the venv's own install is left as it is."""
    tmp = tmp_path_factory.mktemp("console-script")
    source = tmp / "source"
    source.mkdir()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for path in ROOT.iterdir():
        if path.is_dir() and any(fnmatch.fnmatch(path.name, p) for p in patterns):
            shutil.copytree(path, source / path.name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    site = tmp / "site"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-compile"]
    proc = subprocess.run(
        [*install, "--target", str(site), str(source)], cwd=tmp, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return site / "bin" / "simsearch", {**os.environ, "PYTHONPATH": str(site)}


def run(simsearch: tuple[Path, dict[str, str]], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    script, env = simsearch
    return subprocess.run([script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args, says",
    [
        (("index", "--help"), "{build,rebuild,add,remove,compact,duplicates,list,rollback}"),
        (("index", "build", "--help"), "--index-root"),
        (("serve", "--help"), "--watch-current"),
        (("query", "--help"), "--text PHRASE"),
    ],
)
def test_each_command_runs_from_the_installed_script(simsearch, tmp_path, args, says):
    proc = run(simsearch, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: ") and says in proc.stdout


def test_an_unknown_command_is_one_error_line_and_exit_2(simsearch, tmp_path):
    proc = run(simsearch, "trian", "--epochs", "3", cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "error: unknown command 'trian'; did you mean train? the commands are data, train, train-text, "
        "benchmark, export, index, serve, query, info\n"
    )
    listed = run(simsearch, "--help", cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.startswith("usage: simsearch COMMAND")
    bare = run(simsearch, cwd=tmp_path)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: simsearch COMMAND")
