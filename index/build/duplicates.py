"""`python -m index duplicates`: the near-duplicates of an index version, as groups.

Every live row queries the index for the rows at or above `--min-score` (`index.search.range_search`,
in batches), and the pairs found are the edges of a graph whose connected components are the
groups: copies of one picture re-encoded, resized, cropped or turned, chained through each other
even where two of them score below the threshold directly. Written as

- `groups.csv`: `group, size, id, path, label, best_score, best_match` — one line per member of
  a group of two or more, largest group first (group 1), each group led by its most connected
  member; `best_score` is a member's highest cosine to another member it is linked to,
  `best_match` that member's id;
- `groups.png`: the largest groups on a contact sheet (`index.build.contact_sheet`), a row each: the
  leading member captioned with the group's number and size, then the others by their cosine to
  it, every tile with its id, and "+N more" where the row cannot hold the group;
- `summary.json`: the counts, the largest group's size and how far its members fall from its
  leading one, the method, the time and the resolved configuration.

A group far larger than copies of one picture come in is the threshold chaining look-alikes
together (A near B near C ...): the command says so (`CHAINING_MEMBERS`) and suggests a higher
--min-score (docs/operations.md, near-duplicates).
"""

from __future__ import annotations

import csv
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.artifacts import layout as artifacts
from core.artifacts.layout import utc_now
from core.config import option, to_jsonable
from core.progress import Progress
from core.retrieval.ranking import best_k
from index.build.contact_sheet import contact_sheet
from index.search.range_search import by_range_search, reaching
from index.versions.version import IndexVersion

log = logging.getLogger(__name__)

GROUPS_FILE, SHEET_FILE, SUMMARY_FILE = "groups.csv", "groups.png", "summary.json"
RUNS_DIR = "duplicates"  # in the index root: a run's default output folder is RUNS_DIR/VERSION-minSCORE


def run_dir(index_root: str | Path, version: str, min_score: float) -> Path:
    """Where a run over `version` at `min_score` writes by default."""
    return Path(index_root) / RUNS_DIR / f"{version}-min{min_score:g}"


def runs_of(index_root: str | Path, version: str) -> list[Path]:
    """The finished runs over `version` in their default folders, oldest first."""
    runs = (d for d in (Path(index_root) / RUNS_DIR).glob(f"{version}-min*") if (d / GROUPS_FILE).is_file())
    return sorted(runs, key=lambda d: d.stat().st_mtime)


SHEET_MEMBERS = 8  # members beside the leading one on a contact-sheet row
# A group at least this large is seldom copies of one picture (a photo re-encoded, resized,
# cropped, turned: a handful), more often a threshold low enough to chain look-alikes: on an
# 11k-image flag catalog --min-score 0.9 made one group of 385 different flags.
CHAINING_MEMBERS = 50


@dataclass
class DuplicatesConfig:
    """`index duplicates`."""

    index_root: str = option("runs/index", help="index root (versions/ and CURRENT)")
    min_score: float | None = option(
        None, help="required: least cosine similarity of two near-duplicates, in [-1, 1] (depends on the model)"
    )
    version: str | None = option(None, help="index version to search (default: the live one)")
    out: str | None = option(None, help="output directory (default: INDEX_ROOT/duplicates/VERSION-minSCORE)")
    max_neighbours: int = option(100, help="near-duplicates found per row at most; rows with more are counted")
    batch_size: int = option(1024, help="rows per range search")
    sheet_groups: int = option(12, help="largest groups shown on the contact sheet")

    def __post_init__(self) -> None:
        if self.min_score is not None and not -1.0 <= self.min_score <= 1.0:
            raise ValueError(f"min_score must be within [-1, 1] (cosine similarity), got {self.min_score}")
        if self.max_neighbours < 1 or self.batch_size < 1 or self.sheet_groups < 0:
            raise ValueError("max_neighbours and batch_size must be positive, sheet_groups at least 0")


