"""A do-nothing ext_proc server: the floor of any Python (grpcio) external processor.

``python -m bench.noop_extproc --port P --target IP:PORT [--ready-file F]`` answers every message
with an empty CONTINUE, except the request body, which it answers with the routing header set to
``--target`` (so Envoy's epp.yaml still routes). ``bench.overhead`` runs it beside kvroute: the
difference between the two is kvroute's own work; the rest is the price of gRPC in Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import envoy


class Noop(pb_grpc.ExternalProcessorServicer):
    def __init__(self, target: str) -> None:
        self.route = {"x-gateway-destination-endpoint": target}

    async def Process(
        self, request_iterator: AsyncIterator[envoy.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[envoy.ProcessingResponse]:
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                yield envoy.request_headers_response()
            elif kind == "request_body":
                yield envoy.request_body_response(set_headers=self.route, clear_route_cache=True)
            elif kind == "response_headers":
                yield envoy.response_headers_response()
            elif kind == "response_body":
                yield envoy.response_body_response()


async def serve(port: int, target: str, ready_file: str | None) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(target), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    if ready_file:
        Path(ready_file).write_text(json.dumps({"port": bound}))
    await server.wait_for_termination()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.noop_extproc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--target", required=True, help="ip:port every request is routed to")
    ap.add_argument("--ready-file")
    a = ap.parse_args()
    asyncio.run(serve(a.port, a.target, a.ready_file))


if __name__ == "__main__":
    main()
