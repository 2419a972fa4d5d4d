"""The server's probe rounds (serving/monitoring/probe.py) query a sample chosen by item ids: the same
items whatever the order of the catalog's rows, so two builds of one catalog compare."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import numpy as np

from core.data.items import ItemTable
from index.versions.version import SampledItem, sampled_items
from serving.monitoring.probe import ProbeRunner

ROWS, SIZE = 400, 50


def images(folder, count: int) -> list[tuple[str, str, str]]:
    """(id, path, label) of `count` files (their bytes are never read here)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in range(count):
        path = folder / f"img-{n:04d}.png"
        path.write_bytes(b"")
        rows.append((f"item-{n:04d}", str(path), f"class{n % 7}"))
    return rows


def as_pair(rows: list[tuple[str, str, str]], serial: int) -> SimpleNamespace:
    """What `probe_set` reads of a loaded pair: whether its rows are labelled, and its probe
    sample, as a version of these rows without takedowns gives it."""
    ids, paths, labels = zip(*rows, strict=True)
    table = ItemTable(ids, labels, paths, [{} for _ in rows])

    def probe_sample(size: int, item_field: str | None = None) -> list[SampledItem]:
        return sampled_items(table, None, size)

    return SimpleNamespace(index_version=SimpleNamespace(labelled=True, probe_sample=probe_sample), serial=serial)


def runner(probe_catalog: str | None = None) -> ProbeRunner:
    return ProbeRunner(None, None, (1,), SIZE, 64, probe_catalog)  # type: ignore[arg-type]


def test_the_probe_sample_is_the_same_items_in_any_row_order(tmp_path):
    rows = images(tmp_path / "images", ROWS)
    shuffled = [rows[r] for r in np.random.default_rng(0).permutation(ROWS)]
    samples = []
    for serial, table in enumerate((rows, shuffled)):
        paths, labels, excludes = runner().probe_set(as_pair(table, serial))  # type: ignore[arg-type]
        assert len(paths) == SIZE and all(len(ex) == 1 for ex in excludes)
        samples.append({(ex[0], str(p), lab) for ex, p, lab in zip(excludes, paths, labels, strict=True)})
    assert samples[0] == samples[1]


def test_a_probe_catalogs_sample_is_the_same_images_in_any_row_order(tmp_path):
    rows = images(tmp_path / "images", ROWS)
    chosen = []
    for name, table in (("a", rows), ("b", rows[::-1])):
        catalog = tmp_path / f"{name}.csv"
        with catalog.open("w", newline="") as out:
            csv.writer(out).writerows([("id", "path", "label"), *table])
        paths, labels, _ = runner(str(catalog)).probe_set(as_pair(rows, 0))  # type: ignore[arg-type]
        chosen.append(sorted(zip(map(str, paths), labels, strict=True)))
    assert len(chosen[0]) == SIZE and chosen[0] == chosen[1]
