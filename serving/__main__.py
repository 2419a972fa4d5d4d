"""`python -m serving {serve,query,info}`: run the search server, or query one."""

from __future__ import annotations

import os

# Before faiss loads OpenMP: idle OpenMP threads that busy-wait between searches take the cores
# gRPC and decoding need (measured: 970 → 1,230 q/s at concurrency 32 on 2 cores). Set
# OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import grpc  # noqa: E402

from core.cli import add_verbose_flag, run_cli  # noqa: E402
from core.config import from_cli  # noqa: E402

if TYPE_CHECKING:
    from serving.server import ServerConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve similarity search over gRPC")
    serve.add_argument("--config", help="YAML/TOML file with any of the options below")
    serve.add_argument("--index-root", dest="index_root", help="index root with versions/ and CURRENT")
    serve.add_argument("--model", help="model artifact directory (default: the one the index records)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="gRPC port (0 picks a free one)")
    serve.add_argument("--metrics-port", dest="metrics_port", type=int, help="Prometheus HTTP port")
    serve.add_argument("--provider", choices=["auto", "cpu", "cuda"], help="ONNX Runtime provider")
    serve.add_argument(
        "--workers", type=int, help="decode threads, and inference threads with batching off (default: CPU count)"
    )
    serve.add_argument(
        "--admin-token", dest="admin_token", help="bearer token for IndexAdmin (or SIMSEARCH_ADMIN_TOKEN)"
    )
    serve.add_argument(
        "--event-loop", dest="event_loop", choices=["uvloop", "asyncio"], help="the gRPC event loop (default uvloop)"
    )
    serve.add_argument(
        "--inline-decode-pixels",
        dest="inline_decode_pixels",
        type=int,
        help="decode on the event loop when image and model input have at most this many pixels "
        "(default 4096; 0: never)",
    )
    serve.add_argument(
        "--inference-decode-pixels",
        dest="inference_decode_pixels",
        type=int,
        help="decode images of at most this many pixels in the inference thread that embeds them, "
        "sparing a hop to a decode thread; larger ones decode in the pool while they wait (default 65536)",
    )
    serve.add_argument("--max-k", dest="max_k", type=int)
    serve.add_argument("--max-message-bytes", dest="max_message_bytes", type=int)
    serve.add_argument("--max-image-pixels", dest="max_image_pixels", type=int)
    serve.add_argument("--max-batch-queries", dest="max_batch_queries", type=int, help="queries per SearchBatch")
    serve.add_argument(
        "--batching", type=lambda v: v.lower() in ("1", "true", "on", "yes"), help="dynamic batching on/off"
    )
    serve.add_argument("--max-batch-size", dest="max_batch_size", type=int, help="queries per ORT/faiss batch")
    serve.add_argument(
        "--batch-streams",
        dest="batch_streams",
        type=int,
        help="batches run at once, each on its own thread and share of the ONNX Runtime threads "
        "(default 2); one starts beside another once half of batch size / streams queries are queued",
    )
    serve.add_argument(
        "--max-connection-age-s",
        dest="max_connection_age_s",
        type=float,
        help="ask a connection this old to go, so clients reconnect and spread over new replicas "
        "(default 300; 0: never)",
    )
    serve.add_argument(
        "--max-connection-age-grace-s",
        dest="max_connection_age_grace_s",
        type=float,
        help="how long an old connection's calls may take to finish (default 30)",
    )
    serve.add_argument(
        "--keepalive-s",
        dest="keepalive_s",
        type=float,
        help="ping a connection idle this long and close it if no answer within 20 s (default 60; 0: off)",
    )
    serve.add_argument("--max-wait-ms", dest="max_wait_ms", type=float, help="longest wait to fill a batch")
    serve.add_argument("--max-queue", dest="max_queue", type=int, help="queued queries before RESOURCE_EXHAUSTED")
    serve.add_argument(
        "--intra-op-threads",
        dest="intra_op_threads",
        type=int,
        help="ONNX Runtime threads per run (default: CPU count, at most 8, for a run made alone, "
        "shared out among the runs made at once: --batch-streams, or --workers with --batching "
        "false); setting it uses that many for every run",
    )
    serve.add_argument(
        "--run-rows",
        dest="run_rows",
        type=int,
        help="embed a batch in ONNX Runtime runs of at most this many images (0: the whole batch in "
        "one run; default: the fastest, measured when a model loads)",
    )
    serve.add_argument(
        "--ort-spinning",
        dest="ort_spinning",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let idle ONNX Runtime threads busy-wait (default off: they would steal gRPC's cores)",
    )
    serve.add_argument(
        "--search-token", dest="search_token", help="bearer token required for search (or SIMSEARCH_SEARCH_TOKEN)"
    )
    serve.add_argument("--tls-cert", dest="tls_cert", help="PEM certificate chain (enables TLS)")
    serve.add_argument("--tls-key", dest="tls_key", help="PEM private key")
    serve.add_argument("--recall-ks", dest="recall_ks", help="comma-separated K for online Recall@K (default 1,5,10)")
    serve.add_argument("--recall-window", dest="recall_window", type=int, help="labelled answers per sliding window")
    serve.add_argument(
        "--ann-sample-rate", dest="ann_sample_rate", type=float, help="fraction of queries re-run exactly"
    )
    serve.add_argument(
        "--probe-interval-s",
        dest="probe_interval_s",
        type=float,
        help="seconds between probe rounds; one also runs at start and after each reload "
        "(default 60; 0: no probe rounds at all)",
    )
    serve.add_argument("--probe-size", dest="probe_size", type=int, help="probe images per round")
    serve.add_argument("--probe-catalog", dest="probe_catalog", help="labelled catalog of held-out probe images")
    serve.add_argument(
        "--watch-current",
        dest="watch_current",
        action="store_const",
        const=True,
        help="reload when the index root's CURRENT changes",
    )
    serve.add_argument("--watch-interval-s", dest="watch_interval_s", type=float)
    serve.add_argument("--access-log", dest="access_log", action="store_const", const=True, help="log every RPC")
    serve.add_argument("--log-format", dest="log_format", choices=["json", "text"], default="json")

    query = sub.add_parser("query", help="search with one or more image files")
    query.add_argument("images", nargs="+", help="image files")
    query.add_argument("--target", default="127.0.0.1:50051", help="server address host:port")
    query.add_argument("--k", type=int, default=10, help="neighbours per image")
    query.add_argument("--timeout", type=float, default=10.0, help="deadline per call in seconds")
    query.add_argument("--json", action="store_true", help="print JSON instead of a table")
    query.add_argument("--tls-ca", help="PEM root certificate of a TLS server")
    query.add_argument("--token", help="bearer token when the server requires one for search")

    info = sub.add_parser("info", help="print the server's live versions and limits")
    info.add_argument("--target", default="127.0.0.1:50051")
    info.add_argument("--tls-ca", help="PEM root certificate of a TLS server")
    info.add_argument("--token", help="bearer token when the server requires one for search")
    add_verbose_flag(sub)
    return parser


def server_config(argv: list[str]) -> ServerConfig:
    """The configuration `python -m serving serve ARGV...` runs with (flags, config file, environment)."""
    return _server_config(_parser().parse_args(["serve", *argv]))


def _server_config(args: argparse.Namespace) -> ServerConfig:
    from serving.server import ServerConfig

    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "log_format"})
    config = from_cli(ServerConfig, options)
    config.admin_token = config.admin_token or os.environ.get("SIMSEARCH_ADMIN_TOKEN") or None
    config.search_token = config.search_token or os.environ.get("SIMSEARCH_SEARCH_TOKEN") or None
    return config


