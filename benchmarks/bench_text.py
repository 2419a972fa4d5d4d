"""Search by words (issue 49): text queries against image queries on the same server, same run —
q/s and p50/p99 at concurrency 1, 8 and 32 over gRPC, the two kinds interleaved in every round —
and the text model's figures: text → image Recall@K of its training run (seen classes' held-out
images; unseen classes apart) and the served answers against the offline search of the same model.

The artifacts are a demo run (`--run`, made by `python -m scripts.demo` when missing; `--quick`
a glyph slice): its image model, and its text model (`train-text` + `export --text`, made here
when the run has none) and an index of the model's test split built with it. Image queries are
the test split's images; text queries the captions the text run measured on (its held-out and
unseen classes' names).

    python -m benchmarks.bench_text                 # the demo's artifacts, 10 s a level, 3 rounds
    python -m benchmarks.bench_text --quick         # one short round on a glyph slice
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import harness
from core.artifacts import layout as artifacts
from core.artifacts.model_manifests import ModelManifest
from core.data.catalog import read_catalog
from core.retrieval.vectors import exact_search
from index.embedder import OnnxTextEmbedder
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient

LEVELS = [1, 8, 32]
KINDS = ("image", "text")


def ensure_text_artifacts(run: Path, epochs: int) -> Path:
    """The index root of `run` answering words: the demo's own when its version records a text
    model, else one built here over the model's test split with a text model trained and exported
    here. Returns the index root."""
    if IndexVersion.open(run / "index").manifest.text_model_id:
        return run / "index"
    root = run / "index-text"
    if artifacts.current_version(root):
        return root
    steps = [
        ["-m", "training", "train-text", "--model", str(run / "model"), "--out", str(run / "text"),
         "--epochs", str(epochs), "--no-plots"],
        ["-m", "training", "export", "--text", "--run", str(run / "text"), "--out", str(run / "text-model")],
        ["-m", "index", "build", "--model", str(run / "model"), "--index-root", str(root),
         "--text-model", str(run / "text-model")],
    ]  # fmt: skip
    for step in steps:
        subprocess.run([sys.executable, *step], check=True, cwd=harness.ROOT)
    return root


def captions(text_run: Path) -> list[str]:
    """The distinct captions the text run measured on, seen classes' then unseen ones'."""
    found: list[str] = []
    for name in ("heldout", "unseen"):
        path = text_run / "captions" / f"{name}.csv"
        if path.is_file():
            named = (row["caption"] for row in read_catalog(path).metadata)
            found += [c for c in dict.fromkeys(named) if c not in found]
    return found


def served_equals_offline(port: int, root: Path, phrases: list[str], k: int = 10) -> tuple[int, int]:
    """How many of `phrases` the server answers with exactly the offline text → image search of
    the same text model over the live version's vectors (the index is Flat: exact)."""
    version = IndexVersion.open(root)
    text = OnnxTextEmbedder(version.manifest.text_model_dir)
    _, rows = exact_search(np.asarray(version.vectors), text.embed(phrases), k)
    same = 0
    with SearchClient(f"127.0.0.1:{port}", timeout=60) as client:
        for phrase, expected in zip(phrases, rows, strict=True):
            answer = client.search(pb.SearchRequest(text=phrase, k=k, group_by=""))
            same += [n.id for n in answer.neighbors] == [version.items.ids[int(r)] for r in expected]
    return same, len(phrases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/demo", help="the demo run whose artifacts are served (made if missing)")
    parser.add_argument("--quick", action="store_true", help="one short round; a glyph slice if artifacts are built")
    parser.add_argument("--seconds", type=float, help="load per level and kind (default 10, quick 3)")
    parser.add_argument("--repeats", type=int, help="interleaved rounds; medians reported (default 3, quick 1)")
    parser.add_argument("--text-epochs", type=int, default=30, help="train-text epochs, when the run has no text model")
    args = parser.parse_args()
    seconds = args.seconds if args.seconds is not None else 3.0 if args.quick else 10.0
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    if seconds <= 0 or repeats < 1 or args.text_epochs < 1:
        parser.error("--seconds must be > 0, --repeats and --text-epochs at least 1")
    run = Path(args.run)
    harness.ensure_artifacts(run, args.quick)
    root = ensure_text_artifacts(run, args.text_epochs)
    manifest = IndexVersion.open(root).manifest
    text_run = run / "text"  # the demo's train-text run
    phrases = captions(text_run)
    if not phrases:
        sys.exit(f"error: {text_run} has no captions/*.csv to query with")
    test_split = ModelManifest.read(run / "model").test_split

    with tempfile.TemporaryDirectory() as work:
        texts = Path(work) / "phrases.txt"
        texts.write_text("\n".join(phrases) + "\n", encoding="utf-8")
        port, metrics_port = harness.free_port(), harness.free_port()
        command = [sys.executable, "-m", "serving", "serve", "--port", str(port), "--metrics-port", str(metrics_port)]
        command += ["--index-root", str(root), "--probe-interval-s", "0", "--ann-sample-rate", "0", "--processes", "1"]
        proc = harness.start(command, lambda: harness.healthy(metrics_port))
        try:
            same, asked = served_equals_offline(port, root, phrases)
            rounds: dict[str, list[list[dict]]] = {kind: [] for kind in KINDS}
            for _ in range(repeats):
                for kind in KINDS:  # interleaved: a drifting machine moves both alike
                    rounds[kind].append([
                        harness.python_loadgen(port, Path(test_split), c, seconds, query=kind, texts=texts)
                        for c in LEVELS
                    ])  # fmt: skip
        finally:
            harness.stop(proc)

    figures = {kind: harness.median_rounds(rounds[kind]) for kind in KINDS}
    results = json.loads((text_run / "results.json").read_text())
    print(f"index {manifest.version}: {manifest.size} images, text model {manifest.text_model_id}")
    print(f"served text answers equal the offline text → image search: {same} of {asked} phrases")
    for part, figure in results["evaluation"].items():
        recall = figure["recall_at_k"]
        chance = figure.get("chance_recall_at_k", {})
        shown = ", ".join(
            f"R@{k} {float(v):.3f} (chance {float(chance.get(k, 'nan')):.3f})"
            for k, v in sorted(recall.items(), key=lambda kv: int(kv[0]))
        )
        print(
            f"text → image, {part} classes ({figure.get('captions')} captions, {figure.get('images')} images): {shown}"
        )
    print(f"\n{'c':>3} | {'image q/s':>9} | {'text q/s':>8} | {'text/image':>10} | image p50/p99 ms | text p50/p99 ms")
    for image, text in zip(figures["image"], figures["text"], strict=True):
        ratio = statistics.median(
            t["qps"] / i["qps"]
            for t, i in zip(
                [r[LEVELS.index(text["concurrency"])] for r in rounds["text"]],
                [r[LEVELS.index(image["concurrency"])] for r in rounds["image"]],
                strict=True,
            )
        )
        print(
            f"{image['concurrency']:>3} | {image['qps']:>9.0f} | {text['qps']:>8.0f} | {ratio:>9.2f}× | "
            f"{image['p50_ms']:.1f} / {image['p99_ms']:.1f} | {text['p50_ms']:.1f} / {text['p99_ms']:.1f}"
        )
    errors = sum(level.get("errors", 0) for kind in KINDS for level in figures[kind])
    print(f"\n{repeats} round(s) of {seconds:.0f} s a level; medians; errors: {errors}")
    if errors or same != asked:
        sys.exit(1)


if __name__ == "__main__":
    main()
