"""A do-nothing ``ModelExecutor`` server: its ``Session`` answers every step with an empty result
of the same kind, and nothing else. Round trips against it are the floor that the gRPC transport,
grpc.aio and the client library set before any executor work (the baseline of the stub rows).

    python -m benchmarks.floor_server PORT
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from ferrum_client import pb
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc


class FloorServicer(executor_pb2_grpc.ModelExecutorServicer):
    async def Session(self, request_iterator, context):  # noqa: N802 - gRPC method name
        async for req in request_iterator:
            which = req.WhichOneof("step")
            resp = pb.SessionResponse(step_id=req.step_id)
            getattr(resp, which).SetInParent()
            yield resp


async def main(port: int) -> None:
    server = grpc.aio.server()
    executor_pb2_grpc.add_ModelExecutorServicer_to_server(FloorServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("READY", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
