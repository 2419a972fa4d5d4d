"""training.data.glyphs: the embedded glyph set, rendered from the installed fonts and cached."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.data.catalog import read_catalog
from training.data.glyphs import IMAGE_SIZE, build_glyph_dataset

CHARACTERS = "AB"
FACES = 3


def snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def glyph_dir(tmp_path_factory) -> Path:
    data_dir = tmp_path_factory.mktemp("glyphs") / "set"
    catalog_path = build_glyph_dataset(data_dir, characters=CHARACTERS, max_faces=FACES)
    assert catalog_path == data_dir / "catalog.csv"
    return data_dir


def test_catalog_columns_and_contents(glyph_dir):
    with (glyph_dir / "catalog.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert {"id", "path", "label", "font"} <= set(reader.fieldnames)
    assert reader.fieldnames[:3] == ["id", "path", "label"]
    assert len(rows) == len(CHARACTERS) * FACES
    assert {r["label"] for r in rows} == {"U+0041", "U+0042"}
    assert len({r["font"] for r in rows}) == FACES
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(not Path(r["path"]).is_absolute() for r in rows)  # the set can be moved
    catalog = read_catalog(glyph_dir / "catalog.csv")
    assert catalog.classes == ["U+0041", "U+0042"]
    assert not catalog.check_files()
    assert all(p.is_relative_to(glyph_dir) for p in catalog.paths)


def test_images_are_28x28_grey_glyphs(glyph_dir):
    catalog = read_catalog(glyph_dir / "catalog.csv")
    arrays = {}
    for item_id, path, label, meta in zip(catalog.ids, catalog.paths, catalog.labels, catalog.metadata, strict=True):
        with Image.open(path) as image:
            assert image.size == (IMAGE_SIZE, IMAGE_SIZE) == (28, 28)
            assert image.mode == "L"
            arrays[(label, meta["font"])] = np.asarray(image)
        assert arrays[(label, meta["font"])].max() > 128, item_id  # something was drawn
        assert (arrays[(label, meta["font"])] > 0).mean() < 0.6, item_id  # not a filled box
    fonts = sorted({font for _, font in arrays})
    # Different characters in one face differ; one character differs between faces.
    assert not np.array_equal(arrays[("U+0041", fonts[0])], arrays[("U+0042", fonts[0])])
    assert not np.array_equal(arrays[("U+0041", fonts[0])], arrays[("U+0041", fonts[1])])


def test_second_call_reuses_the_cache(glyph_dir):
    before = snapshot(glyph_dir)
    assert build_glyph_dataset(glyph_dir, characters=CHARACTERS, max_faces=FACES) == (glyph_dir / "catalog.csv")
    assert snapshot(glyph_dir) == before


def test_a_missing_image_triggers_a_re_render(glyph_dir):
    catalog = read_catalog(glyph_dir / "catalog.csv")
    victim = catalog.paths[3]
    with Image.open(victim) as image:
        original = np.asarray(image)
    before = snapshot(glyph_dir)
    victim.unlink()
    build_glyph_dataset(glyph_dir, characters=CHARACTERS, max_faces=FACES)
    assert victim.is_file()
    with Image.open(victim) as image:
        np.testing.assert_array_equal(np.asarray(image), original)  # deterministic rendering
    after = snapshot(glyph_dir)
    assert after.keys() == before.keys()
    assert after["catalog.csv"] != before["catalog.csv"]  # the whole set was re-published
    assert not [p for p in glyph_dir.parent.iterdir() if p.name.startswith(".")]  # no debris


def test_no_usable_fonts_is_a_clear_error(tmp_path):
    (tmp_path / "fonts").mkdir()
    with pytest.raises(RuntimeError, match="apt-get install fonts-"):
        build_glyph_dataset(tmp_path / "set", characters="AB", font_dirs=[tmp_path / "fonts"])
    assert not (tmp_path / "set").exists()


def test_grown_glyphs_repeat_pairs_with_jitter():
    from training.data.glyphs import ACCENTED_LATIN, CHARACTERS, discover_faces, render_grown_glyphs

    faces = discover_faces(max_faces=2)
    chars = "Aé"
    first = list(render_grown_glyphs(4, characters=chars, faces=faces, chunk=3))
    assert [len(labels) for _, labels in first] == [3, 1]  # chunked
    images = np.concatenate([x for x, _ in first])
    labels = sum((labels for _, labels in first), [])
    assert images.shape == (4, 1, 28, 28) and images.dtype == np.float32 and images.max() <= 1.0
    assert labels == ["U+0041", "U+00E9", "U+0041", "U+00E9"]  # every (face, character), face by face
    more = np.concatenate([x for x, _ in render_grown_glyphs(8, characters=chars, faces=faces)])
    assert np.array_equal(more[:4], images)  # the first pass is the plain rendering
    assert not np.array_equal(more[4:], images)  # later passes are jittered
    assert not set(ACCENTED_LATIN) & set(CHARACTERS) and "é" in ACCENTED_LATIN
