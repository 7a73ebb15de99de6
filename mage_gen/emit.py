"""A fixed kernel written out for use without mage-gen: source, PTX, cubin, how to launch it, and a C++ header
that launches it through the CUDA driver API.

Works without a GPU. The files are named after the op and shape, not the params (unless the caller names
them), so that code calling `layernorm_d768` picks up a re-tuned winner without changing.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mage_gen
from mage_gen.dtypes import element as any_element
from mage_gen.census import aligned_contract
from mage_gen.compile import nvrtc_version
from mage_gen.errors import ConfigError, MageError
from mage_gen.ops import Arg, Op
from mage_gen.ops.base import WORKING_KINDS, TensorMapSpec, launch_args, shape_dict, tensor_maps
from mage_gen.render import environment
from mage_gen.store import unwritable, write_atomic
from mage_gen.timing import Timing
from mage_gen.variants import Variant, build

LAUNCH_FORMAT = 2
_C_TYPES = {"i32": "int", "f32": "float"}
_WORKING_C_TYPES = {"float32": "float*", "uint32": "unsigned int*"}  # a working buffer's words
DEFAULT_SHARED_LIMIT = 48 * 1024  # shared memory, static and dynamic, a function may use before it opts in to more
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def emit(op: Op, shape: Any, params: Any, arch: str, out_dir: Path, provenance: dict[str, Any] | None, *,
         stem: str | None = None, size_classes: dict | None = None, replace: bool = False) -> list[Path]:
    """Write <stem>.cu, .ptx, .cubin, .launch.json and .h into out_dir; the stem is <op>_<shape> unless given.
    provenance is a store entry; size_classes, the caller's table of which kernel serves which sizes, goes
    into launch.json as given. Files that hold something else (another config, arch or tuning) are replaced
    only with replace=True; the same kernel written again is no change."""
    stem = f"{op.name}_{op.slug(shape)}" if stem is None else stem
    if not _C_IDENTIFIER.fullmatch(stem):
        raise ConfigError(f"stem: {stem!r} is not a C identifier (letters, digits, _): it prefixes the header's names")
    variant = build(op, shape, params, arch)  # before any folder is made: a rejected config leaves nothing
    header = _header(op, shape, variant, provenance)
    contract = aligned_contract(op.contract(shape, variant.params), variant.census)
    launch_doc = _launch_doc(op, shape, variant, provenance, contract, size_classes)
    contents = {
        f"{stem}.cu": ("\n".join(header) + "\n\n" + variant.source.text).encode(),
        f"{stem}.ptx": variant.compiled.ptx.encode(),
        f"{stem}.cubin": variant.compiled.cubin,
        f"{stem}.launch.json": (json.dumps(launch_doc, indent=2) + "\n").encode(),
        f"{stem}.h": _c_header(op, shape, variant, stem, header, contract).encode(),
    }
    if not replace:
        _refuse_to_replace(out_dir, contents)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name, data in contents.items():
            write_atomic(out_dir / name, data)
            written.append(out_dir / name)
    except OSError as exc:
        raise MageError(f"cannot write kernels to {out_dir}: {exc.strerror or exc}; {_OUT_REMEDY}") from None
    return written


_OUT_REMEDY = "choose a writable folder with --out"


def _refuse_to_replace(out_dir: Path, contents: dict[str, bytes]) -> None:
    for name, data in contents.items():
        path = out_dir / name
        try:
            same = path.read_bytes() == data
        except FileNotFoundError:
            continue
        except OSError:
            continue  # unreadable: the write reports what is wrong with the folder
        if not same:
            first = path.with_suffix("").with_suffix(".cu")
            held = first.read_text(errors="replace").split(":", 1)[0].removeprefix("// ") if first.is_file() else "?"
            raise MageError(f"emit: {path} holds another kernel or build ({held}); pass --force to replace it, or choose "
                            "another --out")


def check_out_dir(out_dir: Path, what: str = "kernels") -> None:
    """Fail before a search, not after it, where the winner (or `what` else) could not be written. Creates
    nothing."""
    why = unwritable(out_dir)
    if why:
        raise MageError(f"cannot write {what} to {out_dir}: {why}; {_OUT_REMEDY}")


def _c_type(arg: Arg) -> str:
    """A 16-bit tensor is passed as unsigned short*: the generated kernel reads and writes its bits."""
    if arg.kind in WORKING_KINDS:
        return _WORKING_C_TYPES[arg.dtype]
    if arg.kind in ("in", "out"):
        return ("const " if arg.kind == "in" else "") + any_element(arg.dtype).c_type + "*"
    return _C_TYPES[arg.kind]


def _launch_doc(op: Op, shape: Any, variant: Variant, provenance: dict[str, Any] | None,
                contract: dict[str, Any], size_classes: dict | None) -> dict[str, Any]:
    source = variant.source
    launch = op.launch_formula(shape, variant.params)
    return {
        "format": LAUNCH_FORMAT,
        "op": op.name,
        "kernel": source.kernel_name,
        "arch": variant.compiled.arch,
        "launch": launch,
        "dynamic_shared_memory": _dynamic_shared(launch["dynamic_shared_bytes"], variant.census.shared_bytes),
        "args": [{"name": a.name, "type": _c_type(a)} for a in launch_args(op, shape, variant.params)]
        + [{"name": name, "type": "CUtensorMap (by value)", "maps": spec.tensor}
           for name, spec in tensor_maps(op, shape, variant.params).items()],
        "contract": contract,
        "size_classes": size_classes,
        "params": op.params_to_dict(variant.params),
        "shape": asdict(shape),
        "template": source.template,
        "template_hash": source.template_hash,
        "source_hash": source.source_hash,
        "mage_gen": mage_gen.__version__,
        "nvrtc": nvrtc_version(),
        "provenance": provenance,
    }


def _needs_opt_in(dynamic: int, static: int) -> bool:
    """Static and dynamic shared memory together over 48 KB fail to launch until the dynamic limit is raised."""
    return dynamic > 0 and static + dynamic > DEFAULT_SHARED_LIMIT


def _dynamic_shared(nbytes: int, static: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"bytes": nbytes, "opt_in_required": _needs_opt_in(nbytes, static)}
    if doc["opt_in_required"]:
        doc["how"] = (f"cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, {nbytes}) "
                      "before the first launch")
    return doc


def _c_header(op: Op, shape: Any, variant: Variant, stem: str, provenance: list[str],
              contract: dict[str, Any]) -> str:
    """<stem>.h: the .cu's provenance comment, the contract, and <stem>_launch, which checks the contract's
    sizes and alignments, then launches with the grid the op's launch formula gives."""
    launch = op.launch_formula(shape, variant.params)
    # The formula's grid is C already, except for min(), which C++ has only in <algorithm>.
    grid = [re.sub(r"\bmin\(", f"{stem}_min(", str(size)) for size in launch["grid"]]
    shared = launch["dynamic_shared_bytes"]
    # a cluster of more than one CTA is launched with cuLaunchKernelEx and its cluster dimension attribute
    cluster = list(launch["cluster"]) if launch["cluster"] != [1, 1, 1] else None
    return environment().get_template("emit/launch.h.j2").render(
        stem=stem, kernel=variant.source.kernel_name, arch=variant.compiled.arch, provenance=provenance,
        contract=contract, args=[(a.name, _c_type(a)) for a in launch_args(op, shape, variant.params)],
        grid=grid, block=launch["block"],
        cluster=cluster, shared_bytes=shared, opt_in=_needs_opt_in(shared, variant.census.shared_bytes),
        uses_min=any(f"{stem}_min(" in g for g in grid),
        maps={name: _c_tensor_map(spec) for name, spec in tensor_maps(op, shape, variant.params).items()})


