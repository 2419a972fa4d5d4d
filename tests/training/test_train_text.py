"""training train-text: a LiT text tower against a locked image model.

The image model is `write_tiny_model`'s fixed random projection of the pixels (no training: LiT
never changes it), exported with training splits of a small glyph set, so the default path — the
model's own training and test classes — is the one tested. The fast tests run the steps in this
process; the slow ones run the command on a real local Ray."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.artifacts.model_manifests import ModelManifest
from core.data.catalog import read_catalog
from tests.support import ROOT
from tests.support.index import write_tiny_model
from tests.support.training import finish, kill_run, output_of_run, start_training, wait_for_checkpoint
from training.data.glyphs import CHARACTERS, build_glyph_dataset, character_name
from training.data.icons import icon_caption
from training.losses.image_text import ImageTextContrastiveLoss
from training.models.text_models import build_lit_tower
from training.runs.trainable import Trainable
from training.text.text_config import TrainTextConfig
from training.text.text_data import DistinctCaptionBatches, heldout_rows, label_caption, prepare_data
from training.text.text_evaluation import chance_recall, embed_texts, reading, text_to_image_recall
from training.text.train_text import RUN_CHECKPOINT, RUN_KEYS, build_optimizer, load_text_run, train_one_epoch

CLASSES, FACES = 24, 12  # 10 train + 2 val classes (seen), 12 test classes (unseen)
SMALL_TOWER = ["--tower-width", "64", "--tower-layers", "2", "--context-length", "16", "--batch-size", "12"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A locked image model whose manifest names train/val/test splits of a small glyph set."""
    root = tmp_path_factory.mktemp("lit")
    catalog = read_catalog(build_glyph_dataset(root / "glyphs", characters=CHARACTERS[:CLASSES], max_faces=FACES))
    classes = catalog.classes
    parts = {"train": classes[:10], "val": classes[10:12], "test": classes[12:]}
    splits = {n: str(catalog.with_classes(c).write(root / "splits" / f"{n}.csv")) for n, c in parts.items()}
    out = write_tiny_model(root / "model", dim=32, side=24)
    manifest = ModelManifest.read(out)
    dataclasses.replace(manifest, training_data={"catalog": "glyphs", "splits": splits}).write(out)
    return out


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training", "train-text", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


# --- captions, batches, held-out images, the loss: no Ray -----------------------------------------


def test_captions_are_the_labels_names():
    assert character_name("U+0041") == "LATIN CAPITAL LETTER A"
    assert label_caption("U+0416") == "CYRILLIC CAPITAL LETTER ZHE"
    assert label_caption("U+0026") == "AMPERSAND"
    assert icon_caption("document-open") == label_caption("document-open") == "document open"
    assert label_caption("accessories_text-editor") == "accessories text editor"
    with pytest.raises(ValueError, match="no Unicode name"):
        character_name("U+0378")  # unassigned


def test_a_step_holds_distinct_captions_one_image_each():
    row_texts = np.repeat(np.arange(7), [1, 2, 3, 4, 5, 6, 7])
    batches = DistinctCaptionBatches(row_texts, batch_size=5, steps=30, seed=3)
    steps = list(batches.epoch(0))
    assert len(steps) == len(batches) == 30
    for texts, rows in steps:
        assert len(texts) == len(set(texts.tolist())) == 5
        assert (row_texts[rows] == texts).all()
    assert {t for texts, _ in steps for t in texts.tolist()} == set(range(7))
    again = list(batches.epoch(0))  # a resumed run draws what an unbroken one would have
    assert all((a[1] == b[1]).all() for a, b in zip(steps, again, strict=True))
    assert DistinctCaptionBatches(row_texts, batch_size=64, steps=1, seed=0).batch_size == 7


def test_heldout_images_are_a_seeded_fraction_of_each_class(model):
    catalog = read_catalog(ModelManifest.read(model).training_data["splits"]["train"])
    held = heldout_rows(catalog, 0.25, seed=0)
    labels = np.asarray(catalog.labels)
    for label in catalog.classes:
        assert held[labels == label].sum() == 3  # of 12 faces
    assert (heldout_rows(catalog, 0.25, seed=0) == held).all()
    assert not (heldout_rows(catalog, 0.25, seed=1) == held).all()
    one_each = catalog.subset([catalog.labels.index(c) for c in catalog.classes])
    assert not heldout_rows(one_each, 0.5, seed=0).any()  # a class's only image trains


