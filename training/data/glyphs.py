"""The embedded default data set: font glyphs rendered from installed Debian font packages.

Class = a character; image = that character rendered in one font face, 28×28 grey. About 116
characters that every face covers (Latin letters and digits, Greek and Cyrillic letters with no
Latin look-alike, a few symbols) over about 170 faces. Rendering is deterministic: a fixed
character list, faces found by file in fixed order, faces that lack any character skipped.
Images are cached as PNG files with a catalog (`id, path, label, font, character`; the label is
the code point, e.g. U+0041) and only re-rendered when missing or when the character/face list changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fontTools.ttLib import TTFont, TTLibError
from PIL import Image, ImageDraw, ImageFont

from core.data.catalog import Catalog
from training.data.rendered import rendered_catalog

log = logging.getLogger(__name__)

LATIN = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
# Greek and Cyrillic letters that no Latin letter (nor each other) closely resembles.
GREEK = "ΓΔΘΛΞΠΣΦΨΩαβγδεζηθλμξπσφψω"
CYRILLIC = "БДЖЗИЙЦЧШЩЫЭЮЯбджилцчшыэюя"
SYMBOLS = "&@"
CHARACTERS = LATIN + GREEK + CYRILLIC + SYMBOLS

FONT_DIRS = (
    "/usr/share/fonts/truetype",
    "/usr/share/fonts/opentype",
    "/usr/share/texmf/fonts/opentype",
)
FONT_PACKAGES = (
    "fonts-noto-core fonts-urw-base35 fonts-liberation fonts-liberation2 fonts-freefont-ttf "
    "fonts-texgyre fonts-lato fonts-open-sans fonts-roboto-unhinted fonts-crosextra-carlito "
    "fonts-crosextra-caladea fonts-linuxlibertine fonts-ebgaramond fonts-cantarell"
).split()
IMAGE_SIZE = 28
DEFAULT_MAX_FACES = 170
DEFAULT_DATA_DIR = Path(os.environ.get("SIMSEARCH_DATA", "data")) / "glyphs"
CODE_POINT_LABEL = re.compile(r"U\+([0-9A-F]{4,6})")  # a class's label: its character's code point


def character_name(label: str) -> str:
    """A glyph class's name in words, its caption for a text tower: the Unicode name of the
    character its label's code point names ("U+0041" → "LATIN CAPITAL LETTER A")."""
    match = CODE_POINT_LABEL.fullmatch(label)
    if match is None:
        raise ValueError(f"{label!r} is not a glyph label (a code point such as U+0041)")
    name = unicodedata.name(chr(int(match[1], 16)), "")
    if not name:
        raise ValueError(f"{label}: the character has no Unicode name to caption it with")
    return name


@dataclass(frozen=True)
class Face:
    path: Path
    name: str


def discover_faces(
    characters: str = CHARACTERS,
    font_dirs: Sequence[str | Path] = FONT_DIRS,
    max_faces: int | None = DEFAULT_MAX_FACES,
) -> list[Face]:
    """Font faces (one per file, deduplicated by full name) that cover every character."""
    needed = {ord(c) for c in characters}
    files = sorted(
        p
        for d in font_dirs
        if Path(d).is_dir()
        for p in Path(d).rglob("*")
        if p.suffix.lower() in (".ttf", ".otf") and p.is_file()
    )
    faces: dict[str, Face] = {}
    for path in files:
        try:
            font = TTFont(path, lazy=True, fontNumber=0)
            cmap = font.getBestCmap() or {}
            name = font["name"].getDebugName(4) or path.stem
            font.close()
        except (TTLibError, KeyError, OSError, AssertionError) as exc:
            log.debug("skipping unreadable font %s: %s", path, exc)
            continue
        if needed <= cmap.keys() and name not in faces:
            faces[name] = Face(path, name)
    ordered = sorted(faces.values(), key=lambda f: f.name)
    if max_faces is not None and len(ordered) > max_faces:
        # Evenly spaced picks keep every family represented rather than the first alphabetically.
        picks = np.linspace(0, len(ordered) - 1, max_faces).round().astype(int)
        ordered = [ordered[i] for i in picks]
    return ordered


def render_glyph(face: ImageFont.FreeTypeFont, character: str, size: int = IMAGE_SIZE) -> Image.Image:
    """White glyph on black, on a common baseline so case and position stay visible."""
    image = Image.new("L", (size, size), 0)
    ImageDraw.Draw(image).text((size / 2, size * 0.75), character, fill=255, font=face, anchor="ms")
    return image


