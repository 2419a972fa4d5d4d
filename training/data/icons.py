"""A colour image set from installed Debian icon themes: the same icon drawn by different artists.

Class = a freedesktop icon name (``folder``, ``printer``, ``accessories-calculator``…); image =
that icon as one theme draws it, composited on white and fitted into a square. Themes are
independent artists, so a class's images share a meaning and a rough layout but not colours,
strokes or style — a small stand-in for product photos of one item from several shops, and the
set on which the fine-tuning recipe is measured (a pretrained ImageNet network already retrieves
it moderately well, which the glyph set does not show).

Every image file appears once: names that one theme draws with the same file (aliases such as
``text-plain`` → ``text-x-generic``) would otherwise share an image across classes. Only the
largest PNG of at least `MIN_SOURCE_SIZE` pixels is used; SVG-only themes are left out because
rendering SVG needs a library this project does not otherwise use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from core.data.catalog import Catalog
from training.data.rendered import rendered_catalog

log = logging.getLogger(__name__)

ICON_ROOT = Path("/usr/share/icons")
# Theme folder → Debian package. One theme per artist (Faenza's colour variants and Moka's base
# Faba are the same hands); Tango is left out because its PNGs stop at 32 px, MATE's because it
# redraws GNOME's.
THEMES = {
    "Adwaita": "adwaita-icon-theme",
    "Faenza": "faenza-icon-theme",
    "Moka": "moka-icon-theme",
    "elementary-xfce": "elementary-xfce-icon-theme",
    "gnome": "gnome-icon-theme",
    "oxygen": "oxygen-icon-theme",
    "nuoveXT2": "lxde-icon-theme",
    "Paper": "paper-icon-theme",
}
MIN_SOURCE_SIZE = 48
MIN_THEMES = 4
IMAGE_SIZE = 128
DEFAULT_DATA_DIR = Path(os.environ.get("SIMSEARCH_DATA", "data")) / "icons"


def icon_caption(label: str) -> str:
    """An icon class's name in words, its caption for a text tower: the freedesktop name with
    its separators as spaces ("document-open" → "document open")."""
    return label.replace("-", " ").replace("_", " ")


_SIZE_IN_PATH = re.compile(r"(?:^|/)(\d+)(?:x\d+)?(?:@\d+x)?(?:/|$)")


@dataclass(frozen=True)
class Drawing:
    """One theme's largest PNG of one icon name."""

    theme: str
    name: str
    size: int
    path: Path


def theme_drawings(theme: str, root: Path = ICON_ROOT, min_size: int = MIN_SOURCE_SIZE) -> dict[str, Drawing]:
    """Icon name → the theme's largest PNG of it (symbolic, monochrome icons excluded)."""
    drawings: dict[str, Drawing] = {}
    theme_root = root / theme
    for dirpath, _, files in sorted(os.walk(theme_root, followlinks=True)):
        match = _SIZE_IN_PATH.search(os.path.relpath(dirpath, theme_root))
        if match is None:
            continue
        size = int(match.group(1))
        if size < min_size:
            continue
        for file in sorted(files):
            name, suffix = os.path.splitext(file)
            if suffix != ".png" or name.endswith("-symbolic") or not os.path.isfile(os.path.join(dirpath, file)):
                continue  # dangling links too: some themes alias to icons they do not ship
            if name not in drawings or drawings[name].size < size:
                drawings[name] = Drawing(theme, name, size, Path(dirpath) / file)
    return drawings


def _content_key(path: Path) -> str:
    return hashlib.sha1(path.resolve().read_bytes()).hexdigest()


def icon_classes(
    themes: Sequence[str] = tuple(THEMES), root: Path = ICON_ROOT, min_themes: int = MIN_THEMES
) -> dict[str, list[Drawing]]:
    """Class name → one drawing per theme, for names that at least `min_themes` themes draw.

    An image file appears once in the whole set: a theme drawing two names with one file
    (aliases) gives it to the first name alone, and a file two themes share counts once.
    Merging aliased names into one class instead chains unrelated icons through generic
    drawings (one theme's ``application-x-generic`` stands for hundreds of names).
    """
    per_theme = {theme: theme_drawings(theme, root) for theme in themes}
    drawn_by = defaultdict(int)
    for drawings in per_theme.values():
        for name in drawings:
            drawn_by[name] += 1
    candidates = sorted(name for name, count in drawn_by.items() if count >= min_themes)
    classes: dict[str, list[Drawing]] = {}
    seen: set[str] = set()
    for name in candidates:
        chosen = []
        for theme in themes:
            drawing = per_theme[theme].get(name)
            if drawing is None:
                continue
            key = _content_key(drawing.path)
            if key not in seen:
                seen.add(key)
                chosen.append(drawing)
        if len(chosen) >= min_themes:
            classes[name] = chosen
    return classes


def render_icon(path: Path, size: int = IMAGE_SIZE) -> Image.Image:
    """The icon on white, its longer side scaled to `size`, centred on a square RGB canvas."""
    with Image.open(path) as source:
        icon = source.convert("RGBA")
    if max(icon.size) != size:
        scale = size / max(icon.size)
        icon = icon.resize((round(icon.width * scale), round(icon.height * scale)), Image.Resampling.LANCZOS)
    canvas = Image.new("RGBA", (size, size), (255, 255, 255, 255))
    canvas.alpha_composite(icon, ((size - icon.width) // 2, (size - icon.height) // 2))
    return canvas.convert("RGB")


def _fingerprint(classes: dict[str, list[Drawing]], size: int) -> str:
    listing = [[label, [(d.theme, d.name, d.size) for d in drawings]] for label, drawings in classes.items()]
    return hashlib.sha256(json.dumps([listing, size]).encode()).hexdigest()[:16]


def build_icon_dataset(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    themes: Sequence[str] = tuple(THEMES),
    root: Path = ICON_ROOT,
    min_themes: int = MIN_THEMES,
    size: int = IMAGE_SIZE,
) -> Path:
    """Render (or reuse) the icon set under `data_dir`; return the catalog path."""
    present = [t for t in themes if (root / t).is_dir()]
    if len(present) < min_themes:
        missing = [THEMES.get(t, t) for t in themes if t not in present]
        raise RuntimeError(
            f"found {len(present)} of the icon themes under {root} ({', '.join(present) or 'none'}); "
            f"need {min_themes}: apt-get install {' '.join(missing)}"
        )
    classes = icon_classes(present, root, min_themes)

    def render(staging: Path) -> Catalog:
        total = sum(len(d) for d in classes.values())
        log.info("rendering %d icons of %d classes from %d themes into %s", total, len(classes), len(present), data_dir)
        ids, paths, labels, metadata = [], [], [], []
        for number, (label, drawings) in enumerate(classes.items()):
            for drawing in drawings:
                rel = Path("images") / f"{number:04d}" / f"{drawing.theme}.png"
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                render_icon(drawing.path, size).save(staging / rel)
                ids.append(f"{label}/{drawing.theme}")
                paths.append(staging / rel)
                labels.append(label)
                metadata.append({"theme": drawing.theme, "icon": drawing.name, "source_px": drawing.size})
        return Catalog(ids, paths, labels, metadata, source="icons")

    return rendered_catalog(data_dir, _fingerprint(classes, size), render)