def test_contrastive_loss_is_clip_symmetric_cross_entropy():
    torch.manual_seed(0)
    text, image = torch.randn(6, 8), torch.randn(6, 8)
    loss_fn = ImageTextContrastiveLoss(temperature=0.1)
    logits = 10 * torch.nn.functional.normalize(text, dim=1) @ torch.nn.functional.normalize(image, dim=1).T
    target = torch.arange(6)
    expected = (
        torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(logits.T, target)
    ) / 2
    loss = loss_fn(text, image)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert loss_fn.logit_scale.grad is not None  # the temperature is learned
    assert loss_fn(image, image) < loss_fn(text, image)
    assert loss_fn.temperature == pytest.approx(0.1)
    with pytest.raises(ValueError, match="paired"):
        loss_fn(text, image[:5])


def test_chance_recall_of_a_random_ranking():
    gallery = np.array([0, 0, 1, 2])
    chance = chance_recall(np.array([0, 1]), gallery, [1, 2, 4])
    assert chance[1] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert chance[2] == pytest.approx((1 - (2 / 4) * (1 / 3) + 1 - (3 / 4) * (2 / 3)) / 2)
    assert chance[4] == 1.0


def test_a_reading_says_what_the_figures_mean_against_chance():
    """train-text prints beside its figures a line that reads them against chance (issue 63)."""
    chance = {1: 0.001, 5: 0.005}
    assert reading("unseen", {1: 0.08, 5: 0.2}, chance, 961) == (
        "unseen: R@1 0.080 against 0.001 by chance (80×) on 961 classes' names it never saw"
        " — well above chance but weak: the right image is in the top few only sometimes"
    )
    assert reading("seen", {1: 0.0012, 5: 0.006}, chance, 950).endswith(
        "names it trained on — no better than chance: it has not learnt these words"
    )
    assert reading("seen", {1: 0.9, 5: 1.0}, chance, 950).endswith("— a useful ranker of these words")


def test_steps_in_process_put_captions_near_their_images(model, tmp_path):
    """The worker's own steps, without Ray: seen-class Recall@1 climbs far above chance."""
    cfg = TrainTextConfig(model=str(model), tower_width=64, tower_layers=2, context_length=16, batch_size=12, lr=1e-3)
    data, texts, catalogs = prepare_data(cfg, ModelManifest.read(model), tmp_path)
    train_classes = read_catalog(ModelManifest.read(model).training_data["splits"]["train"]).classes
    assert {label_caption(c) for c in train_classes} <= set(texts)
    assert len(data.galleries["seen"].query_texts) == 12 and len(data.galleries["unseen"].query_texts) == 12
    assert len(data.train_texts) + len(data.galleries["seen"].labels) == 12 * FACES
    assert read_catalog(tmp_path / "captions" / "unseen.csv").metadata[0]["caption"].startswith(("LATIN", "DIGIT"))

    torch.manual_seed(0)
    net = build_lit_tower(data.embedding_dim, cfg.spec)
    loss_fn = ImageTextContrastiveLoss()
    batches = DistinctCaptionBatches(data.train_texts, cfg.batch_size, 40, cfg.seed)
    trainable = Trainable(net, loss_fn, *build_optimizer(cfg, net, loss_fn, 3 * len(batches)))
    before = text_to_image_recall(net, data, [1])["seen"][1]
    losses = [np.mean(train_one_epoch(trainable, data, batches, epoch, torch.device("cpu"))[0]) for epoch in range(3)]
    after = text_to_image_recall(net, data, [1])["seen"][1]
    assert losses[-1] < losses[0]
    assert after >= 0.75 > before + 0.25, (before, after)
    assert np.allclose(np.linalg.norm(embed_texts(net, data.token_ids), axis=1), 1, atol=1e-5)


# --- the command's refusals: one error line, exit 2, before Ray starts ------------------------------


def test_a_missing_model_directory_is_refused(tmp_path):
    done = cli("--model", str(tmp_path / "nope"), "--out", str(tmp_path / "text"))
    assert done.returncode == 2
    assert f"error: --model {tmp_path / 'nope'}: no such directory" in done.stderr
    assert not (tmp_path / "text").exists() and not (tmp_path / ".text.work").exists()


