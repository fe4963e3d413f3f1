"""Server reflection, as ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``, resolving every
symbol: services, methods, messages, fields, enums and enum values.

grpcurl and ghz ask for ``grpc.reflection.v1`` first and resolve a method (``describe
ferrum.executor.v1.ModelExecutor.Prefill``, ``ghz --call ...``) by asking for the file that
contains that symbol. grpcio-reflection serves only v1alpha, and the protobuf runtime's pool does
not look up method names, so both failed with "Symbol not found". This servicer answers both
versions (their messages are the same on the wire; only the package differs), falls back from a
member symbol to its parent when the pool cannot find it, and returns each file with its
transitive dependencies so a tool needs one round trip per symbol.
"""

from __future__ import annotations

from typing import AsyncIterator, Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha import reflection_pb2_grpc

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE = "grpc.reflection.v1alpha.ServerReflection"


def _v1_pool() -> descriptor_pool.DescriptorPool:
    """A pool holding ``grpc/reflection/v1/reflection.proto``, derived from the v1alpha file (the
    two differ only in package and file name), so the v1 service can be described too."""
    fdp = descriptor_pb2.FileDescriptorProto()
    rpb.DESCRIPTOR.CopyToProto(fdp)
    alpha, v1 = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp.name = "grpc/reflection/v1/reflection.proto"
    fdp.package = "grpc.reflection.v1"
    for msg in fdp.message_type:
        for f in msg.field:
            if f.type_name.startswith(alpha):
                f.type_name = v1 + f.type_name[len(alpha):]
    for svc in fdp.service:
        for m in svc.method:
            m.input_type = v1 + m.input_type[len(alpha):]
            m.output_type = v1 + m.output_type[len(alpha):]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return pool


class ReflectionServicer(reflection_pb2_grpc.ServerReflectionServicer):
    """Answers reflection requests from the default descriptor pool (where the generated code of
    every served service registers itself) and the derived v1 reflection file."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self.service_names = sorted(set(service_names) | {V1_SERVICE, V1ALPHA_SERVICE})
        self.pools = [descriptor_pool.Default(), _v1_pool()]

    async def ServerReflectionInfo(self, request_iterator, context) -> AsyncIterator[rpb.ServerReflectionResponse]:
        async for req in request_iterator:
            yield self.answer(req)

    def answer(self, req: rpb.ServerReflectionRequest) -> rpb.ServerReflectionResponse:
        """The response to one reflection request."""
        resp = rpb.ServerReflectionResponse(valid_host=req.host, original_request=req)
        which = req.WhichOneof("message_request")
        try:
            if which == "list_services":
                resp.list_services_response.service.extend(
                    rpb.ServiceResponse(name=n) for n in self.service_names)
            elif which == "file_by_filename":
                self._files(resp, self._find(lambda p: p.FindFileByName(req.file_by_filename)))
            elif which == "file_containing_symbol":
                self._files(resp, self._file_of_symbol(req.file_containing_symbol))
            elif which == "file_containing_extension":
                ext = req.file_containing_extension
                self._files(resp, self._find(lambda p: p.FindExtensionByNumber(
                    p.FindMessageTypeByName(ext.containing_type), ext.extension_number).file))
            elif which == "all_extension_numbers_of_type":
                name = req.all_extension_numbers_of_type
                msg = self._find(lambda p: p.FindMessageTypeByName(name))
                pool = next(p for p in self.pools if self._has_message(p, name))
                resp.all_extension_numbers_response.base_type_name = name
                resp.all_extension_numbers_response.extension_number.extend(
                    sorted(e.number for e in pool.FindAllExtensions(msg)))
            else:
                raise KeyError("unknown request")
        except KeyError as e:
            resp.ClearField("message_response")
            resp.error_response.error_code = grpc.StatusCode.NOT_FOUND.value[0]
            resp.error_response.error_message = f"not found: {e.args[0] if e.args else which}"
        return resp

    # ---- lookups ----------------------------------------------------------------------------------
    def _find(self, lookup):
        for pool in self.pools:
            try:
                return lookup(pool)
            except KeyError:
                continue
        raise KeyError("symbol")

    @staticmethod
    def _has_message(pool, name: str) -> bool:
        try:
            pool.FindMessageTypeByName(name)
            return True
        except KeyError:
            return False

    def _file_of_symbol(self, symbol: str):
        """The file defining ``symbol``; a method, field or enum value resolves through its parent."""
        for pool in self.pools:
            try:
                return pool.FindFileContainingSymbol(symbol)
            except KeyError:
                pass
            parent, _, member = symbol.rpartition(".")
            if not parent:
                continue
            for find, has in ((pool.FindServiceByName, lambda d: member in d.methods_by_name),
                              (pool.FindMessageTypeByName, lambda d: member in d.fields_by_name
                               or member in d.nested_types_by_name or member in d.enum_types_by_name),
                              (pool.FindEnumTypeByName, lambda d: member in d.values_by_name)):
                try:
                    d = find(parent)
                except KeyError:
                    continue
                if has(d):
                    return d.file
        raise KeyError(symbol)

    @staticmethod
    def _files(resp: rpb.ServerReflectionResponse, fd) -> None:
        """``fd`` and its transitive dependencies, each serialized once (``fd`` first)."""
        seen: set[str] = set()
        out: list[bytes] = []
        stack = [fd]
        while stack:
            f = stack.pop(0)
            if f.name in seen:
                continue
            seen.add(f.name)
            proto = descriptor_pb2.FileDescriptorProto()
            f.CopyToProto(proto)
            out.append(proto.SerializeToString())
            stack.extend(f.dependencies)
        resp.file_descriptor_response.file_descriptor_proto.extend(out)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection (v1 and v1alpha) for ``service_names`` on ``server``."""
    servicer = ReflectionServicer(service_names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=rpb.ServerReflectionRequest.FromString,
            response_serializer=rpb.ServerReflectionResponse.SerializeToString),
    }),))


__all__ = ["ReflectionServicer", "V1_SERVICE", "V1ALPHA_SERVICE", "enable_reflection"]
