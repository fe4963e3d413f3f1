"""``torch.profiler`` over one hosted model's steps (the vLLM protocol's ``StartProfile`` /
``StopProfile``, ``wire/vllm_profile.py``).

One profile at a time (:class:`StepProfiler`, one per server). The profiler records the thread it
was started on, so it is started and stopped on the model's worker thread (``ModelHost.submit``:
off the event loop, in order with the steps; the first start of a process takes ~1.5 s). Steps
are counted by the host's step hook (``ModelHost.step_hook``, called on the worker after each
step), which is set only while a profile waits or records: no cost otherwise. ``start_step``
steps are let pass first (counted from ``StartProfile``: the server exposes no step counter a
caller could name an absolute step by), then ``num_steps`` are recorded (unset: until
``StopProfile``, at most :data:`MAX_PROFILE_STEPS`), and the profiler stops by itself.

Traces are Chrome trace JSON (``export_chrome_trace``; Perfetto and ``chrome://tracing`` read
them), written off the worker by a thread of their own, only under the server's ``--profile-dir``
(made 0700, and refused when it is not this process's own: a link, another owner, writable by
others): a request's ``output_dir`` may only name one subdirectory of it (:func:`subdir_name`).
Each file is 0600; past ``--profile-keep`` traces, or ``--profile-keep-bytes`` bytes of them, the
oldest are deleted (the newest is always kept). A trace's size follows the ops recorded: 3 steps of
the 2-layer test Llama with ``record_shapes`` took 634 KB; a large model's step records far more.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

import structlog

from ..core import errors
from ..core.private_dirs import make_private_dir, untrusted_reason
from ..core.settings import default

log = structlog.get_logger("ferrum_service.hosting.profiler")

#: Most steps one profile records (also the most ``start_step`` lets pass): a profile nobody
#: stops does not grow without bound.
MAX_PROFILE_STEPS = 1_000
#: Longest subdirectory name a request may give (``output_dir``).
MAX_SUBDIR_CHARS = 64
_SUBDIR = re.compile(r"[A-Za-z0-9._-]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
#: The activities a request may name (vLLM's: "CPU", "GPU", "MEM"; "CUDA" = "GPU").
ACTIVITIES = ("CPU", "GPU", "CUDA", "MEM")
TRACE_GLOB = "trace-*.json"
DEFAULT_KEEP = default("profile_keep")
DEFAULT_KEEP_BYTES = default("profile_keep_bytes")

WAITING, RECORDING, STOPPING, DONE = "waiting", "recording", "stopping", "done"


def subdir_name(raw: str) -> str:
    """A request's ``output_dir``: one subdirectory name under ``--profile-dir`` (never a path:
    no ``/``, no ``..``, at most :data:`MAX_SUBDIR_CHARS` of ``A-Z a-z 0-9 . _ -``), or "" for
    the directory itself. INVALID_ARGUMENT otherwise."""
    if raw == "":
        return ""
    if (len(raw) > MAX_SUBDIR_CHARS or not _SUBDIR.fullmatch(raw) or raw in (".", "..")
            or raw.startswith(".")):
        raise errors.invalid(
            f"output_dir names one subdirectory of the server's --profile-dir, not a path: 1 to {MAX_SUBDIR_CHARS} "
            "of A-Z a-z 0-9 . _ - (not starting with '.'); traces are never written elsewhere", field="output_dir",
            limit=MAX_SUBDIR_CHARS)
    return raw


@dataclasses.dataclass
class ProfileOptions:
    """What one profile records (checked by the caller: ``wire/vllm_profile.py``)."""

    subdir: str = ""
    start_step: int = 0  # steps let pass after StartProfile before recording
    num_steps: int = 0  # steps recorded (0 = until StopProfile, at most MAX_PROFILE_STEPS)
    cuda: bool = False
    memory: bool = False
    with_stack: bool = False
    record_shapes: bool = False


@dataclasses.dataclass
class _Session:
    host: Any  # the ModelHost
    opts: ProfileOptions
    directory: Path
    started: float = dataclasses.field(default_factory=time.monotonic)
    seen: int = 0  # steps counted while waiting for start_step
    recorded: int = 0
    prof: Any = None
    state: str = WAITING
    error: str = ""
    start_s: float = 0.0  # seconds the profiler took to start
    written: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)

    @property
    def limit(self) -> int:
        return self.opts.num_steps or MAX_PROFILE_STEPS


@dataclasses.dataclass(frozen=True)
class Trace:
    """A written trace: its path relative to ``--profile-dir``, size, and the steps it holds."""

    name: str
    bytes: int
    steps: int
    write_s: float


class StepProfiler:
    """One server's profiles (see the module doc). ``root``: ``--profile-dir`` (None = profiling
    refused, naming the flag); ``keep`` traces, and ``keep_bytes`` bytes of them (0 = any), are
    kept under it."""

    def __init__(self, root: str | None, keep: int = DEFAULT_KEEP, keep_bytes: int = DEFAULT_KEEP_BYTES) -> None:
        if keep < 1 or keep_bytes < 0:
            raise ValueError("profile_keep must be >= 1, profile_keep_bytes >= 0")
        self.root = Path(root).absolute() if root else None
        self.keep = keep
        self.keep_bytes = keep_bytes
        self._session: _Session | None = None
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._seq = itertools.count()

    @property
    def active(self) -> bool:
        """A profile waits for its start step, records, or is being stopped."""
        s = self._session
        return s is not None and s.state != DONE

    def check_host(self, host: Any) -> None:
        """FAILED_PRECONDITION naming why ``host``'s model cannot be profiled here."""
        if self.root is None:
            raise errors.failed_precondition(
                "profiling is off on this server: start it with --profile-dir DIR (FERRUM_PROFILE_DIR) to let admins "
                "record torch profiler traces under DIR")
        ex = host.executor
        if ex.profiler != "torch" or ex.inline:
            raise errors.failed_precondition(
                f"model {host.model_id!r} runs on the {ex.kind} executor, which the torch profiler cannot see (it is "
                "not a torch model); profile it with its own tools (llama.cpp: its perf counters, or a system "
                "profiler such as perf)", model_id=host.model_id)

    async def start(self, host: Any, opts: ProfileOptions) -> str:
        """Start a profile of ``host``'s steps; the message ``StartProfile`` answers."""
        import asyncio

        self.check_host(host)
        if self.active:
            s = self._session
            raise errors.failed_precondition(
                f"a profile is already {s.state} on this server (one at a time): call StopProfile first")
        directory = self._directory(opts.subdir)
        s = _Session(host, opts, directory)
        self._session = s  # from here a second StartProfile is refused
        try:
            armed = host.submit(self._arm, s)
        except RuntimeError:  # the worker is gone (the model was shut down)
            self._session = None
            raise errors.unavailable(f"model {host.model_id!r} is shut down") from None
        # shielded: a caller that goes away leaves the profile armed (StopProfile ends it)
        await asyncio.shield(asyncio.wrap_future(armed))
        if s.error:
            self._session = None
            raise errors.FerrumError(errors.ErrorKind.BACKEND, f"the torch profiler did not start: {s.error}")
        where = f"{opts.subdir}/" if opts.subdir else "./"
        steps = f"{opts.num_steps} steps" if opts.num_steps else f"until StopProfile (at most {MAX_PROFILE_STEPS} steps)"
        when = f"after {opts.start_step} steps" if opts.start_step else "now"
        log.info("profile started", model_id=host.model_id, subdir=opts.subdir or None, start_step=opts.start_step,
                 num_steps=opts.num_steps or None, cuda=opts.cuda, start_s=round(s.start_s, 3))
        return f"profiling {host.model_id!r} {when}, {steps}; the trace goes to {where} under --profile-dir"

    async def stop(self) -> str:
        """Stop the running profile and write its trace; the message ``StopProfile`` answers.
        FAILED_PRECONDITION when none was started."""
        import asyncio

        s = self._session
        if s is None:
            raise errors.failed_precondition("no profile is running: call StartProfile first")
        if s.state in (WAITING, RECORDING):
            try:
                stopped = s.host.submit(self._stop_on_worker, s)
            except RuntimeError:  # the worker is gone (the model was shut down): so is what it recorded
                s.host.step_hook = None
                self._session = None
                raise errors.failed_precondition(f"model {s.host.model_id!r} was shut down while profiled: no trace "
                                                 "written") from None
            await asyncio.shield(asyncio.wrap_future(stopped))
        try:
            trace = await asyncio.wrap_future(s.written)
        finally:
            if self._session is s:
                self._session = None
        if trace is None:
            return f"stopped before step {s.opts.start_step} was reached ({s.seen} steps ran): no trace written"
        return (f"trace written: {trace.name} ({trace.bytes} bytes, {trace.steps} steps, "
                f"written in {trace.write_s:.3f} s) under --profile-dir")

    def close(self) -> None:
        """At shutdown: a recording profile is stopped on the worker, its trace not written."""
        s = self._session
        if s is not None and s.state in (WAITING, RECORDING):
            s.host.step_hook = None
            try:
                s.host.submit(self._drop, s)
            except RuntimeError:  # the worker is gone already
                pass
        if self._writer is not None:
            self._writer.shutdown(wait=False)

    # ---- on the model's worker thread ---------------------------------------------------------
    def _arm(self, s: _Session) -> None:
        if s.opts.start_step == 0:
            self._begin(s)
        if s.state in (WAITING, RECORDING):
            s.host.step_hook = lambda: self._on_step(s)

    def _on_step(self, s: _Session) -> None:
        """After each step of the profiled model (the host's step hook)."""
        if s.state == WAITING:
            s.seen += 1
            if s.seen >= s.opts.start_step:
                self._begin(s)
        elif s.state == RECORDING:
            s.recorded += 1
            if s.recorded >= s.limit:
                self._stop_on_worker(s)

    def _begin(self, s: _Session) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.opts.cuda else [])
        t0 = time.perf_counter()
        try:
            prof = profile(activities=acts, record_shapes=s.opts.record_shapes, with_stack=s.opts.with_stack,
                           profile_memory=s.opts.memory)
            prof.start()
        except Exception as e:  # noqa: BLE001 - reported by StartProfile, or by StopProfile once waited
            s.error = str(e) or type(e).__name__
            s.state = DONE
            s.host.step_hook = None
            s.written.set_exception(errors.FerrumError(errors.ErrorKind.BACKEND,
                                                       f"the torch profiler did not start: {s.error}"))
            return
        s.prof = prof
        s.start_s = time.perf_counter() - t0
        s.state = RECORDING

    def _stop_on_worker(self, s: _Session) -> None:
        s.host.step_hook = None
        if s.state == WAITING:
            s.state = DONE
            s.written.set_result(None)
            return
        if s.state != RECORDING:
            return
        s.state = STOPPING
        try:
            s.prof.stop()
        except Exception as e:  # noqa: BLE001
            s.state = DONE
            s.written.set_exception(errors.FerrumError(errors.ErrorKind.BACKEND,
                                                       f"the torch profiler did not stop: {e}"))
            return
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="profile-write")
        self._writer.submit(self._write, s)

    def _drop(self, s: _Session) -> None:
        if s.state == RECORDING:
            try:
                s.prof.stop()
            except Exception:  # noqa: BLE001 - shutting down
                pass
        s.state = DONE
        if not s.written.done():
            s.written.set_result(None)

    # ---- on the writer thread -----------------------------------------------------------------
    def _write(self, s: _Session) -> None:
        t0 = time.perf_counter()
        model = _UNSAFE.sub("_", s.host.model_id)[:64] or "model"
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = s.directory / f"trace-{stamp}-{os.getpid()}-{next(self._seq)}-{model}.json"
        try:
            why = untrusted_reason(s.directory, self.root)
            if why is not None:
                raise PermissionError(why)
            s.prof.export_chrome_trace(str(path))
            os.chmod(path, 0o600)
            size = path.stat().st_size
            self._prune()
        except Exception as e:  # noqa: BLE001 - reported by StopProfile
            log.warning("profile trace not written", error=str(e))
            s.prof, s.state = None, DONE
            s.written.set_exception(errors.FerrumError(errors.ErrorKind.BACKEND, f"the trace was not written: {e}"))
        else:
            name = str(path.relative_to(self.root))
            trace = Trace(name, size, s.recorded, time.perf_counter() - t0)
            log.info("profile trace written", model_id=s.host.model_id, trace=name, bytes=size, steps=s.recorded,
                     write_s=round(trace.write_s, 3))
            s.prof, s.state = None, DONE  # the recorded events go with the profiler
            s.written.set_result(trace)

    def _prune(self) -> None:
        """Keep the newest ``keep`` traces under ``--profile-dir`` (and its subdirectories), within
        ``keep_bytes`` (the newest whatever its size)."""
        dirs = [self.root] + [Path(e.path) for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        files = sorted(((st.st_mtime_ns, st.st_size, p) for d in dirs for p in d.glob(TRACE_GLOB)
                        if stat.S_ISREG((st := os.lstat(p)).st_mode)), reverse=True)
        total, drop = 0, []
        for i, (_, size, p) in enumerate(files):
            total += size
            if i >= self.keep or (i and self.keep_bytes and total > self.keep_bytes):
                drop.append(p)
        for old in drop:
            try:
                old.unlink()
            except OSError:
                pass

    # ---- directories --------------------------------------------------------------------------
    def _directory(self, subdir: str) -> Path:
        """``--profile-dir`` (or its subdirectory ``subdir``), made 0700 and checked as this
        process's own (FAILED_PRECONDITION naming why not)."""
        assert self.root is not None
        try:
            make_private_dir(self.root)
            d = self.root / subdir if subdir else self.root
            if subdir:
                d.mkdir(mode=0o700, exist_ok=True)
                why = untrusted_reason(d, self.root)
                if why is not None:
                    raise PermissionError(why)
        except OSError as e:
            raise errors.failed_precondition(f"--profile-dir cannot take traces: {e}") from None
        return d


__all__ = ["ACTIVITIES", "MAX_PROFILE_STEPS", "MAX_SUBDIR_CHARS", "ProfileOptions", "StepProfiler", "Trace",
           "subdir_name"]
