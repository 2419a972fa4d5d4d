"""Grafana dashboards: generated as code, committed JSON up to date, structurally valid."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

from tests.support.dashboards import GRAFANA, SERVER_DASHBOARDS

ROOT = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("generate_dashboards", GRAFANA / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_json_matches_the_generator():
    gen = generator()
    for name, factory in gen.DASHBOARDS.items():
        committed = (GRAFANA / "dashboards" / name).read_text()
        assert committed == gen.render(factory), f"{name} is stale: run python deploy/grafana/generate.py"


def test_panels_are_valid_and_use_the_provisioned_datasource():
    uids = {
        d["uid"]
        for d in yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    }
    for path in (GRAFANA / "dashboards").glob("*.json"):
        dashboard = json.loads(path.read_text())
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] in uids
            assert panel["targets"], f"{panel['title']} has no query"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] in uids
        names = {t["name"] for t in dashboard["templating"]["list"]}
        assert {"instance", "k"} <= names
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/simsearch.yml").read_text())
    assert provider["providers"][0]["options"]["path"]


def test_every_dashboard_is_checked_against_real_metrics():

    checked = {*SERVER_DASHBOARDS, "training.json"}  # training.json: the Ray training run test
    assert {p.name for p in (GRAFANA / "dashboards").glob("*.json")} == checked
