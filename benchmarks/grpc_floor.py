"""The gRPC floor: a bare grpc.aio server (on uvloop, like the real one) that answers Search
with a canned 10-neighbour response — no decoding, no model, no index. What it reaches under the
same load generator is what Python gRPC alone allows on this machine.

Prints {"port": N} once listening; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

import grpc

from protos.simsearch.v1 import search_pb2 as pb
from protos.simsearch.v1 import search_pb2_grpc as pb_grpc

CANNED = pb.SearchResponse(
    neighbors=[pb.Neighbor(id=f"U+0041/{i:03d}", score=0.9, label="U+0041") for i in range(10)],
    index_version="floor",
    model_id="floor",
)


class FloorServicer(pb_grpc.SimilaritySearchServicer):
    async def Search(self, request, context):
        return CANNED


async def serve(port: int, stopped: asyncio.Event) -> None:
    server = grpc.aio.server()
    pb_grpc.add_SimilaritySearchServicer_to_server(FloorServicer(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(json.dumps({"port": bound}), flush=True)
    await stopped.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args()
    if args.event_loop == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    stopped = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopped.set)
    loop.run_until_complete(serve(args.port, stopped))


if __name__ == "__main__":
    main()
