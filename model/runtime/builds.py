"""A package's first compile, made shorter: most of it is TorchInductor's Python on one core
(export, lowering: ~25 s at OPUS-MT size), the rest g++, one call after the other, while the other
cores wait. Figures from a 2-vCPU AMD EPYC (avx512_vnni), OPUS-MT size, int8, empty caches.

- ``side_by_side()``: AOTInductor compiles a package's objects one after the other
  (``AotCodeCompiler.compile``: the wrapper, ~6.4 s, then the kernels, ~3.5 s, then the
  constants), then links them. Within the block, the first compile-only build that the calling
  thread starts (the wrapper's) runs on a thread of its own (g++ is a process: no GIL to share)
  while the caller goes on to the next ones, which run as before: torch removes the constants'
  source right after their build returns, so only one build whose source outlives it goes behind
  at a time. The thread's next build of another kind (the link) first waits for it, raising its
  failure. The objects are the same files; only when each is made changes.
- ``probe_isa_beside()``: TorchInductor checks which vector instruction sets the CPU and compiler
  take by compiling and loading six small programs (~6.6 s, once per inductor cache: every first
  start with an empty compile cache), when lowering first asks, after the export. Started on a
  thread of its own before the export, they run on another core meanwhile.
- ``CONFIGS``: no precompiled headers. AOTInductor precompiles torch's headers for the wrapper
  and the kernels (~4.8 s each, one after the other, kept in /tmp, so again in each new
  container) to save ~1.2 s of the wrapper's compile.

Builds of other threads (another model compiling beside, torch.compile's own) run as torch runs
them: ``side_by_side`` looks at the calling thread's state only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

# TorchInductor's settings for a package's compile (``Package._compile``): see above.
CONFIGS: dict[str, Any] = {"aot_inductor.precompile_headers": False}

_lock = threading.Lock()
_users = 0  # side_by_side() blocks open in this process: the patch is in place while any is
_original: Callable[[Any], None] | None = None
_local = threading.local()  # .pool, .pending: the calling thread's, inside side_by_side()


def _build(builder: Any) -> None:
    """``CppBuilder.build`` while the patch is in place."""
    assert _original is not None
    pool: ThreadPoolExecutor | None = getattr(_local, "pool", None)
    if pool is not None and not getattr(builder, "_compile_only", False):  # a link: after the object
        _finish(_local.pending)
    elif pool is not None and not _local.pending:  # the first object: compiled beside the next ones
        _local.pending.append(pool.submit(_original, builder))
        return
    _original(builder)  # outside side_by_side(), an object while one is behind, or the link


def _finish(pending: list[Future[None]]) -> None:
    """Wait for the pending build, then raise its error, if any."""
    try:
        wait(pending)
        for future in pending:
            future.result()
    finally:
        pending.clear()


@contextlib.contextmanager
def side_by_side() -> Iterator[None]:
    """The first compile-only build this thread starts inside the block runs behind, beside the
    thread's next builds; it is done when the block ends (its error raised)."""
    global _users, _original
    # Imported here, not with this module: importing TorchInductor fixes its cache directory
    # (TORCHINDUCTOR_CACHE_DIR, set by ``load_runner`` before compiling) for the process.
    from torch._inductor import cpp_builder

    with _lock:
        if _users == 0:
            _original = cpp_builder.CppBuilder.build
            cpp_builder.CppBuilder.build = _build  # type: ignore[method-assign,assignment]
        _users += 1
    try:
        outer = getattr(_local, "pool", None), getattr(_local, "pending", None)  # a block around
        with ThreadPoolExecutor(1, thread_name_prefix="compile-object") as pool:
            pending: list[Future[None]] = []
            _local.pool, _local.pending = pool, pending
            try:
                yield
                _finish(pending)
            finally:
                wait(pending)  # nothing left running behind an error
                _local.pool, _local.pending = outer
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                cpp_builder.CppBuilder.build = _original  # type: ignore[method-assign,assignment]
                _original = None


def probe_isa_beside() -> threading.Thread:
    """TorchInductor's checks of the CPU's vector instruction sets (``valid_vec_isa_list``,
    cached by torch for the process and on disk) started on a thread of their own; where lowering
    asks before they are done, it waits for the same files rather than compiling them again."""
    # Imported here, on the calling thread (not by the thread started: an import racing the
    # export's own is not worth its risk), and not with this module (see ``side_by_side``).
    from torch._inductor import cpu_vec_isa

    thread = threading.Thread(target=cpu_vec_isa.valid_vec_isa_list, name="probe-isa", daemon=True)
    thread.start()
    return thread
