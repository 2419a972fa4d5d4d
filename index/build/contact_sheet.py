"""A contact sheet of sample queries and their neighbours: what a built index answers, at a
glance, before anyone serves it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps

from index.search.faiss_search import search_leaving_out_self

THUMB = 96
PAD = 6
CAPTION = 16
RIGHT, WRONG, QUERY, PLAIN = (40, 160, 60), (200, 50, 40), (40, 90, 200), (160, 160, 160)


def _thumbnail(path: str | Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            image.draft("RGB", (THUMB, THUMB))  # a large JPEG decodes at reduced scale
            image = ImageOps.exif_transpose(image).convert("RGB")
            # Small images (28-px glyphs) are enlarged to the tile too, without smoothing.
            resample = Image.Resampling.NEAREST if max(image.size) < THUMB else Image.Resampling.BICUBIC
            image = ImageOps.contain(image, (THUMB, THUMB), resample)
    except (OSError, ValueError, Image.DecompressionBombError):
        return Image.new("RGB", (THUMB, THUMB), (90, 90, 90))  # unreadable: a grey square, not a failed build
    tile = Image.new("RGB", (THUMB, THUMB), (255, 255, 255))
    tile.paste(image, ((THUMB - image.width) // 2, (THUMB - image.height) // 2))
    return tile


def caption_font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """The font every caption of a sheet is drawn in."""
    try:
        return ImageFont.load_default(size=12)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def caption_lines(
    text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: float, most: int = 3
) -> list[str]:
    """`text` wrapped to lines `width` pixels wide — at spaces, else within a word (a label such
    as `0035-fe0f-20e3` has none) — at most `most` of them, the last ending in '…' when more
    is left: a caption cut at a fixed count of characters lost the label's end."""
    lines: list[str] = []
    rest = text.strip()
    while rest and len(lines) < most:
        end = len(rest)
        while end > 1 and font.getlength(rest[:end]) > width:
            end -= 1
        space = rest.rfind(" ", 0, end + 1)
        if end < len(rest) and space > 0:
            end = space  # a whole word to the next line rather than one cut in two
        lines.append(rest[:end].rstrip())
        rest = rest[end:].lstrip()
    if rest:  # more than `most` lines' worth: the last says so
        last = lines[-1]
        while last and font.getlength(last + "…") > width:
            last = last[:-1]
        lines[-1] = last + "…"
    return lines or [""]


def _tail(text: str, width: int = 16) -> str:
    """`text` cut to `width` characters from the end (an id's file name says more than its folder)."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def contact_sheet(
    query_paths: Sequence[str | Path],
    query_labels: Sequence[str] | None,
    neighbour_rows: np.ndarray,
    neighbour_scores: np.ndarray,
    item_paths: Sequence[str],
    item_labels: Sequence[str] | None,
    *,
    titles: Sequence[str] | None = None,
    notes: Sequence[str] | None = None,
    query_ids: Sequence[str] | None = None,
    item_ids: Sequence[str] | None = None,
    match: str = "label",
) -> Image.Image:
    """One row per query: the query (blue frame), then its neighbours left to right with their
    scores, framed green when a neighbour has the query's label and red when not (grey where
    the query or the neighbour has none). Rows of -1 (fewer neighbours than asked) stay empty.
    The "labels" are whatever defines a match, named by `match` — an index's item field, or the
    class label (`index.build.publish.draw_contact_sheet` decides).

    `titles`: each row's caption under its query (default `match` and the query's value); `notes`: text
    in a column after the last neighbour (what the row leaves out, "+377 more"), added when any
    row has one; `query_ids` and `item_ids` (indexed as `item_paths`): a second caption line under
    every tile with its id."""
    queries, depth = neighbour_rows.shape
    with_ids = query_ids is not None and item_ids is not None
    note_column = notes is not None and any(notes)
    font = caption_font()
    # Each query's caption wrapped to its tile's width; the rows are as tall as the longest needs.
    wrapped = [caption_lines(_title(q, query_labels, titles, match), font, THUMB + PAD) for q in range(queries)]
    title_lines = max(map(len, wrapped), default=1)
    cell_w, cell_h = THUMB + 2 * PAD, THUMB + 2 * PAD + CAPTION * (title_lines + (1 if with_ids else 0))
    columns = depth + 1 + (1 if note_column else 0)
    sheet = Image.new("RGB", (cell_w * columns, cell_h * queries), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)

    def place(
        column: int, row: int, path: str | Path, frame: tuple[int, int, int], caption: list[str], item_id: str
    ) -> None:
        x, y = column * cell_w, row * cell_h
        draw.rectangle([x + 1, y + 1, x + cell_w - 2, y + THUMB + 2 * PAD - 2], outline=frame, width=4)
        sheet.paste(_thumbnail(path), (x + PAD, y + PAD))
        for n, line in enumerate(caption):
            draw.text((x + PAD, y + THUMB + 2 * PAD + n * CAPTION), line, fill=(0, 0, 0), font=font)
        if with_ids:
            id_y = y + THUMB + 2 * PAD + CAPTION * title_lines
            draw.text((x + PAD, id_y), _tail(item_id), fill=(90, 90, 90), font=font)

    for q in range(queries):
        label = query_labels[q] if query_labels is not None else None
        place(0, q, query_paths[q], QUERY, wrapped[q], query_ids[q] if with_ids else "")
        for n in range(depth):
            item = int(neighbour_rows[q, n])
            if item < 0:
                continue
            if label is None or item_labels is None or item_labels[item] is None:
                frame = PLAIN
            else:
                frame = RIGHT if item_labels[item] == label else WRONG
            caption = [f"{float(neighbour_scores[q, n]):.3f}"]
            place(n + 1, q, item_paths[item], frame, caption, item_ids[item] if with_ids else "")
        if note_column and notes[q]:
            draw.text((cell_w * (depth + 1) + PAD, q * cell_h + PAD + THUMB // 2), notes[q], fill=(0, 0, 0), font=font)
    return sheet


def _title(q: int, query_labels: Sequence[str] | None, titles: Sequence[str] | None, match: str) -> str:
    """Row `q`'s caption under its query: its title, else `match` and the query's value."""
    if titles is not None:
        return titles[q]
    label = query_labels[q] if query_labels is not None else None
    return "query" if label is None else f"{match} {label}"


def sample_neighbours(index, embeddings: np.ndarray, queries: int = 12, depth: int = 8, seed: int = 0):
    """(query rows, neighbour rows, scores): a fixed sample of the catalog querying the index
    by their stored vectors, each leaving itself out — the leave-one-out probe, made visible."""
    n = len(embeddings)
    picked = np.sort(np.random.default_rng(seed).choice(n, size=min(queries, n), replace=False))
    scores, rows = search_leaving_out_self(index, embeddings, picked, depth)
    return picked, rows, scores