@dataclass
class Groups:
    """Near-duplicate groups of one version: `members[g]`, rows best-connected first."""

    members: list[np.ndarray]
    best_score: np.ndarray  # per row: highest score of an edge (NaN: no edge)
    best_match: np.ndarray  # per row: the row at the other end of that edge (-1: none)
    edges: int  # pairs at or above min_score
    truncated_rows: int  # rows with more near-duplicates than max_neighbours (some edges not seen)
    searched_rows: int


def find_groups(
    version: IndexVersion, min_score: float, max_neighbours: int = 100, batch_size: int = 1024, progress: bool = False
) -> Groups:
    """Every live row of `version` against its index; groups = connected components of the
    graph of pairs scoring at least `min_score`."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    version.load()
    index, live, vectors = version.searchable(), version.live_mask, version.vectors
    n = len(vectors)
    rows = np.flatnonzero(live) if live is not None else np.arange(n)
    sources, targets, scores, truncated = [], [], [], 0
    with Progress(len(rows), "duplicates", "rows", "auto" if progress else "off") as bar:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            queries = np.asarray(vectors[batch])
            answers = reaching(index, queries, min_score, max_neighbours, live, [{int(r)} for r in batch])
            for row, answer in zip(batch, answers, strict=True):
                sources.append(np.full(len(answer.rows), row, dtype=np.int64))
                targets.append(answer.rows)
                scores.append(answer.scores)
                truncated += answer.truncated
            bar.update(len(batch))
    src = np.concatenate(sources) if sources else np.zeros(0, np.int64)
    dst = np.concatenate(targets) if targets else np.zeros(0, np.int64)
    score = np.concatenate(scores) if scores else np.zeros(0, np.float32)
    # Each pair is found from both ends (an ANN index may find it from one only): either links them.
    graph = coo_matrix((np.ones(len(src), dtype=np.int8), (src, dst)), shape=(n, n)).tocsr()
    _, component = connected_components(graph, directed=True, connection="weak")
    best_score = np.full(n, np.nan, dtype=np.float32)
    best_match = np.full(n, -1, dtype=np.int64)
    ends = np.concatenate([src, dst])
    others = np.concatenate([dst, src])
    both = np.concatenate([score, score])
    order = np.lexsort((others, -both, ends))  # per row: its best edge first
    first = order[np.r_[True, ends[order][1:] != ends[order][:-1]]] if len(order) else order
    best_score[ends[first]], best_match[ends[first]] = both[first], others[first]
    degree = np.bincount(ends, minlength=n)
    linked = np.flatnonzero(degree > 0)
    by_group = linked[np.argsort(component[linked], kind="stable")]
    splits = np.flatnonzero(np.diff(component[by_group])) + 1
    members = [group[np.lexsort((group, -degree[group]))] for group in np.split(by_group, splits) if len(group)]
    members.sort(key=lambda m: (-len(m), int(m.min())))
    pairs = len({(min(a, b), max(a, b)) for a, b in zip(src.tolist(), dst.tolist(), strict=True)})
    return Groups(members, best_score, best_match, pairs, int(truncated), len(rows))


def run_duplicates(cfg: DuplicatesConfig, progress: bool = True) -> Path:
    """Find the near-duplicate groups of a version and write them; returns the output directory."""
    if cfg.min_score is None:
        raise ValueError("index duplicates needs --min-score: the least cosine similarity of two near-duplicates")
    started = time.perf_counter()
    version = IndexVersion.open(cfg.index_root, cfg.version)
    groups = find_groups(version, cfg.min_score, cfg.max_neighbours, cfg.batch_size, progress)
    seconds = time.perf_counter() - started
    out = Path(cfg.out) if cfg.out else run_dir(cfg.index_root, version.name, cfg.min_score)
    largest = groups.members[0] if groups.members else np.zeros(0, np.int64)
    # How far the largest group's members fall from its leading one: far below the threshold is
    # a chain of look-alikes, not copies.
    farthest = float(lead_cosines(version, largest)[0].min()) if len(largest) > 1 else None
    with artifacts.staging_directory(out) as staging:
        write_groups_csv(staging / GROUPS_FILE, version, groups)
        if groups.members and cfg.sheet_groups:
            groups_sheet(version, groups, cfg.sheet_groups).save(staging / SHEET_FILE)
        summary = {
            "version": version.name,
            "index_id": version.manifest.index_id,
            "factory": version.manifest.factory,
            "min_score": cfg.min_score,
            "method": "faiss range search" if by_range_search(version.searchable()) else "widened k-NN",
            "rows_searched": groups.searched_rows,
            "pairs": groups.edges,
            "groups": len(groups.members),
            "rows_in_groups": int(sum(len(m) for m in groups.members)),
            "largest_group": int(len(largest)),
            "largest_group_least_cosine_to_lead": None if farthest is None else round(farthest, 4),
            "truncated_rows": groups.truncated_rows,
            "seconds": round(seconds, 3),
            "created": utc_now(),
            "config": to_jsonable(cfg),
        }
        (staging / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if groups.truncated_rows:
        log.warning(
            "%d rows have more than %d near-duplicates: some of their pairs were not seen (--max-neighbours)",
            groups.truncated_rows,
            cfg.max_neighbours,
        )
    log.info(
        "%d groups of near-duplicates (%d rows, %d pairs at >= %g; the largest %d members) in %s, written to %s",
        len(groups.members), summary["rows_in_groups"], groups.edges, cfg.min_score, len(largest), version.name, out,
    )  # fmt: skip
    if len(largest) >= CHAINING_MEMBERS:
        log.warning(
            "the largest group has %d members, some at cosine %.3f to its leading one: at --min-score %g "
            "near-duplicates may be chaining different images together; look at %s and try a higher "
            "--min-score (docs/operations.md: picking the threshold)",
            len(largest), farthest, cfg.min_score, out / SHEET_FILE,
        )  # fmt: skip
    return out


def lead_cosines(version: IndexVersion, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cosines, rows): a group's members other than its leading one (`members[0]`), in row
    order, with their exact cosine to it (from the stored vectors)."""
    lead, others = int(members[0]), np.sort(members[1:])
    cosine = np.einsum("cd,d->c", np.asarray(version.vectors[others]), version.vectors[lead]).astype(np.float32)
    return cosine, others


