"""Grafana dashboards as code (grafanalib): `python deploy/grafana/generate.py` rewrites
deploy/grafana/dashboards/*.json; a test fails when the committed JSON differs from this."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafanalib._gen import DashboardEncoder
from grafanalib.core import Dashboard, GridPos, Stat, Target, Template, Templating, TimeSeries

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # defined in provisioning/datasources
OUT = Path(__file__).resolve().parent / "dashboards"
SEL = 'instance=~"$instance"'


def panel(
    kind,
    panel_id: int,
    title: str,
    exprs: list[tuple[str, str]],
    x: int,
    y: int,
    w: int = 12,
    h: int = 8,
    unit: str = "",
):
    targets = [
        Target(expr=expr, legendFormat=legend, refId=chr(65 + i), datasource=DATASOURCE)
        for i, (expr, legend) in enumerate(exprs)
    ]
    # grafanalib names the unit `format` on Stat panels and `unit` on time series.
    extra = {("format" if kind is Stat else "unit"): unit} if unit else {}
    return kind(
        id=panel_id, title=title, dataSource=DATASOURCE, targets=targets, gridPos=GridPos(h=h, w=w, x=x, y=y), **extra
    )


def variables(instance_from: str, k_from: str) -> Templating:
    """The `instance` (multi) and `k` variables every dashboard offers, read from two metrics."""
    return Templating(
        list=[
            Template(
                name="instance",
                label="instance",
                query=f"label_values({instance_from}, instance)",
                dataSource=DATASOURCE,
                includeAll=True,
                multi=True,
                default="$__all",
            ),
            Template(name="k", label="K", query=f"label_values({k_from}, k)", dataSource=DATASOURCE, default="1"),
        ]
    )


def search_service() -> Dashboard:
    def stage_quantile(q: float) -> str:
        return (
            f"histogram_quantile({q}, sum by (stage, le) (rate(simsearch_stage_latency_seconds_bucket{{{SEL}}}[5m])))"
        )

    panels = [
        panel(
            TimeSeries,
            1,
            "Queries/s by method and protocol",
            [(f"sum by (method, protocol) (rate(simsearch_requests_total{{{SEL}}}[5m]))", "{{method}} ({{protocol}})")],
            0,
            0,
            unit="reqps",
        ),
        panel(
            TimeSeries,
            2,
            "Error ratio by status code",
            [
                (
                    f'sum by (code) (rate(simsearch_requests_total{{{SEL}, code!="OK"}}[5m]))'
                    " / ignoring(code) group_left "
                    f"sum(rate(simsearch_requests_total{{{SEL}}}[5m]))",
                    "{{code}}",
                )
            ],
            12,
            0,
            unit="percentunit",
        ),
        panel(
            TimeSeries,
            3,
            "Latency per stage p50 / p95 / p99",
            [(stage_quantile(q), f"{{{{stage}}}} p{int(q * 100)}") for q in (0.5, 0.95, 0.99)],
            0,
            8,
            unit="s",
        ),
        panel(
            TimeSeries,
            4,
            "Search latency p50 / p95 / p99",
            [
                (
                    f"histogram_quantile({q}, sum by (le) (rate(simsearch_request_latency_seconds_bucket{{{SEL}, "
                    f'method="Search"}}[5m])))',
                    f"p{int(q * 100)}",
                )
                for q in (0.5, 0.95, 0.99)
            ],
            12,
            8,
            unit="s",
        ),
        panel(
            TimeSeries,
            5,
            "Batch size (mean) and queue depth",
            [
                (
                    f"sum(rate(simsearch_batch_size_sum{{{SEL}}}[5m]))"
                    f" / sum(rate(simsearch_batch_size_count{{{SEL}}}[5m]))",
                    "mean batch",
                ),
                (f"sum(simsearch_queue_depth{{{SEL}}})", "queued"),
            ],
            0,
            16,
        ),
        panel(
            TimeSeries,
            6,
            "Online Recall@$k by source",
            [(f'simsearch_recall_at_k{{{SEL}, k="$k"}}', "{{source}} {{instance}}")],
            12,
            16,
            unit="percentunit",
        ),
        panel(
            TimeSeries,
            7,
            "ANN recall@$k (vs exact search)",
            [(f'simsearch_ann_recall_at_k{{{SEL}, k="$k"}}', "{{instance}}")],
            0,
            24,
            unit="percentunit",
        ),
        panel(
            TimeSeries,
            8,
            "Reloads",
            [
                (f"increase(simsearch_reloads_total{{{SEL}}}[1h])", "reloads {{instance}}"),
                (f"increase(simsearch_reload_failures_total{{{SEL}}}[1h])", "failures {{instance}}"),
            ],
            12,
            24,
        ),
        panel(
            Stat,
            9,
            "Live index / model",
            [(f"simsearch_index_info{{{SEL}}}", "{{index_version}} · model {{model_id}} · {{factory}}")],
            0,
            32,
            w=16,
            h=4,
        ),
        panel(Stat, 10, "Index size", [(f"sum(simsearch_index_size{{{SEL}}})", "vectors")], 16, 32, w=8, h=4),
        # process_* series come from every exporter; `and on (instance)` keeps the search servers'.
        panel(
            TimeSeries,
            11,
            "Resident memory (flat across reloads when healthy)",
            [
                (
                    f"process_resident_memory_bytes{{{SEL}}} and on (instance) simsearch_index_loaded",
                    "RSS {{instance}}",
                ),
                (f"simsearch:process_resident_memory_bytes:deriv1h{{{SEL}}}", "growth per hour {{instance}}"),
            ],
            0,
            36,
            unit="bytes",
        ),
        panel(
            TimeSeries,
            12,
            "Open file descriptors",
            [(f"process_open_fds{{{SEL}}} and on (instance) simsearch_index_loaded", "{{instance}}")],
            12,
            36,
        ),
        panel(
            TimeSeries,
            13,
            "Filtered queries/s by planner path (exact over the matches, or the index with a selector)",
            [(f"sum by (path) (rate(simsearch_filtered_queries_total{{{SEL}}}[5m]))", "{{path}}")],
            0,
            44,
            unit="reqps",
        ),
        # A sharded server's (`serve --ray`): the slowest shard sets a query's latency.
        panel(
            TimeSeries,
            14,
            "Shard calls p99 by shard (round trip from the ingress; search inside the shard)",
            [
                (
                    "histogram_quantile(0.99, sum by (le, shard) "
                    f'(rate(simsearch_shard_latency_seconds_bucket{{{SEL}, method="search"}}[5m])))',
                    "round trip {{shard}}",
                ),
                (
                    "histogram_quantile(0.99, sum by (le, shard) "
                    f"(rate(simsearch_shard_search_seconds_bucket{{{SEL}}}[5m])))",
                    "search {{shard}}",
                ),
            ],
            12,
            44,
            unit="s",
        ),
        panel(
            TimeSeries,
            15,
            "Shard rows and replica memory",
            [
                (f"max by (shard) (simsearch_shard_rows{{{SEL}}})", "rows {{shard}}"),
                (f"max by (shard) (simsearch_shard_memory_bytes{{{SEL}}})", "memory {{shard}}"),
            ],
            0,
            52,
        ),
        panel(
            TimeSeries,
            16,
            "Shard call failures/s (each try; past the retries a query is UNAVAILABLE or partial)",
            [(f"sum by (shard) (rate(simsearch_shard_failures_total{{{SEL}}}[5m]))", "{{shard}}")],
            12,
            52,
        ),
    ]
    templating = variables("simsearch_index_loaded", "simsearch_recall_at_k")
    return Dashboard(
        title="simsearch · Search service",
        uid="simsearch-search",
        panels=panels,
        templating=templating,
        refresh="30s",
        tags=["simsearch"],
    )


def index_builds() -> Dashboard:
    panels = [
        panel(
            TimeSeries,
            1,
            "Build duration of the live index",
            [(f"simsearch_index_build_duration_seconds{{{SEL}}}", "{{instance}}")],
            0,
            0,
            unit="s",
        ),
        panel(
            TimeSeries,
            2,
            "Index size and skipped rows",
            [
                (f'simsearch_index_build_rows{{{SEL}, state="indexed"}}', "indexed {{instance}}"),
                (f'simsearch_index_build_rows{{{SEL}, state="skipped"}}', "skipped {{instance}}"),
            ],
            12,
            0,
        ),
        panel(
            TimeSeries,
            3,
            "Quality gate: ANN recall vs exact (build time)",
            [(f"simsearch_index_build_ann_recall{{{SEL}}}", "{{instance}}")],
            0,
            8,
            unit="percentunit",
        ),
        panel(
            TimeSeries,
            4,
            "Quality gate: probe Recall@$k (build time)",
            [(f'simsearch_index_build_probe_recall_at_k{{{SEL}, k="$k"}}', "{{instance}}")],
            12,
            8,
            unit="percentunit",
        ),
        panel(
            Stat,
            5,
            "Published past a failed gate",
            [(f"max(simsearch_index_build_gate_forced{{{SEL}}})", "forced")],
            0,
            16,
            w=8,
            h=4,
        ),
        panel(
            Stat,
            6,
            "Age of the live index",
            [(f"time() - max(simsearch_index_build_created_timestamp_seconds{{{SEL}}})", "age")],
            8,
            16,
            w=8,
            h=4,
            unit="s",
        ),
        panel(
            Stat,
            7,
            "Live version",
            [(f"simsearch_index_info{{{SEL}}}", "{{index_version}} · {{factory}}")],
            16,
            16,
            w=8,
            h=4,
        ),
    ]
    templating = variables("simsearch_index_loaded", "simsearch_index_build_probe_recall_at_k")
    return Dashboard(
        title="simsearch · Index builds",
        uid="simsearch-index-builds",
        panels=panels,
        templating=templating,
        refresh="1m",
        tags=["simsearch"],
    )


def training() -> Dashboard:
    """Training runs as Ray exports them: the loop's gauges carry a `run` label."""
    panels = [
        panel(TimeSeries, 1, "Training loss (epoch mean)", [(f"ray_simsearch_train_loss{{{SEL}}}", "{{run}}")], 0, 0),
        panel(
            TimeSeries,
            2,
            "Learning rate by parameter group",
            [(f"ray_simsearch_train_learning_rate{{{SEL}}}", "{{run}} {{group}}")],
            12,
            0,
        ),
        panel(
            TimeSeries,
            3,
            "Validation Recall@$k",
            [(f'ray_simsearch_train_val_recall_at_k{{{SEL}, k="$k"}}', "{{run}}")],
            0,
            8,
            unit="percentunit",
        ),
        panel(
            TimeSeries,
            4,
            "Training images/s (all workers)",
            [(f"ray_simsearch_train_images_per_second{{{SEL}}}", "{{run}}")],
            12,
            8,
        ),
        panel(
            Stat,
            5,
            "Epochs finished",
            [(f"max by (run) (ray_simsearch_train_epoch{{{SEL}}}) + 1", "{{run}}")],
            0,
            16,
            w=24,
            h=4,
        ),
    ]
    return Dashboard(
        title="simsearch · Training",
        uid="simsearch-training",
        panels=panels,
        templating=variables("ray_simsearch_train_epoch", "ray_simsearch_train_val_recall_at_k"),
        refresh="30s",
        tags=["simsearch"],
    )


DASHBOARDS = {
    "search-service.json": search_service,
    "index-builds.json": index_builds,
    "training.json": training,
}


def render(factory) -> str:
    return json.dumps(factory().to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for name, factory in DASHBOARDS.items():
        (OUT / name).write_text(render(factory))
        print(OUT / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
