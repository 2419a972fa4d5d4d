"""bench_stream_serving's pure parts: its option checks, the Recall@K it reads from a server's
/metrics, and the probe rounds it counts between samples (the benchmark itself runs servers for
minutes: docs/benchmarks.md gives its command)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.bench_stream_serving import BenchError, check_args, probe_rounds, summary_rows
from benchmarks.server_readings import RECALL_METRICS, parse_metrics, recall_figures

DEFAULTS = dict(modes="serve,ray", rows=1000, dim=8, items_per_call=100, search_callers=32, ingest_callers=10,
                probe_size=200, minutes=1.0, sample_s=60.0, probe_interval_s=30.0)  # fmt: skip


def args(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{**DEFAULTS, **changes})


def test_the_modes_and_every_bad_option():
    assert check_args(args()) == ["serve", "ray"]
    assert check_args(args(modes="ray", ingest_callers=0)) == ["ray"]
    for changes, message in [
        ({"modes": "serve,grpc"}, "--modes: unknown grpc"),
        ({"modes": ","}, "--modes: unknown empty list"),
        ({"rows": 0}, "--rows must be at least 1"),
        ({"rows": 5}, "--rows must be at least k = 10"),
        ({"items_per_call": 0}, "--items-per-call must be at least 1"),
        ({"ingest_callers": -1}, "--ingest-callers must be 0 or more"),
        ({"minutes": 0}, "must be positive"),
        ({"sample_s": 90.0}, "--sample-s 90.0 is longer than a phase (60 s)"),
    ]:
        with pytest.raises(BenchError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_args(args(**changes))


METRICS = """\
# HELP simsearch_recall_at_k Online Recall@K by source
simsearch_recall_at_k{k="10",source="probe"} 0.97
simsearch_recall_at_k{k="10",source="traffic"} 0.5
simsearch_recall_at_k{k="1",source="traffic"} 0.25
simsearch_recall_samples{k="10",source="probe"} 200.0
simsearch_recall_samples{k="10",source="traffic"} 1000.0
simsearch_recall_samples{k="10",source="ann"} 12.0
simsearch_ann_recall_at_k{k="10"} 1.0
simsearch_index_size 26200.0
simsearch_stage_latency_seconds_count{stage="embed"} 400.0
simsearch_stage_latency_seconds_count{stage="decode"} 400.0
simsearch_requests_total{code="OK",method="Search",protocol="grpc"} 9.0
"""


def test_recall_figures_by_source_with_their_samples():
    figures = recall_figures(parse_metrics(METRICS, RECALL_METRICS))
    assert figures == {
        "probe": 0.97, "probe_n": 200.0, "traffic": 0.5, "traffic_n": 1000.0, "ann": 1.0, "ann_n": 12.0,
        "index_size": 26200.0, "decode_count": 400.0, "embed_count": 400.0,
    }  # fmt: skip
    # A source the server has no figure for is None, not a stale or made-up value.
    assert recall_figures(parse_metrics("simsearch_index_size 5.0\n", RECALL_METRICS))["probe"] is None


def test_probe_rounds_between_samples_and_the_stale_samples_counted():
    samples = [{"embed_count": 200.0}, {"embed_count": 200.0}, {"embed_count": 264.0}, {}, {"embed_count": 664.0}]
    assert probe_rounds(samples, 200) == [1.0, 0.0, 0.32, None, 2.0]
    phase = {"qps": 100.0, "p99_ms": 10.0, "search_errors": 0, "samples": samples[:2]}
    ingest = {**phase, "qps": 90.0, "p99_ms": 20.0, "samples": samples[2:], "items_per_s": 1.0,
              "versions_per_s": 1.0, "visible_p50_ms": 1.0, "visible_p99_ms": 2.0, "found": 3, "ingest_calls": 3,
              "ingest_errors": 0}  # fmt: skip
    row = summary_rows([{"mode": "serve", "alone": phase, "ingest": ingest}], 200)[0]
    assert (row["q/s ratio"], row["≥ 0.8"], row["p99 ratio"], row["≤ 1.5"]) == (0.9, "yes", 2.0, "NO")
    assert row["samples without a probe round"] == "2/5"
