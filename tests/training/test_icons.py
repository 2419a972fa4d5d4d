"""The colour icon set: one class per icon name, one image per theme, no image in two classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.data.catalog import read_catalog
from training.data.icons import build_icon_dataset, icon_classes, render_icon, theme_drawings


def _icon(path: Path, size: int, colour: tuple[int, int, int], mark: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    image.paste((*colour, 255), (size // 4, size // 4, 3 * size // 4, 3 * size // 4 + mark))
    image.save(path)


@pytest.fixture
def themes(tmp_path) -> Path:
    """Four themes drawing `folder` and `printer`; A draws `text-plain` as a link to its
    `text-x-generic` file; B ships only a 32 px `printer`, a symbolic icon and a dangling link."""
    root = tmp_path / "icons"
    for n, theme in enumerate("ABCD"):
        _icon(root / theme / "48x48" / "places" / "folder.png", 48, (200, 40 * n, 0))
        _icon(root / theme / "256x256" / "places" / "folder.png", 256, (200, 40 * n, 10))
        if theme != "B":
            _icon(root / theme / "64x64" / "devices" / "printer.png", 64, (0, 40 * n, 200))
        _icon(root / theme / "64" / "mimetypes" / "text-x-generic.png", 64, (90, 90, 40 * n), mark=n)
    _icon(root / "B" / "32x32" / "devices" / "printer.png", 32, (0, 0, 0))
    _icon(root / "B" / "48x48" / "devices" / "folder-symbolic.png", 48, (0, 0, 0))
    (root / "B" / "48x48" / "devices" / "gone.png").symlink_to("nowhere.png")
    (root / "A" / "64" / "mimetypes" / "text-plain.png").symlink_to("text-x-generic.png")
    return root


def test_a_theme_offers_its_largest_drawing_of_each_name_and_nothing_unusable(themes):
    drawings = theme_drawings("B", themes)
    assert drawings["folder"].size == 256 and drawings["folder"].path.parent.name == "places"
    assert "printer" not in drawings  # 32 px only: below the 48 px floor
    assert not {"folder-symbolic", "gone"} & drawings.keys()


def test_classes_need_enough_themes_and_an_aliased_file_belongs_to_one_class(themes):
    classes = icon_classes(tuple("ABCD"), themes, min_themes=4)
    assert sorted(classes) == ["folder", "text-x-generic"]  # printer: 3 themes
    assert [d.theme for d in classes["folder"]] == list("ABCD")
    three = icon_classes(tuple("ABCD"), themes, min_themes=3)
    assert "printer" in three
    # A draws text-plain with text-x-generic's file: one image, given to the first name only.
    every = icon_classes(tuple("ABCD"), themes, min_themes=1)
    shared = (themes / "A" / "64" / "mimetypes" / "text-x-generic.png").resolve()
    holders = [label for label, drawings in every.items() if any(d.path.resolve() == shared for d in drawings)]
    assert holders == ["text-plain"] and [d.theme for d in every["text-x-generic"]] == list("BCD")


def test_the_set_is_rendered_once_as_colour_squares_with_a_catalog(themes, tmp_path):
    catalog_path = build_icon_dataset(tmp_path / "set", tuple("ABCD"), themes, min_themes=3, size=64)
    catalog = read_catalog(catalog_path)
    assert sorted(catalog.classes) == ["folder", "printer", "text-x-generic"]
    assert len(catalog) == 4 + 3 + 4
    with Image.open(catalog.paths[0]) as image:
        assert image.mode == "RGB" and image.size == (64, 64)
        assert image.getpixel((0, 0)) == (255, 255, 255)  # transparent → white
    stamp = catalog_path.stat().st_mtime_ns
    assert build_icon_dataset(tmp_path / "set", tuple("ABCD"), themes, min_themes=3, size=64) == catalog_path
    assert catalog_path.stat().st_mtime_ns == stamp  # cached, not re-rendered


def test_small_icons_are_scaled_up_to_fill_the_square(themes):
    image = np.asarray(render_icon(themes / "A" / "64x64" / "devices" / "printer.png", 128))
    assert image.shape == (128, 128, 3)
    painted = np.argwhere(image.sum(axis=2) < 3 * 255)
    # The 32 px square of the 64 px icon, doubled (a few pixels of resampling ringing around it).
    assert np.allclose(painted.min(axis=0), 32, atol=6) and np.allclose(painted.max(axis=0), 95, atol=6)


def test_missing_themes_name_the_packages_to_install(tmp_path):
    with pytest.raises(RuntimeError, match="apt-get install .*moka-icon-theme"):
        build_icon_dataset(tmp_path / "set", root=tmp_path / "no-icons")


def test_setup_installs_every_theme_the_set_reads():
    from training.data.icons import THEMES

    setup = (Path(__file__).resolve().parents[2] / "scripts" / "setup.sh").read_text()
    assert all(package in setup for package in THEMES.values())


def test_the_data_command_renders_the_installed_icon_set(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "training", "data", "--set", "icons", "--data-dir", str(tmp_path / "icons")],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    catalog = read_catalog(proc.stdout.strip())
    assert len(catalog.classes) > 300 and len(catalog) > 1500  # 341 classes, 1,663 images here
    themes = {row["theme"] for row in catalog.metadata}
    assert len(themes) == 8
