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
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402

from core.cli import COMMAND, add_config_flag, add_verbose_flag, run_cli  # noqa: E402
from core.config import add_options, from_cli  # noqa: E402
from serving.config import ServerConfig  # noqa: E402

# command → (help, configuration class, its options this command does not take)
COMMANDS = {"serve": ("serve similarity search over gRPC", ServerConfig, ())}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help=COMMANDS["serve"][0])
    add_config_flag(serve)
    add_options(serve, ServerConfig)
    serve.add_argument("--log-format", dest="log_format", choices=["json", "text"], default="json")

    query = sub.add_parser(
        "query",
        help="search with image files, indexed item ids or phrases",
        description="Search the server with each IMAGE (and each --item-id, each --text): a table of neighbours per "
        "query. "
        "On an index with an item field answers are grouped by it (k counts items; a column names each row's "
        'group; --group-by "" for plain rows). '
        "A query that fails (an unreadable file, an image the server cannot decode) is named on standard "
        "error, the others are still answered, and the exit code is 2.",
    )
    query.add_argument("images", nargs="*", metavar="IMAGE", help="image files to search with")
    query.add_argument(
        "--item-id",
        dest="item_ids",
        action="append",
        default=[],
        metavar="ID",
        help="search with an indexed item's own vector (repeatable; the item itself is left out)",
    )
    query.add_argument(
        "--text",
        dest="texts",
        action="append",
        default=[],
        metavar="PHRASE",
        help="search with a phrase, embedded by the index's text model (repeatable; index build --text-model)",
    )
    _add_target_flags(query)
    query.add_argument(
        "--k", type=_count, default=10, help="neighbours per query (with --min-score, 0: up to the server's max_k)"
    )
    query.add_argument("--min-score", type=float, help="every neighbour at or above this cosine similarity")
    query.add_argument(
        "--group-by",
        metavar="FIELD",
        help="k counts groups of this declared field, best first (default: the index's item field, when it has "
        'one — `serving info` shows item_field; --group-by "" for plain rows)',
    )
    query.add_argument("--per-group", type=_count, help="rows per group of a grouped answer (default 1)")
    query.add_argument(
        "--filter",
        metavar="JSON",
        help='only items matching this filter, as proto3 JSON, e.g. \'{"must": [{"field": "label", "value": "cat"}]}\' '
        "(fields declared at index build with --filterable; `serving info` lists them)",
    )
    query.add_argument(
        "--exclude-id",
        dest="exclude_ids",
        action="append",
        default=[],
        metavar="ID",
        help="leave this item id out of the answers (repeatable)",
    )
    query.add_argument(
        "--label",
        help="the queries' true label (on an index without labels: the item they should find, its item field's "
        "value): the server scores its answers into the traffic Recall@K",
    )
    query.add_argument("--json", action="store_true", help="print JSON instead of a table")

    info = sub.add_parser("info", help="print the server's live versions, limits and recall figures")
    _add_target_flags(info)
    add_verbose_flag(sub)
    return parser


DEFAULT_PORT = 50051
INT32_MAX = 2**31 - 1


