"""Every stage command answers bad input with one clear line and exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("training", "train", "--catalog", "/no/such/catalog.csv"), "catalog not found"),
        (("training", "train", "--epochs", "0"), "epochs must be positive"),
        (("training", "train", "--use-gpu", "maybe"), "invalid choice"),
        (("training", "train", "--backbone", "vgg99", "--catalog", "."), "unknown backbone"),
        (("training", "train", "--pretrained", "/no/weights.pth"), "pretrained weights file not found"),
        (("training", "train", "--pretrained", "pkg:no_such_pkg/w.pth"), "package 'no_such_pkg' is not installed"),
        (("training", "train", "--dataset", "cub", "--data-root", "/no/such/dir"), "needs data_root"),
        (("training", "train", "--dataset", "imagenet", "--data-root", "."), "unknown dataset 'imagenet'"),
        (("training", "train", "--warmup-epochs", "9", "--epochs", "3"), "warmup_epochs (9) must be fewer"),
        (("training", "train", "--resume", "--out", "/no/such/run"), "nothing to resume"),
        (("training", "benchmark", "--losses", "raw_vthm,nope"), "unknown loss 'nope'"),
        (("training", "benchmark", "--seeds", "0"), "seeds must be positive"),
        (("training", "export", "--run", "/no/such/run"), "no checkpoint.pt"),
        (("index", "build", "--model", "/no/such/model", "--index-root", "/tmp/x"), "not a published artifact"),
        (("index", "list", "--index-root", "/no/such/root"), "index root not found"),
        (("index", "rollback", "--index-root", "/no/such/root"), "index root not found"),
        (("serving", "serve", "--index-root", "/no/such/root"), "index root not found"),
        (("serving", "serve", "--workers", "0"), "workers must be positive"),
        (("serving", "serve", "--intra-op-threads", "-1"), "intra_op_threads must be positive"),
        (("serving", "serve", "--batch-streams", "0"), "batch_streams must be positive"),
        (("serving", "serve", "--inline-decode-pixels", "-1"), "inline_decode_pixels must be ≥ 0"),
        (("serving", "serve", "--event-loop", "trio"), "invalid choice"),
        (("serving", "query", "/no/such.png", "--k", "0"), "--k must be at least 1"),
    ],
)
def test_bad_input_is_one_clear_line(args, fragment):
    proc = run(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert fragment in proc.stderr


def test_bad_config_file_is_reported(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("epochs: [unclosed\n")
    proc = run("training", "train", "--config", str(config))
    assert proc.returncode == 2 and "cannot parse" in proc.stderr
    config.write_text("epoks: 3\n")
    proc = run("training", "train", "--config", str(config))
    assert proc.returncode == 2 and "unknown option(s) epoks" in proc.stderr


def test_every_command_has_help():
    for args in (
        ("training", "train"),
        ("training", "export"),
        ("index", "build"),
        ("serving", "serve"),
        ("serving", "query"),
    ):
        proc = run(*args, "--help")
        assert proc.returncode == 0 and "usage:" in proc.stdout
