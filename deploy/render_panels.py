"""Draw dashboard panels from a real Prometheus with matplotlib (a picture without Grafana).

python deploy/render_panels.py --prometheus http://127.0.0.1:9090 --minutes 5 --out docs/dashboard-search.png
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dashboards" / "search-service.json"


def query_range(base: str, expr: str, start: float, end: float, step: str) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    answer = json.loads(urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=30).read())
    if answer["status"] != "success":
        raise RuntimeError(f"{expr}: {answer}")
    return answer["data"]["result"]


def legend(template: str, labels: dict) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--step", default="5s")
    parser.add_argument("--panels", default="1,3,5,6", help="panel ids of the Search service dashboard")
    parser.add_argument("--out", default="docs/dashboard-search.png")
    args = parser.parse_args()
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = [int(p) for p in args.panels.split(",")]
    panels = [p for p in dashboard["panels"] if p["id"] in wanted]
    end = time.time()
    start = end - args.minutes * 60
    fig, axes = plt.subplots(2, (len(panels) + 1) // 2, figsize=(14, 8), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            expr = target["expr"].replace("$instance", ".+").replace("$k", "1")
            for series in query_range(args.prometheus, expr, start, end, args.step):
                xs = [datetime.fromtimestamp(float(t)) for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_title(panel["title"].replace("$k", "1"))
        ax.legend(fontsize=7, loc="best")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{dashboard['title']} — drawn from Prometheus at {args.prometheus}")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(args.out)


if __name__ == "__main__":
    main()