def _serve(args: argparse.Namespace) -> None:
    from serving import logs
    from serving.server import run

    logs.configure(args.log_format)
    run(_server_config(args))


def _query(args: argparse.Namespace) -> None:
    from google.protobuf.json_format import MessageToDict

    from serving.client import SearchClient

    if args.k <= 0:
        raise ValueError(f"--k must be at least 1, got {args.k}")
    results = []
    with SearchClient(args.target, timeout=args.timeout, tls_ca=args.tls_ca, token=args.token) as client:
        for image in args.images:
            try:
                response = client.search_image(image, k=args.k)
            except FileNotFoundError:
                raise FileNotFoundError(f"image file not found: {image}") from None
            results.append((image, response))
    if args.json:
        print(json.dumps([{"image": i, **MessageToDict(r)} for i, r in results], indent=2))
        return
    for image, response in results:
        print(
            f"{image}  (index {response.index_version}, model {response.model_id}, {response.timings.total_ms:.1f} ms)"
        )
        print(f"  {'rank':>4}  {'score':>7}  {'label':<12} id")
        for rank, n in enumerate(response.neighbors, 1):
            print(f"  {rank:>4}  {n.score:7.4f}  {n.label:<12} {n.id}")


def _info(args: argparse.Namespace) -> None:
    from google.protobuf.json_format import MessageToDict

    from serving.client import SearchClient

    with SearchClient(args.target, tls_ca=args.tls_ca, token=args.token) as client:
        print(json.dumps(MessageToDict(client.get_info()), indent=2))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"serve": _serve, "query": _query, "info": _info}

    def command() -> None:
        try:
            commands[args.command](args)
        except grpc.RpcError as exc:
            raise ValueError(f"server answered {exc.code().name}: {exc.details()}") from None

    return run_cli(command, verbose=bool(args.verbose))


if __name__ == "__main__":
    sys.exit(main())
