"""NVRTC: CUDA C++ source → PTX and cubin for one architecture, cached on disk by content."""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import platformdirs
from cuda.bindings import nvrtc

from mage_gen.errors import CompileError, ConfigError, MageError
from mage_gen.render import Source

DEFAULT_ARCH = "sm_90"
# Bumped whenever what a cache entry holds, or how it is made, changes.
_CACHE_FORMAT = "1"
_RESOURCE_REPORT = "Used "  # ptxas -v: "Used N registers, ..." for every entry function


@dataclass(frozen=True)
class Compiled:
    kernel_name: str
    arch: str
    ptx: str
    cubin: bytes
    log: str  # NVRTC's log with ptxas -v resource lines
    key: str
    from_cache: bool = False


def nvrtc_version() -> str:
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return f"{major}.{minor}"


@cache
def supported_archs() -> tuple[str, ...]:
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs")
    return tuple(f"sm_{a}" for a in archs)


def check_arch(arch: str) -> str:
    if not re.fullmatch(r"sm_\d+a?", arch) or arch.rstrip("a") not in supported_archs():
        raise ConfigError(f"arch: {arch!r} is not an architecture NVRTC {nvrtc_version()} builds for; "
                          f"use one of {', '.join(supported_archs())}")
    return arch


def arch_number(arch: str) -> int:
    """sm_90 (or sm_90a) as 90, to compare with an op's oldest arch."""
    return int(re.sub(r"\D", "", arch))


def options(arch: str, fmad: bool = True) -> list[str]:
    # -Xptxas=-v puts registers, shared memory, stack and spills into the log for the census. fmad=False
    # writes every float add and multiply with its rounding (add.rn, mul.rn) so that ptxas may not fuse them:
    # then the PTX alone says what the GPU computes, bit for bit.
    return [f"-arch={arch}", "--std=c++17", "-Xptxas=-v"] + ([] if fmad else ["--fmad=false"])


def cache_dir() -> Path:
    return Path(os.environ.get("MAGE_GEN_CACHE") or platformdirs.user_cache_dir("mage-gen")) / "nvrtc"


def cache_key(source: Source, arch: str, fmad: bool = True) -> str:
    digest = hashlib.sha256()
    for part in (_CACHE_FORMAT, nvrtc_version(), " ".join(options(arch, fmad)), source.kernel_name, source.text):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def compile_source(source: Source, arch: str = DEFAULT_ARCH, fmad: bool = True) -> Compiled:
    check_arch(arch)
    key = cache_key(source, arch, fmad)
    entry = cache_dir() / key[:2] / key
    if (entry / "kernel.cubin").is_file():
        return Compiled(kernel_name=source.kernel_name, arch=arch, ptx=(entry / "kernel.ptx").read_text(),
                        cubin=(entry / "kernel.cubin").read_bytes(), log=(entry / "ptxas.log").read_text(),
                        key=key, from_cache=True)
    ptx, cubin, log = _nvrtc(source, arch, fmad)
    if _RESOURCE_REPORT not in log:
        # Where a driver is installed, NVRTC turns PTX into a cubin through the driver's compute cache
        # (~/.nv/ComputeCache), shared by every process: PTX it has seen before comes back from there, and
        # ptxas, which did not run, reports nothing. The census needs that report: a process with the cache
        # off compiles it anew (a separate interpreter: the caller's environment and its main module untouched).
        ptx, cubin, log = _nvrtc_without_compute_cache(source, arch, fmad)
    if _RESOURCE_REPORT in log:  # never cache a compile whose report is missing
        _store(entry, ptx, cubin, log)
    return Compiled(kernel_name=source.kernel_name, arch=arch, ptx=ptx, cubin=cubin, log=log, key=key)


def _store(entry: Path, ptx: str, cubin: bytes, log: str) -> None:
    """Write the entry in a scratch folder, then rename it into place: readers see all of it or none."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    except OSError as exc:
        raise MageError(f"cache: cannot write the compile cache {cache_dir()} ({exc.strerror or exc}); set "
                        "MAGE_GEN_CACHE to a writable folder") from None
    try:
        (scratch / "kernel.ptx").write_text(ptx)
        (scratch / "ptxas.log").write_text(log)
        (scratch / "kernel.cubin").write_bytes(cubin)
        os.rename(scratch, entry)
    except OSError:
        if not (entry / "kernel.cubin").is_file():  # another process may have won the race; that is fine
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check(err: nvrtc.nvrtcResult, call: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{call} failed: {err.name}")


def _nvrtc_without_compute_cache(source: Source, arch: str, fmad: bool) -> tuple[str, bytes, str]:
    done = subprocess.run([sys.executable, "-c", "from mage_gen.compile import _compile_from_stdin; _compile_from_stdin()"],
                          input=pickle.dumps((source, arch, fmad)), capture_output=True,
                          env={**os.environ, "CUDA_CACHE_DISABLE": "1"}, check=False)
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise CompileError(f"NVRTC, run again with the driver's compute cache off, failed for {source.kernel_name}: "
                           f"{last}")
    outcome, value = pickle.loads(done.stdout)
    if outcome == "error":
        raise CompileError(value)
    return value


def _compile_from_stdin() -> None:
    """The child of _nvrtc_without_compute_cache: (source, arch, fmad) pickled in, its compile pickled out."""
    source, arch, fmad = pickle.load(sys.stdin.buffer)
    try:
        result = ("ok", _nvrtc(source, arch, fmad))
    except CompileError as exc:
        result = ("error", str(exc))
    sys.stdout.buffer.write(pickle.dumps(result))


def _nvrtc(source: Source, arch: str, fmad: bool) -> tuple[str, bytes, str]:
    err, prog = nvrtc.nvrtcCreateProgram(source.text.encode(), f"{source.kernel_name}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options(arch, fmad)]
        (compile_err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check(err, "nvrtcGetProgramLogSize")
        log_buf = bytearray(size)  # written in place by NVRTC: a mutable buffer, never a shared bytes object
        (err,) = nvrtc.nvrtcGetProgramLog(prog, log_buf)
        _check(err, "nvrtcGetProgramLog")
        log = bytes(log_buf).rstrip(b"\0 ").decode(errors="replace")
        if compile_err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC could not compile {source.kernel_name} ({compile_err.name}):\n{log}")
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx_buf = bytearray(size)
        (err,) = nvrtc.nvrtcGetPTX(prog, ptx_buf)
        _check(err, "nvrtcGetPTX")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
        return bytes(ptx_buf).rstrip(b"\0").decode(), bytes(cubin), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
