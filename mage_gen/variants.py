"""A variant: an op's params rendered, compiled and counted. Whole spaces build in parallel processes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker
from typing import Any

from mage_gen.census import Census, take_census
from mage_gen.compile import Compiled, arch_number, check_arch, compile_source
from mage_gen.errors import CompileError, ConfigError
from mage_gen.ops import Op
from mage_gen.render import Source


@dataclass(frozen=True)
class Variant:
    params: Any
    source: Source
    compiled: Compiled
    census: Census
    # the shared-memory carveout it is loaded with (gpu.Kernel), in percent; None: the driver's choice
    carveout: int | None = None


def check_op_arch(op: Op, arch: str, shape: Any = None, params: Any = None) -> str:
    """The arch, where NVRTC builds for it and the op's templates (for this shape and params, where given) can
    use it."""
    check_arch(arch)
    needed = op.min_arch if shape is None else op.min_arch_of(shape, params)
    if arch_number(arch) < needed:
        what = (op.name if shape is None or needed == op.min_arch else f"{op.name} {op.slug(shape)}"
                if params is None or needed == op.min_arch_of(shape) else op.kernel_name(shape, params))
        raise ConfigError(f"arch: {what} needs sm_{needed} or newer, got {arch}; choose another --arch")
    return arch


def target_arch(op: Op, arch: str) -> str:
    """What NVRTC builds the op's kernels for: the arch asked for, or where an op uses instructions of an
    arch-specific target (wgmma: sm_90a), the one its `target_arch` names."""
    target = getattr(op, "target_arch", None)
    return target(arch) if target is not None else arch


def build(op: Op, shape: Any, params: Any, arch: str) -> Variant:
    check_op_arch(op, arch, shape, params)
    source = op.source(shape, params)  # validates first: a rejected config never reaches NVRTC
    compiled = compile_source(source, target_arch(op, arch))
    return Variant(params=params, source=source, compiled=compiled, census=take_census(compiled))


# Workers come from a fork server, never from a fork of the caller: a process holding CUDA, torch or SQLite
# threads may be forked while one of them holds a lock the child then waits on for ever. The server starts
# once, single-threaded, with the compiler's modules loaded.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["mage_gen.variants"])


def _start_worker(cache: str | None) -> None:
    """In each worker: the caller's compile cache (the server's environment is the one it started with), and
    Ctrl-C left to the caller."""
    if cache is None:
        os.environ.pop("MAGE_GEN_CACHE", None)
    else:
        os.environ["MAGE_GEN_CACHE"] = cache
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[list[bool]]:
    """Ctrl-C noted, not raised, while the pool lives: raised while the pool starts (it waits on the fork server's
    imports), it would leave processes the caller cannot stop, which then start after it exited and fail with
    tracebacks; raised at any moment after, it can leave a lock of the pool's or of the progress display held, whose
    threads the cleanup then waits for forever. It is raised between results instead (_results). The list it
    yields is non-empty once one came."""
    pressed: list[bool] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield pressed
        return
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield pressed
    finally:
        # once one came, the caller is stopping: another must not cut its cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN if pressed else previous)
    if pressed:  # one that came after the last results were taken
        raise KeyboardInterrupt


def _start_servers() -> None:
    """Start the fork server and the resource tracker with Ctrl-C blocked, which they inherit across exec until
    each ignores it: one that landed while they import would kill them half-way, each with a traceback. Blocked,
    not ignored, in the caller: an ignored Ctrl-C is lost, and the caller would compile on as if none came; a
    blocked one waits, and reaches the caller's handler as soon as the servers are spawned."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread's mask matters here
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the tracker unblocks it once it has spawned
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _workers(count: int) -> Iterator[Callable[[Callable[[Any], Any], Sequence[Any]], Iterator[Any]]]:
    """Compile processes that an interrupt or an error stops at once: the workers ignore Ctrl-C (the parent
    alone decides), and on any exception the parent kills them rather than waiting for their queued work,
    so a second Ctrl-C finds nothing to hang on and no process is left behind. The cache stays whole: an
    entry appears by one rename, and a killed compile leaves at most a scratch folder. Yields a map of a function
    over jobs, in order (_results)."""
    with _ctrl_c_held() as pressed:
        _start_servers()
        pool = _CONTEXT.Pool(count, initializer=_start_worker, initargs=(os.environ.get("MAGE_GEN_CACHE"),))
        try:
            if pressed:
                raise KeyboardInterrupt
            yield lambda fn, jobs: _results(pool.imap(_map_chunk, [(fn, jobs[i:i + CHUNK])
                                                                for i in range(0, len(jobs), CHUNK)]), pressed)
            pool.close()
        except BaseException:
            pool.terminate()
            raise
        finally:
            pool.join()


CHUNK = 4  # jobs a worker takes at a time


def _map_chunk(task: tuple[Callable[[Any], Any], Sequence[Any]]) -> list[Any]:
    fn, jobs = task
    return [fn(job) for job in jobs]


def _results(chunks: Any, pressed: list[bool]) -> Iterator[Any]:
    """The results of imap's chunks, in order, waited for in short steps: a Ctrl-C noted meanwhile is raised here,
    between two chunks, where nothing of the pool's is held."""
    while True:
        if pressed:
            raise KeyboardInterrupt
        try:
            chunk = chunks.next(timeout=0.1)
        except StopIteration:
            return
        except multiprocessing.TimeoutError:
            continue
        yield from chunk


def _build_one(job: tuple[str, Any, Any, str]) -> Variant:
    from mage_gen.ops import get_op

    op_name, shape, params, arch = job
    return build(get_op(op_name), shape, params, arch)


def build_all(op: Op, shape: Any, params_list: Sequence[Any], arch: str,
              progress: Callable[[], None] | None = None, workers: int | None = None) -> list[Variant]:
    """Build every variant, returned in input order; compiles run in worker processes, one per core."""
    return list(build_each(op, shape, params_list, arch, progress, workers))


def build_each(op: Op, shape: Any, params_list: Sequence[Any], arch: str,
               progress: Callable[[], None] | None = None, workers: int | None = None) -> Iterator[Variant]:
    """The variants one by one as they are built, in input order, none held after it is yielded (a whole space of
    10⁴ variants is gigabytes of PTX and cubins)."""
    check_op_arch(op, arch, shape)
    jobs = [(op.name, shape, p, arch) for p in params_list]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            yield _build_one(job)
            if progress:
                progress()
        return
    with _workers(workers) as results:
        for variant in results(_build_one, jobs):
            yield variant
            if progress:
                progress()


def _compile_one(job: tuple[str, Any, Any, str]) -> bool:
    try:
        _build_one(job)
    except (CompileError, ConfigError):
        return False
    return True


def prebuild(op: Op, shape: Any, params_list: Sequence[Any], arch: str,
             progress: Callable[[int, int], None] | None = None) -> int:
    """Compile every variant into the cache in parallel and keep nothing: each is built again, from the
    cache, where it is used. A config that fails to render or compile is left for its user to report (a
    tuning trial fails alone); returns how many compiled."""
    check_op_arch(op, arch, shape)
    jobs = [(op.name, shape, p, arch) for p in params_list]
    if not jobs:
        return 0
    compiled = 0
    with _workers(min(len(jobs), os.cpu_count() or 1)) as results:
        for done, ok in enumerate(results(_compile_one, jobs), 1):
            compiled += ok
            if progress:
                progress(done, len(jobs))
    return compiled
