"""neighbours.png: sample queries and their neighbours, framed by whether the labels agree."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from core.retrieval.vectors import l2_normalized
from index.build.contact_sheet import (
    CAPTION,
    PAD,
    QUERY,
    RIGHT,
    THUMB,
    WRONG,
    caption_font,
    caption_lines,
    contact_sheet,
    sample_neighbours,
)
from index.search.faiss_index import build_index

CELL_W, CELL_H = THUMB + 2 * PAD, THUMB + 2 * PAD + CAPTION


def frame_colour(sheet: Image.Image, column: int, row: int) -> tuple[int, int, int]:
    return sheet.getpixel((column * CELL_W + 2, row * CELL_H + 2 + THUMB // 2))


def test_frames_say_which_neighbours_share_the_query_label(tmp_path):
    paths = []
    for i, colour in enumerate([(255, 0, 0), (250, 10, 0), (0, 0, 255), (0, 10, 250)]):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.new("RGB", (40, 30), colour).save(paths[-1])
    (tmp_path / "broken.png").write_bytes(b"not an image")
    paths.append(str(tmp_path / "broken.png"))  # an unreadable item is a grey square, not a failure
    labels = ["red", "red", "blue", "blue", "blue"]
    rows = np.array([[1, 2, 4], [3, -1, -1]])
    scores = np.array([[0.9, 0.5, 0.4], [0.8, 0, 0]], dtype=np.float32)
    sheet = contact_sheet([paths[0], paths[2]], ["red", "blue"], rows, scores, paths, labels)
    assert sheet.size == (4 * CELL_W, 2 * CELL_H)
    assert frame_colour(sheet, 0, 0) == QUERY
    assert frame_colour(sheet, 1, 0) == RIGHT and frame_colour(sheet, 2, 0) == WRONG
    assert frame_colour(sheet, 1, 1) == RIGHT and frame_colour(sheet, 2, 1) == (255, 255, 255)  # no 2nd neighbour
    unlabelled = contact_sheet([paths[0]], None, rows[:1], scores[:1], paths, None)
    assert frame_colour(unlabelled, 1, 0) not in (RIGHT, WRONG)


def test_sample_queries_leave_themselves_out():
    vectors = l2_normalized(np.random.default_rng(0).normal(size=(50, 8)).astype(np.float32))
    picked, rows, scores = sample_neighbours(build_index(vectors, "Flat", device="cpu"), vectors, queries=12, depth=8)
    assert len(picked) == 12 and rows.shape == (12, 8)
    assert all(q not in r for q, r in zip(picked, rows, strict=True))
    assert (np.diff(scores, axis=1) <= 1e-6).all()


def test_rows_carry_titles_ids_and_what_they_leave_out(tmp_path):
    path = str(tmp_path / "0.png")
    Image.new("RGB", (40, 30), (255, 0, 0)).save(path)
    rows = np.array([[0, 0], [0, -1]])
    scores = np.array([[0.9, 0.8], [0.7, 0]], dtype=np.float32)
    sheet = contact_sheet(
        [path, path], None, rows, scores, [path], None,
        titles=["group 1 (385)", "group 2 (2)"], notes=["+382 more", ""], query_ids=["a/0.png", "b/1.png"],
        item_ids=["c/2.png"],
    )  # fmt: skip
    cell_h = CELL_H + CAPTION  # a second caption line: the id
    assert sheet.size == (4 * CELL_W, 2 * cell_h)  # query, two members, and a column of notes
    note = np.asarray(sheet.crop((3 * CELL_W, 0, 4 * CELL_W, cell_h)).convert("L"))
    assert (note < 128).any()  # "+382 more" is written beside the first row
    empty = np.asarray(sheet.crop((3 * CELL_W, cell_h, 4 * CELL_W, 2 * cell_h)).convert("L"))
    assert (empty == 255).all()  # the second row leaves nothing out
    id_line = np.asarray(sheet.crop((0, CELL_H, CELL_W, cell_h)).convert("L"))
    assert (id_line < 200).any()  # the query's id under its score line


def test_a_catalog_with_items_and_no_labels_is_framed_by_item(tmp_path):
    """neighbours.png of an index with an item field but no label was all grey (issue 40, item
    11): the item field defines a match, as for grouped answers and item Recall@K."""
    from core.artifacts import layout as artifacts
    from core.data.items import ItemTable
    from tests.support.index import write_catalog_index

    root = write_catalog_index(tmp_path)  # 12 items of 2 images each, an `item` column, no labels
    version = artifacts.version_dir(root)
    table = ItemTable.read(version / artifacts.ITEMS_FILE)
    assert not table.labelled
    sheet = Image.open(version / artifacts.NEIGHBOURS_FILE).convert("RGB")
    frames = [frame_colour(sheet, column, row) for row in range(12) for column in range(1, 9)]
    assert set(frames) <= {RIGHT, WRONG}, set(frames)  # no grey: every neighbour is judged
    assert RIGHT in frames and WRONG in frames


def test_a_long_label_is_wrapped_to_fit_its_tile_not_cut(tmp_path):
    """`label 0035-fe0f-` was all a row showed of `0035-fe0f-20e3` (issue 63): a caption is wrapped
    to the tile's width, whole, and the rows grow to hold it."""
    font, width = caption_font(), THUMB + PAD
    label = "0035-fe0f-20e3"
    lines = caption_lines(f"label {label}", font, width)
    assert lines == ["label", label] or "".join(lines).replace(" ", "") == f"label{label}", lines
    assert all(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(line, font=font) <= width for line in lines)
    long = caption_lines("x" * 200, font, width, most=2)
    assert len(long) == 2 and long[-1].endswith("…") and all(font.getlength(line) <= width for line in long)

    path = str(tmp_path / "0.png")
    Image.new("RGB", (40, 30), (255, 0, 0)).save(path)
    rows, scores = np.array([[0]]), np.array([[0.9]], dtype=np.float32)
    sheet = contact_sheet([path], [label], rows, scores, [path], [label])
    assert sheet.size == (2 * CELL_W, CELL_H + (len(lines) - 1) * CAPTION)
    last_line = sheet.crop((PAD, CELL_H - CAPTION + (len(lines) - 1) * CAPTION, CELL_W, sheet.size[1]))
    assert np.asarray(last_line.convert("L")).min() < 128  # the label's end is drawn, under its first line
