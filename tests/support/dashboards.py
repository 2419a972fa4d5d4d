"""The committed Grafana dashboards' queries, read as the tests check them."""

from __future__ import annotations

import json

from tests.support import ROOT

GRAFANA = ROOT / "deploy" / "grafana"


def dashboard_expressions(names: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the committed dashboards (all, or those named)."""
    out = []
    for path in sorted((GRAFANA / "dashboards").glob("*.json")):
        if names is not None and path.name not in names:
            continue
        for panel in json.loads(path.read_text())["panels"]:
            out += [(panel["title"], target["expr"]) for target in panel.get("targets", [])]
    return out


SERVER_DASHBOARDS = ("search-service.json", "index-builds.json")  # the search server's metrics
