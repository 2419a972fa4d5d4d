"""benchmarks/bench_backbones.py runs as a module and measures what its table says: a torchvision
CNN with the installed weights and a timm ViT with random ones, small and quick."""

from __future__ import annotations

import json

from benchmarks import bench_backbones
from tests.support.timm import register_tiny

register_tiny()


def test_the_cost_table_measures_each_backbone(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = bench_backbones.main(
        ["--backbones", "mobilenet_v2,tiny_vit_s16", "--image-size", "32", "--runs-1", "1", "--runs-32", "1",
         "--parity-images", "4", "--no-icons", "--json", str(out)]
    )  # fmt: skip
    assert [r["backbone"] for r in rows] == ["mobilenet_v2", "tiny_vit_s16"]
    mobilenet, vit = rows
    assert mobilenet["weights"] == bench_backbones.MOBILENET and mobilenet["embedding_dim"] == 1280
    assert vit["weights"].startswith("random") and vit["embedding_dim"] == 64 and vit["pooling"] == "cls"
    for row in rows:
        assert row["parity"]["min_cosine"] >= 0.9999 and row["parity"]["source"] == "random pixels"
        assert row["cpu_ms_per_image_b1"] > 0 and row["cpu_ms_per_image_b32"] > 0 and row["onnx_mb"] > 0
        assert row["zero_shot_recall_at_1"] is None  # no icon set asked for
    assert json.loads(out.read_text()) == rows
    printed = capsys.readouterr().out
    assert "| tiny_vit_s16 | tiny_vit_s16 | 32 |" in printed and "— (no weights installed)" in printed
    assert "— (no icon set)" in printed  # mobilenet_v2 has weights, but nothing to measure R@1 on


def test_the_default_run_is_short_and_all_means_every_registered_backbone():
    assert bench_backbones.parse_args([]).names == list(bench_backbones.DEFAULT)
    assert bench_backbones.parse_args(["--quick"]).names == list(bench_backbones.QUICK)
    every = bench_backbones.parse_args(["--all"]).names
    assert "vit_small_patch14_dinov2" in every and "resnet50" in every and "small_cnn" not in every