# The driver's names for what a TensorMapSpec says
_MAP_TYPES = {"bfloat16": "BFLOAT16", "float16": "FLOAT16", "float32": "FLOAT32", "uint8": "UINT8"}
_MAP_SWIZZLES = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
_MAP_PROMOTIONS = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}


def _c_tensor_map(spec: TensorMapSpec) -> dict[str, Any]:
    """A tensor map as the C header encodes it: cuTensorMapEncodeTiled's arguments, spelled as cuda.h spells them."""
    return {"tensor": spec.tensor, "rank": len(spec.dims), "dims": spec.dims, "strides": spec.strides, "box": spec.box,
            "type": f"CU_TENSOR_MAP_DATA_TYPE_{_MAP_TYPES[spec.dtype]}",
            "swizzle": f"CU_TENSOR_MAP_SWIZZLE_{_MAP_SWIZZLES[spec.swizzle]}",
            "promotion": f"CU_TENSOR_MAP_L2_PROMOTION_{_MAP_PROMOTIONS[spec.l2_promotion]}"}


def _header(op: Op, shape: Any, variant: Variant, provenance: dict[str, Any] | None) -> list[str]:
    source, params = variant.source, op.params_to_dict(variant.params)
    sizes = asdict(shape)
    launch = op.launch_formula(shape, variant.params)
    rows = [
        ("op", op.name),
        ("shape", " ".join(f"{k}={v}" for k, v in sizes.items())),
        ("params", " ".join(f"{k}={v}" for k, v in params.items())),
        ("kernel", source.kernel_name),
        ("arch", variant.compiled.arch),
        ("template", f"{source.template} (hash {source.template_hash})"),
        ("mage-gen", mage_gen.__version__),
        ("NVRTC", nvrtc_version()),
        ("launch", f"grid ({', '.join(map(str, launch['grid']))}), block ({', '.join(map(str, launch['block']))}), "
                   + (f"clusters of ({', '.join(map(str, launch['cluster']))}) CTAs, "
                      if launch["cluster"] != [1, 1, 1] else "")
                   + f"{launch['dynamic_shared_bytes']} B dynamic shared memory"),
        ("args", ", ".join(f"{_c_type(a)} {a.name}" for a in launch_args(op, shape, variant.params))),
    ]
    rows += _timing_rows(provenance) if provenance else [("timings", "none: not from a tuned/ entry")]
    width = max(len(key) for key, _ in rows)
    return [
        f"// {source.kernel_name}: generated by mage-gen; regenerate rather than edit:",
        f"//   {regenerate_command(op, shape, variant.compiled.arch, params)}",
        *(f"//   {key.ljust(width)}  {_one_line(value)}" for key, value in rows),
    ]