def test_an_unknown_caption_field_is_refused_naming_the_columns(model, tmp_path):
    done = cli("--model", str(model), "--caption-field", "title", "--out", str(tmp_path / "text"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: --caption-field title:" in done.stderr
    assert "has no such column; its columns: id, path, label, character, font" in done.stderr
    assert not (tmp_path / ".text.work").exists()  # nothing left to --resume


def test_a_catalog_with_an_empty_caption_is_refused_naming_the_row(model, tmp_path):
    catalog = read_catalog(ModelManifest.read(model).training_data["splits"]["train"])
    catalog.metadata = [
        {**m, "caption": "" if row == 4 else f"glyph {m['character']}"} for row, m in enumerate(catalog.metadata)
    ]
    path = catalog.write(tmp_path / "captioned.csv")
    done = cli(
        "--model", str(model), "--catalog", str(path), "--caption-field", "caption", "--out", str(tmp_path / "t")
    )
    assert done.returncode == 2
    assert f"error: {path} (--catalog): 1 of {len(catalog)} rows have an empty caption in column caption (row 5)" in (
        done.stderr
    )


def test_options_are_checked_with_their_names():
    with pytest.raises(ValueError, match=r"tower_width \(100\) must be a multiple of tower_heads \(3\)"):
        TrainTextConfig(tower_width=100, tower_heads=3)
    with pytest.raises(ValueError, match="heldout_fraction must be between 0 and 1, got 1"):
        TrainTextConfig(heldout_fraction=1)
    with pytest.raises(ValueError, match="context_length must be at least 3"):
        TrainTextConfig(context_length=2)


def test_a_caption_longer_than_the_context_is_refused(model, tmp_path):
    cfg = TrainTextConfig(model=str(model), context_length=4)
    with pytest.raises(ValueError, match=r"caption 'LATIN CAPITAL LETTER \w' is 6 tokens .* --context-length 4"):
        prepare_data(cfg, ModelManifest.read(model), tmp_path)


# --- the command on a real local Ray ------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_run(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("text") / "text"
    args = ["--model", str(model), "--epochs", "4", "--steps-per-epoch", "30", "--lr", "1e-3", *SMALL_TOWER]
    finish(start_training(out, *args, base=(), command="train-text"))
    return out


@pytest.mark.slow
def test_train_text_publishes_a_tower_that_finds_its_captions_images(model, text_run):
    results = json.loads((text_run / "results.json").read_text())
    seen, unseen = results["evaluation"]["seen"], results["evaluation"]["unseen"]
    assert (seen["classes"], seen["images"], seen["captions"]) == (12, 12 * 2, 12)  # 2 of 12 faces held out
    assert (unseen["classes"], unseen["images"]) == (12, 12 * FACES)
    assert seen["chance_recall_at_k"]["1"] == pytest.approx(1 / 12)
    assert seen["reading"].startswith(f"seen: R@1 {seen['recall_at_k']['1']:.3f} against 0.083 by chance")
    assert (results["train_images"], results["train_captions"]) == (12 * FACES - seen["images"], 12)
    assert seen["recall_at_k"]["1"] >= 0.5, seen  # chance: 0.083
    assert [row["epoch"] for row in results["history"]] == [-1, 0, 1, 2, 3]  # -1: the untrained tower
    assert results["history"][-1]["seen_recall_at_1"] == seen["recall_at_k"]["1"]
    assert {"text_training.png", "config.json", RUN_CHECKPOINT} <= {p.name for p in text_run.iterdir()}
    assert not text_run.with_name(".text.work").exists()

    state = torch.load(text_run / RUN_CHECKPOINT, map_location="cpu", weights_only=False)
    assert set(RUN_KEYS) <= set(state)
    run = load_text_run(text_run)
    assert run.image_model_id == ModelManifest.read(model).model_id and run.embedding_dim == 32
    assert run.spec.context_length == 16 and run.source["kind"] == "lit"
    assert "LATIN CAPITAL LETTER A" in run.parity_texts or len(run.parity_texts) == 24
    assert run.evaluation == results["evaluation"]
    ids = np.zeros((1, 16), np.int64)
    assert run.net(torch.from_numpy(ids)).shape == (1, 32)


@pytest.mark.slow
def test_train_text_says_how_far_the_embedding_is_in_a_log(text_run):
    """It printed nothing for 20 minutes while it embedded the catalog, its progress off by default
    (issue 63): in a log (not a terminal) each catalog's embedding says how far it got."""
    said = [
        line.split(" simsearch.progress: ", 1)[1]
        for line in output_of_run(text_run).splitlines()
        if " simsearch.progress: " in line
    ]
    for name, images in (("seen", 12 * FACES), ("unseen", 12 * FACES)):
        done = [
            line for line in said if line.startswith(f"train-text: embedding the {name} images: {images}/{images} img")
        ]
        assert len(done) == 1 and done[0].endswith("— done"), said


@pytest.mark.slow
def test_a_stopped_run_continues_with_resume(model, tmp_path):
    out = tmp_path / "text"
    args = ["--model", str(model), "--epochs", "5", "--steps-per-epoch", "150", *SMALL_TOWER]
    process = start_training(out, *args, base=(), command="train-text")
    wait_for_checkpoint(out, process, run="train-text")
    kill_run(process)
    assert not (out / "results.json").exists()
    finish(start_training(out, *args, "--resume", base=(), command="train-text"))
    results = json.loads((out / "results.json").read_text())
    assert [row["epoch"] for row in results["history"]] == [-1, 0, 1, 2, 3, 4]
    assert results["resumed"] and 1 <= results["resumed"][0]["at_epoch"] <= 4
    assert not math.isnan(results["history"][-1]["loss"])