def _count(text: str) -> int:
    """A non-negative count that fits the protocol's int32 fields."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be within 0..{INT32_MAX}, got {value}")
    return value


def target_address(target: str) -> str:
    """`HOST[:PORT]` with the default port filled in: gRPC's own default for a bare host is 443,
    which is never where this server listens. Addresses with a scheme (`dns:///…`, `unix:…`)
    pass as they are."""
    if "://" in target or target.startswith("unix:"):
        return target
    if target.startswith("["):  # [IPv6] or [IPv6]:PORT
        return target if "]:" in target else f"{target}:{DEFAULT_PORT}"
    if target.count(":") > 1:  # a bare IPv6 address
        return f"[{target}]:{DEFAULT_PORT}"
    return target if ":" in target else f"{target}:{DEFAULT_PORT}"


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        type=target_address,
        default=f"127.0.0.1:{DEFAULT_PORT}",
        help=f"the server's address, HOST[:PORT] (PORT defaults to {DEFAULT_PORT}; default: %(default)s)",
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="deadline per call in seconds (default: %(default)s)"
    )
    parser.add_argument("--tls-ca", help="PEM root certificate of a TLS server")
    parser.add_argument("--token", help="bearer token when the server requires one for search")


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


def _serve(args: argparse.Namespace, argv: list[str]) -> None:
    from serving import logs
    from serving.listen import worker_slot

    logs.configure(args.log_format)
    config = _server_config(args)
    if config.sharding.ray:  # the same server on Ray Serve, one deployment per index shard
        from serving.ray_serve import deployment as ray_serve

        ray_serve.run(config)
        return
    if worker_slot() is None and config.runtime.server_processes > 1:  # a supervisor and its workers
        from serving.workers import supervise

        code = supervise(config, argv)
        if code:
            raise SystemExit(code)
        return
    if worker_slot() is not None:
        from serving.workers import follow_supervisor

        follow_supervisor()
    from serving.server import run

    run(config)


# Statuses that belong to one query (its image, its item id, its text); any other ends the command.
_QUERY_STATUSES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _query_requests(args: argparse.Namespace) -> list[tuple[str, object]]:
    """(what the user named, its request — or the OSError reading it) for each query."""
    from google.protobuf.json_format import Parse, ParseError

    from protos.simsearch.v1 import search_pb2 as pb

    if not args.images and not args.item_ids and not args.texts:
        raise ValueError("nothing to search with: name image files, --item-id ID or --text PHRASE")
    for text in args.texts:
        if not text.strip():
            raise ValueError("--text is empty: give the phrase to search for")
    if args.k == 0 and args.min_score is None:
        raise ValueError("--k must be at least 1 (0 is only allowed with --min-score: up to the server's max_k)")
    if args.per_group == 0:
        raise ValueError("--per-group must be at least 1")
    common = pb.SearchRequest(k=args.k, exclude_ids=args.exclude_ids)
    if args.min_score is not None:
        common.min_score = args.min_score
    if args.group_by is not None:
        common.group_by = args.group_by
    if args.per_group is not None:
        common.per_group = args.per_group
    if args.label is not None:
        common.label = args.label
    if args.filter is not None:
        try:
            Parse(args.filter, common.filter)
        except ParseError as exc:
            raise ValueError(f"--filter is not a filter in proto3 JSON: {exc}") from None
    queries: list[tuple[str, object]] = []
    for image in args.images:
        try:
            data = Path(image).read_bytes()
        except OSError as exc:
            queries.append((image, exc))
            continue
        request = pb.SearchRequest()
        request.CopyFrom(common)
        request.image = data
        queries.append((image, request))
    for item_id in args.item_ids:
        request = pb.SearchRequest()
        request.CopyFrom(common)
        request.item_id = item_id
        queries.append((f"item {item_id}", request))
    for text in args.texts:
        request = pb.SearchRequest()
        request.CopyFrom(common)
        request.text = text
        queries.append((f"text {quoted(text)}", request))
    return queries


QUOTED_CHARS = 80


def quoted(text: str) -> str:
    """A phrase as the command names it: whole when short; a long one (a pasted page) by its
    first QUOTED_CHARS characters and its length, so the error about it stays one readable line."""
    if len(text) <= QUOTED_CHARS:
        return repr(text)
    return f"{text[:QUOTED_CHARS]!r}… ({len(text):,} characters)"


def _query(args: argparse.Namespace) -> None:
    from google.protobuf.json_format import MessageToDict

    from serving.client import SearchClient

    answers: list[tuple[str, object]] = []  # (query, response or error message)
    with SearchClient(args.target, timeout=args.timeout, tls_ca=args.tls_ca, token=args.token) as client:
        for name, request in _query_requests(args):
            if isinstance(request, OSError):
                answers.append((name, f"cannot read: {request.strerror}"))
                continue
            try:
                answers.append((name, client.search(request)))
            except grpc.RpcError as exc:
                if exc.code() not in _QUERY_STATUSES:
                    raise
                answers.append((name, f"server answered {exc.code().name}: {exc.details()}"))
    failed = [(name, answer) for name, answer in answers if isinstance(answer, str)]
    if args.json:
        print(
            json.dumps(
                [
                    {"query": name, "error": answer}
                    if isinstance(answer, str)
                    else {"query": name, **MessageToDict(answer)}
                    for name, answer in answers
                ],
                indent=2,
            )
        )
    else:
        for name, response in answers:
            if isinstance(response, str):
                continue
            field = response.group_by
            grouped = f", grouped by {field}, {args.per_group or 1} per group" if field else ""
            print(
                f"{name}  (index {response.index_version}, model {response.model_id}, "
                f"{response.timings.total_ms:.1f} ms{grouped})"
            )
            width = max([12, len(field), *(len(n.group) for n in response.neighbors)]) if field else 0
            group_head = f"{field:<{width}}  " if field else ""
            # grouped by the label (a folder per class, --item-field label), the group column is it
            labels = field != "label"
            label_head = f"{'label':<12} " if labels else ""
            print(f"  {'rank':>4}  {'score':>7}  {group_head}{label_head}id")
            for rank, n in enumerate(response.neighbors, 1):
                group = f"{n.group:<{width}}  " if field else ""
                label = f"{n.label:<12} " if labels else ""
                print(f"  {rank:>4}  {n.score:7.4f}  {group}{label}{n.id}")
            if response.truncated:
                print(f"  … fewer neighbours than all that qualify: cut at {len(response.neighbors)}")
    if failed:
        detail = "; ".join(f"{name}: {message}" for name, message in failed)
        raise ValueError(f"{len(failed)} of {len(answers)} queries failed — {detail}")


def _info(args: argparse.Namespace) -> None:
    from google.protobuf.json_format import MessageToDict

    from serving.client import SearchClient

    with SearchClient(args.target, timeout=args.timeout, tls_ca=args.tls_ca, token=args.token) as client:
        print(json.dumps(MessageToDict(client.get_info()), indent=2))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    commands = {"serve": lambda a: _serve(a, argv), "query": _query, "info": _info}

    def command() -> None:
        try:
            commands[args.command](args)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and args.command != "serve":
                raise ValueError(
                    f"cannot reach the server at {args.target} — is it running there? ({exc.details()})"
                ) from None
            raise ValueError(f"server answered {exc.code().name}: {exc.details()}") from None

    return run_cli(command, verbose=bool(args.verbose))


if __name__ == "__main__":
    sys.exit(main())
