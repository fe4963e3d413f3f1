"""The vLLM protocol's ``StartProfile`` / ``StopProfile``: ``torch.profiler`` over the served
model's steps (``hosting/profiler.py``), admin only (like ``FlushCache``: the trace records every
tenant's steps and shapes).

Refusals are gRPC statuses, as SMG's own servicers answer these RPCs (its TokenSpeed servicer
aborts a failed start or stop with a status and answers ``ProfileResponse{success: true}``
otherwise): FAILED_PRECONDITION for what the server's state forbids (profiling off: no
``--profile-dir``, named; a model the torch profiler cannot see, llama.cpp, named; a profile
already running; ``StopProfile`` with none started), INVALID_ARGUMENT naming the field for what
a request asks that is not served (``output_dir`` that is not one subdirectory name, an unknown
activity, GPU activity on a CPU model, ``profile_by_stage``, a step count out of range).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from smg_grpc_proto.generated import common_pb2 as cpb

from ..core import errors
from ..hosting.profiler import ACTIVITIES, MAX_PROFILE_STEPS, ProfileOptions, StepProfiler, subdir_name

if TYPE_CHECKING:
    from ..hosting.host import ModelHost


def options(request: cpb.StartProfileRequest, host: "ModelHost") -> ProfileOptions:
    """The request checked into :class:`ProfileOptions` for ``host``'s model."""
    subdir = subdir_name(request.output_dir if request.HasField("output_dir") else "")
    steps = {}
    for name in ("start_step", "num_steps"):
        v = getattr(request, name) if request.HasField(name) else 0
        low = 1 if name == "num_steps" and request.HasField(name) else 0
        if not low <= v <= MAX_PROFILE_STEPS:
            raise errors.invalid(f"{name} = {v}: give {low} to {MAX_PROFILE_STEPS} model steps"
                                 + (" (or leave it unset: until StopProfile)" if low else ""), field=name,
                                 limit=MAX_PROFILE_STEPS)
        steps[name] = v
    asked = {a.strip().upper() for a in request.activities}
    unknown = sorted(asked - set(ACTIVITIES))
    if unknown:
        raise errors.invalid(f"activities: {', '.join(unknown)} unknown; give any of {', '.join(ACTIVITIES)}",
                             field="activities")
    on_cuda = str(host.info.device).startswith("cuda")
    if asked & {"GPU", "CUDA"} and not on_cuda:
        raise errors.invalid(f"activities: model {host.model_id!r} runs on {host.info.device or 'the CPU'}, so there "
                             "is no GPU activity to record (CPU is)", field="activities")
    if request.profile_by_stage:
        raise errors.invalid("profile_by_stage is not supported by ferrum-service (one trace of every step)",
                             field="profile_by_stage")
    return ProfileOptions(subdir=subdir, start_step=steps["start_step"], num_steps=steps["num_steps"],
                          cuda=on_cuda and (not asked or bool(asked & {"GPU", "CUDA"})), memory="MEM" in asked,
                          with_stack=request.with_stack, record_shapes=request.record_shapes)


async def start(profiler: StepProfiler, host: "ModelHost", request: cpb.StartProfileRequest) -> cpb.ProfileResponse:
    profiler.check_host(host)  # off / not a torch model: said before the request's details
    return cpb.ProfileResponse(success=True, message=await profiler.start(host, options(request, host)))


async def stop(profiler: StepProfiler) -> cpb.ProfileResponse:
    return cpb.ProfileResponse(success=True, message=await profiler.stop())


__all__ = ["options", "start", "stop"]