# The shape's fields `mage-gen emit` takes as options of their own; any other (a norm's residual, a GEMM's C type)
# goes in its --config
_SHAPE_FLAGS = ("d", "m", "n", "k", "dtype", "weight_dtype", "precision")


def shape_arguments(shape: Any, params: dict[str, Any] | None = None, every_field: bool = True) -> str:
    """A shape (and params) as mage-gen's commands take them: flags for the sizes, dtypes and precision, every other
    field of the shape and every param in --config; with every_field False, fields at their defaults left out."""
    flags, config = [], []
    for name, value in (asdict(shape) if every_field else shape_dict(shape)).items():
        if value is None:
            continue
        if name in _SHAPE_FLAGS:
            flags.append(f"--{name.replace('_', '-')} {value}")
        else:
            config.append(f"{name}={str(value).lower() if isinstance(value, bool) else value}")
    config += [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in (params or {}).items()]
    return " ".join(flags) + (f" --config {','.join(config)}" if config else "")


def regenerate_command(op: Op, shape: Any, arch: str, params: dict[str, Any]) -> str:
    """The command line that writes these files again: every field of the shape, and every param."""
    arguments = shape_arguments(shape, params)
    flags, _, config = arguments.partition(" --config ")
    return f"mage-gen emit {op.name} {flags} --arch {arch} --config {config}"


def _timing_rows(entry: dict[str, Any]) -> list[tuple[str, str]]:
    gpu = entry["gpu"]
    hot = Timing.from_dict(entry["timings"]["hot"])
    device = (f"{gpu['name']} (cc {gpu['cc']}, {gpu['sms']} SMs, {gpu['l2_bytes']} B L2, driver {gpu['driver']})")
    rows = [
        ("replayed", f"{entry['date']}: a replay of the recording {entry['replay']}, made on {device}; "
                     "not measured by this tune") if entry.get("replay") else ("tuned on", f"{device}, {entry['date']}"),
        ("objective", str(entry["objective"])),
        *((kind, _timing_text(Timing.from_dict(entry["timings"][kind]))) for kind in ("hot", "cold")),
    ]
    for name, peer in sorted(entry["peers"].items()):
        rows.append((f"vs {name}", _peer_text(hot, name, peer)))
    return rows


def _timing_text(timing: Timing) -> str:
    return f"{timing.median_us:.3f} us median, spread {timing.spread_us:.3f} us, {timing.samples} samples"


def _peer_text(hot: Timing, name: str, peer: Any) -> str:
    # A peer is stored the way the entry's own timings are: {"hot": Timing dict, "cold": ...}.
    theirs = peer.get("hot") if isinstance(peer, dict) else None
    if not isinstance(theirs, dict) or "median_us" not in theirs:
        return "no hot timing recorded"
    median = float(theirs["median_us"])
    if median <= 0:
        return f"hot {median:.3f} us median (no ratio)"
    return f"hot {median:.3f} us median; this kernel's hot median / {name}'s = {hot.median_us / median:.3f}"


def _one_line(value: str) -> str:
    # A newline in a stored value would end the comment and leave the rest as code.
    return " ".join(str(value).split())
