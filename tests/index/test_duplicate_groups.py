"""`index duplicates` on a synthetic version, in seconds: what groups.png and the summary say of
a group, and the warning when a threshold chains different images into one."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
from PIL import Image

from core.artifacts.index_manifest import RowCounts
from core.data.items import ItemTable
from index.build.config import BuildConfig
from index.build.contact_sheet import CAPTION, PAD, THUMB
from index.build.duplicates import CHAINING_MEMBERS, SHEET_MEMBERS, DuplicatesConfig, run_duplicates
from index.build.publish import NewVersion, publish_index_version

DIM, CHAIN, OTHERS = 16, 60, 200
STEP = np.radians(2.0)  # cosine 0.9994 between neighbours along the chain; its ends are 118° apart


def publish_chain(root: Path) -> None:
    """A chain of CHAIN vectors each 2° from the next (every one a near-duplicate of its
    neighbours only at 0.998), a pair of copies, and OTHERS unrelated vectors."""
    rng = np.random.default_rng(0)
    angles = STEP * np.arange(CHAIN)
    chain = np.zeros((CHAIN, DIM), np.float32)
    chain[:, 0], chain[:, 1] = np.cos(angles), np.sin(angles)
    others = rng.standard_normal((OTHERS, DIM)).astype(np.float32)
    others[:, :2] = 0  # far from the chain's plane
    pair = others[:1] + 0.001 * rng.standard_normal((1, DIM)).astype(np.float32)
    vectors = np.concatenate([chain, others, pair])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    n = len(vectors)
    items = ItemTable(
        [f"folder/{i}.png" for i in range(n)], None, [f"/nonexistent/{i}.png" for i in range(n)], [{}] * n
    )
    cfg = BuildConfig(model=str(root / "model"), index_root=str(root))
    new = NewVersion("model-a", vectors, items, root / "c.csv", RowCounts(n, n), time.perf_counter(), 0)
    publish_index_version(
        new, cfg.index_recipe, cfg.gate_thresholds, cfg.probe, cfg.filterable_fields, cfg.item_field, cfg.publish_target
    )


def test_a_chaining_threshold_is_reported_and_groups_png_says_what_each_row_is(tmp_path, caplog):
    publish_chain(tmp_path)
    with caplog.at_level(logging.INFO, logger="index.build.duplicates"):
        out = run_duplicates(DuplicatesConfig(index_root=str(tmp_path), min_score=0.998), progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups"] == 2 and summary["largest_group"] == CHAIN >= CHAINING_MEMBERS
    assert summary["largest_group_least_cosine_to_lead"] < 0  # the chain's far end: a different image
    assert f"the largest {CHAIN} members" in caplog.text
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"the largest group has {CHAIN} members" in warning and "try a higher --min-score" in warning

    with Image.open(out / "groups.png") as sheet:
        cell_w, cell_h = THUMB + 2 * PAD, THUMB + 2 * PAD + 2 * CAPTION  # score and id under each tile
        # Two groups: the lead, 8 members and a column for "+51 more"; ids under every tile.
        assert sheet.size == ((SHEET_MEMBERS + 2) * cell_w, 2 * cell_h)
        note = np.asarray(sheet.convert("L").crop(((SHEET_MEMBERS + 1) * cell_w, 0, sheet.width, cell_h)))
        assert (note < 128).any()


def test_copies_alone_raise_no_warning(tmp_path, caplog):
    publish_chain(tmp_path)
    with caplog.at_level(logging.INFO, logger="index.build.duplicates"):
        out = run_duplicates(DuplicatesConfig(index_root=str(tmp_path), min_score=0.99999), progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["largest_group"] == 2 and summary["largest_group_least_cosine_to_lead"] > 0.99999
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