def write_groups_csv(path: Path, version: IndexVersion, groups: Groups) -> None:
    items = version.items
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["group", "size", "id", "path", "label", "best_score", "best_match"])
        for number, members in enumerate(groups.members, start=1):
            for row in members:
                writer.writerow(
                    [
                        number,
                        len(members),
                        items.ids[row],
                        items.paths[row],
                        items.labels[row] if items.labelled else "",
                        f"{groups.best_score[row]:.4f}",
                        items.ids[groups.best_match[row]],
                    ]
                )


def groups_sheet(version: IndexVersion, groups: Groups, count: int):
    """The `count` largest groups, a row each: the leading member captioned with the group's
    number and size, then up to 8 others by their cosine to it (exact, from the stored vectors),
    each tile with its id, and "+N more" for the members a row cannot show."""
    shown = groups.members[:count]
    depth = min(SHEET_MEMBERS, max(len(m) for m in shown) - 1)
    rows = np.full((len(shown), depth), -1, dtype=np.int64)
    scores = np.zeros((len(shown), depth), dtype=np.float32)
    for g, members in enumerate(shown):
        cosine, others = lead_cosines(version, members)
        best = best_k(cosine, depth, others)
        rows[g, : len(best)], scores[g, : len(best)] = others[best], cosine[best]
    items = version.items
    labels = list(items.labels) if items.labelled else None
    paths, ids = list(items.paths), list(items.ids)
    leads = [int(m[0]) for m in shown]
    return contact_sheet(
        [paths[r] for r in leads],
        [labels[r] for r in leads] if labels else None,
        rows,
        scores,
        paths,
        labels,
        titles=[f"group {g} ({len(m)})" for g, m in enumerate(shown, start=1)],
        notes=[f"+{len(m) - 1 - depth} more" if len(m) - 1 > depth else "" for m in shown],
        query_ids=[ids[r] for r in leads],
        item_ids=ids,
    )
