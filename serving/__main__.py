"""`python -m serving {serve,query,info}`: run the search server, or query one."""

from __future__ import annotations

import os

# Before faiss loads OpenMP: idle OpenMP threads that busy-wait between searches take the cores
# gRPC and decoding need (docs/architecture.md, serving concurrency). Set OMP_WAIT_POLICY yourself to
# override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import grpc  # noqa: E402

from core.cli import add_config_flag, add_verbose_flag, run_cli  # noqa: E402
from core.config import add_options, from_cli  # noqa: E402
from serving.server import ServerConfig  # noqa: E402

# command → (help, configuration class, its options this command does not take)
COMMANDS = {"serve": ("serve similarity search over gRPC", ServerConfig, ())}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help=COMMANDS["serve"][0])
    add_config_flag(serve)
    add_options(serve, ServerConfig)
    serve.add_argument("--log-format", dest="log_format", choices=["json", "text"], default="json")

    query = sub.add_parser("query", help="search with one or more image files")
    query.add_argument("images", nargs="+", help="image files")
    query.add_argument("--target", default="127.0.0.1:50051", help="server address host:port")
    query.add_argument("--k", type=int, default=10, help="neighbours per image (with --min-score, 0: up to max_k)")
    query.add_argument("--min-score", type=float, help="every neighbour at or above this cosine similarity")
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
    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "log_format"})
    config = from_cli(ServerConfig, options)
    transport = config.transport
    transport.admin_token = transport.admin_token or os.environ.get("SIMSEARCH_ADMIN_TOKEN") or None
    transport.search_token = transport.search_token or os.environ.get("SIMSEARCH_SEARCH_TOKEN") or None
    return config


def _serve(args: argparse.Namespace) -> None:
    from serving import logs
    from serving.server import run

    logs.configure(args.log_format)
    run(_server_config(args))


def _query(args: argparse.Namespace) -> None:
    from google.protobuf.json_format import MessageToDict

    from serving.client import SearchClient

    if args.k < 0 or (args.k == 0 and args.min_score is None):
        raise ValueError(f"--k must be at least 1, got {args.k}")
    results = []
    with SearchClient(args.target, timeout=args.timeout, tls_ca=args.tls_ca, token=args.token) as client:
        for image in args.images:
            try:
                response = client.search_image(image, k=args.k, min_score=args.min_score)
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
        if response.truncated:
            print(f"  … more neighbours reach {args.min_score}: cut at k={len(response.neighbors)}")


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
