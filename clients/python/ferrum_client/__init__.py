"""Python client for the ferrum executor contract (``ferrum.executor.v1``).

``Client`` (sync) and ``AsyncClient`` (asyncio) wrap the generated stubs in ``_proto`` with typed
methods (the same ones; one request builder per RPC in ``requests``); ``messages`` builds
policies and requests; ``FerrumRpcError`` carries the gRPC code, ferrum's error kind and the
offending field.
"""

from . import messages
from ._proto.ferrum.executor.v1 import executor_pb2 as pb
from ._proto.ferrum.executor.v1 import types_pb2 as tpb
from .client import AsyncClient, AsyncSession, Client, GenerateStream, Session
from .errors import FerrumRpcError, step_progress

__all__ = ["AsyncClient", "AsyncSession", "Client", "GenerateStream", "Session", "FerrumRpcError", "messages", "pb",
           "step_progress",
           "tpb"]