def _fingerprint(characters: str, faces: Sequence[Face], size: int) -> str:
    text = json.dumps([characters, [f.name for f in faces], size], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_glyph_dataset(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    characters: str = CHARACTERS,
    max_faces: int | None = DEFAULT_MAX_FACES,
    font_dirs: Sequence[str | Path] = FONT_DIRS,
    size: int = IMAGE_SIZE,
) -> Path:
    """Render (or reuse) the glyph set under `data_dir`; return the catalog path."""
    data_dir = Path(data_dir)
    faces = discover_faces(characters, font_dirs, max_faces)
    if len(faces) < 2:
        raise RuntimeError(
            f"found {len(faces)} font faces covering all {len(characters)} characters under "
            f"{', '.join(map(str, font_dirs))}; install the font packages: "
            f"apt-get install {' '.join(FONT_PACKAGES)}"
        )

    def render(staging: Path) -> Catalog:
        log.info("rendering %d characters × %d faces into %s", len(characters), len(faces), data_dir)
        ids, paths, labels, metadata = [], [], [], []
        for face_number, face in enumerate(faces):
            font = ImageFont.truetype(str(face.path), size=int(size * 0.7))
            for character in characters:
                codepoint = f"U+{ord(character):04X}"
                rel = Path("images") / codepoint / f"{face_number:03d}.png"
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                render_glyph(font, character, size).save(staging / rel, optimize=False)
                ids.append(f"{codepoint}/{face_number:03d}")
                paths.append(staging / rel)
                labels.append(codepoint)
                metadata.append({"font": face.name, "character": character})
        return Catalog(ids, paths, labels, metadata, source="glyphs")

    return rendered_catalog(data_dir, _fingerprint(characters, faces, size), render)


# Accented Latin letters (Latin-1 Supplement and Latin Extended-A): distinct classes at 28×28
# with no look-alike in the base set, covered by nearly every face. They grow the glyph set into
# catalogs of real neighbour structure for index benchmarks.
ACCENTED_LATIN = "".join(
    chr(c) for c in range(0x00C0, 0x0180) if chr(c).isalpha() and chr(c) not in "ªºßĸŉſ" and chr(c).isprintable()
)


def face_coverage(faces: Sequence[Face]) -> dict[Face, set[int]]:
    """Code points each face can render."""
    coverage = {}
    for face in faces:
        font = TTFont(face.path, lazy=True, fontNumber=0)
        coverage[face] = set((font.getBestCmap() or {}).keys())
        font.close()
    return coverage


def render_grown_glyphs(
    total: int,
    characters: str = CHARACTERS + ACCENTED_LATIN,
    faces: Sequence[Face] | None = None,
    seed: int = 0,
    chunk: int = 8192,
    size: int = IMAGE_SIZE,
) -> Iterator[tuple[np.ndarray, list[str]]]:
    """`total` glyph images in memory, in chunks of (N×1×size×size float32 in [0, 1], labels).

    The first pass is every (character, face) pair a face covers; further passes are the same
    pairs with a random affine jitter (rotation ±8°, scale 0.85-1.15, shift ±2 px), so a
    catalog of a million images keeps the set's real neighbour structure: class = character.
    """
    faces = list(faces) if faces is not None else discover_faces()
    coverage = face_coverage(faces)
    pairs = [(face, ch) for face in faces for ch in characters if ord(ch) in coverage[face]]
    fonts = {face: ImageFont.truetype(str(face.path), size=int(size * 0.7)) for face in faces}
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for n in range(total):
        face, character = pairs[n % len(pairs)]
        image = render_glyph(fonts[face], character, size)
        if n >= len(pairs):
            angle, scale = rng.uniform(-8, 8), rng.uniform(0.85, 1.15)
            shift = rng.uniform(-2, 2, size=2)
            image = image.rotate(angle, resample=Image.Resampling.BILINEAR, translate=tuple(shift))
            image = image.resize((round(size * scale),) * 2, Image.Resampling.BILINEAR)
            image = _center_fit(image, size)
        images.append(np.asarray(image, dtype=np.float32) / 255.0)
        labels.append(f"U+{ord(character):04X}")
        if len(images) == chunk or n == total - 1:
            yield np.stack(images)[:, None], labels
            images, labels = [], []


def _center_fit(image: Image.Image, size: int) -> Image.Image:
    """Crop or pad a square image to size × size around its centre."""
    canvas = Image.new("L", (size, size), 0)
    offset = (size - image.size[0]) // 2
    canvas.paste(image, (offset, offset))
    return canvas
