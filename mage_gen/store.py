"""Tuned winners, one file per (GPU, op): tuned/<gpu slug>/<op>.json, one entry per shape key and, for an
op sized at launch, per size class (the run size it was tuned at; mage_gen.dispatch picks among them).

    {"format": 3, "op": "layernorm", "gpu": "NVIDIA H200",
     "entries": {"d=768/float32/m=4096": {"params": {...}, "timings": {...}, ...},
                 "d=768/float32/m=65536": {...}}}

Format 1 keys had no size class (each entry was tuned at its "run"). Up to format 2 a norm's `vector` counted
elements (fp32 floats), since format 3 bytes. An older file is read as format 3.

The tuner builds the entries; this module only checks that one carries what emit and bench need, and
writes the file so that a reader never sees half of it. A file it cannot read is reported, never
replaced: it may hold hours of tuning.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from mage_gen import dispatch
from mage_gen.errors import ConfigError, MageError, StoreError
from mage_gen.ops import OPS, Op
from mage_gen.render import Source
from mage_gen.resources import data_dir
from mage_gen.timing import Timing

FORMAT = 3
# What every entry must carry: what was built and from which template version, how it was judged and
# timed, against whom, on which GPU, and with which tools.
REQUIRED_KEYS = ("shape", "params", "kernel", "template", "template_hash", "objective", "timings", "peers",
                 "census", "gpu", "nvrtc", "mage_gen", "date")
REQUIRED_GPU_KEYS = ("name", "cc", "driver", "sms", "l2_bytes")
TIMING_KINDS = ("hot", "cold")
_DICT_KEYS = ("shape", "params", "timings", "peers", "census", "gpu")
_TIMING_FIELDS = frozenset(f.name for f in fields(Timing))
# Words every NVIDIA device name carries that say nothing about which GPU it is.
_BRAND_WORDS = frozenset({"nvidia", "geforce"})


@dataclass(frozen=True)
class Winner:
    params: Any  # the op's Params, rebuilt from the entry
    entry: dict[str, Any]
    path: Path
    key: str = ""  # the entry's key in the file
    run: dict[str, int] | None = None  # the run size it was tuned at (its size class); {} for a fixed-size op


def entry_key(op: Op, shape: Any, run: dict[str, int]) -> str:
    """'d=768/float32/m=4096': the shape key, then the size class for an op sized at launch."""
    return op.shape_key(shape) + _class_suffix({name: run[name] for name in op.run_dims})


def _class_suffix(run: dict[str, int]) -> str:
    return "/" + ",".join(f"{k}={v}" for k, v in run.items()) if run else ""


def tuned_dir() -> Path:
    override = os.environ.get("MAGE_GEN_TUNED")
    return Path(override) if override else Path.cwd() / "tuned"


def tuned_dirs() -> list[Path]:
    """Where winners are looked up, first match wins: $MAGE_GEN_TUNED (or ./tuned), then those shipped with
    mage-gen."""
    dirs = [tuned_dir()]
    try:
        shipped = data_dir("tuned")
    except FileNotFoundError:
        return dirs
    return dirs + ([shipped] if shipped.resolve() != dirs[0].resolve() else [])


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090': a folder name per GPU model."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in _BRAND_WORDS]
    if not words:
        raise MageError(f"gpu: cannot name a tuned/ folder after GPU name {name!r}; give the device's name, "
                          "e.g. --gpu 'NVIDIA H200'")
    return "-".join(words)


def store_file(op_name: str, gpu_name: str, directory: Path | None = None) -> Path:
    return (directory or tuned_dir()) / gpu_slug(gpu_name) / f"{op_name}.json"


def save_entry(op_name: str, gpu_name: str, shape_key: str, entry: dict[str, Any],
               directory: Path | None = None) -> Path:
    """Add or replace one entry; the file's other entries are kept as they were."""
    path = store_file(op_name, gpu_name, directory)
    _check_entry(entry, f"entry {shape_key} for {path} (not written)")
    doc = _read(path, op_name) if path.exists() else {"format": FORMAT, "op": op_name, "gpu": gpu_name,
                                                     "entries": {}}
    doc["entries"][shape_key] = entry
    # Serialise before touching the disk, so an entry JSON cannot hold fails with the old file in place.
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text.encode())
    except OSError as exc:
        raise StoreError(f"cannot write {path}: {exc.strerror or exc}; make that folder writable or set "
                         "MAGE_GEN_TUNED to one that is") from None
    return path


def check_can_save(op_name: str, gpu_name: str, directory: Path | None = None) -> Path:
    """Fail before a search, not after it, where its winner could not be stored: a file save_entry would
    refuse (corrupt), or a folder that cannot be written. Writes nothing."""
    path = store_file(op_name, gpu_name, directory)
    if path.exists():
        _read(path, op_name)
    why = unwritable(path.parent)
    if why:
        raise StoreError(f"cannot write {path}: {why}; make that folder writable or set MAGE_GEN_TUNED to one "
                         "that is")
    return path


def unwritable(folder: Path) -> str | None:
    """Why files could not be written into folder (made first where missing), or None. Leaves nothing behind:
    the probe is a nameless temporary file in the nearest folder that exists."""
    existing = folder.absolute()
    while not existing.exists():  # ends at the root at the latest
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"{existing}: {exc.strerror or exc}"
    return None


def load_entry(op_name: str, gpu_name: str, shape_key: str, current: Source | None = None,
               directory: Path | None = None) -> dict[str, Any]:
    """The stored winner for a shape; with `current` (what its params render to now), refuses a stale one."""
    path = store_file(op_name, gpu_name, directory)
    tune = _tune_command(op_name, shape_key)
    remedy = f"run `{tune}` on this GPU, or pass --config"
    if not path.exists():
        where = ("$MAGE_GEN_TUNED" if os.environ.get("MAGE_GEN_TUNED") and directory is None else
                 f"the working folder {Path.cwd()} (set MAGE_GEN_TUNED to read another)" if directory is None else
                 str(directory))
        raise StoreError(f"no tuned {op_name} kernels for {gpu_name} ({path} does not exist; tuned/ is read from "
                         f"{where}): {remedy}")
    entries = _read(path, op_name)["entries"]
    if shape_key not in entries:
        raise StoreError(f"{path} has no entry for {shape_key} (it has {_listed(entries)}): {remedy}")
    entry = entries[shape_key]
    _check_entry(entry, f"{path}: entry {shape_key}", fix=f"re-run `{tune}` on this GPU, or pass --config")
    if current is not None and not is_current(entry, current):
        kind = "source" if "source_hash" in entry else "template"
        raise StoreError(f"{path}: entry {shape_key} is stale: its kernel has changed since it was tuned "
                         f"({kind} hash {entry[kind + '_hash']}, now {getattr(current, kind + '_hash')}): {remedy}")
    return entry


_SHOWN_KEYS = 8  # of the entries a missing one is named beside


def _listed(keys: Any) -> str:
    """Shape keys in their numbers' order (d=768 before d=4096), all of them or the first few and how many more."""
    ordered = sorted(keys, key=lambda key: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)])
    if not ordered:
        return "no entry"
    shown = ", ".join(ordered[:_SHOWN_KEYS])
    more = len(ordered) - _SHOWN_KEYS
    return f"{len(ordered)} entries: {shown}" + (f", and {more} more" if more > 0 else "")


def is_current(entry: dict[str, Any], current: Source) -> bool:
    """Whether an entry was tuned with the kernel its params render to now: the same text where the entry
    records it (source_hash); for an entry written before that was recorded, the same template files."""
    if "source_hash" in entry:
        return entry["source_hash"] == current.source_hash
    return entry["template_hash"] == current.template_hash


def shape_entries(op: Op, shape: Any, gpu_name: str, directory: Path | None = None) -> dict[str, dict[str, Any]]:
    """Every entry of this shape (each size class), by key; {} where none is stored."""
    path = store_file(op.name, gpu_name, directory)
    if not path.exists():
        return {}
    prefix = op.shape_key(shape)
    return {key: entry for key, entry in _read(path, op.name)["entries"].items()
            if key == prefix or key.startswith(prefix + "/")}


def _class_entry(op: Op, shape: Any, run: dict[str, int], gpu_name: str, directory: Path | None) -> dict | None:
    return shape_entries(op, shape, gpu_name, directory).get(entry_key(op, shape, run))


def stored_params(op: Op, shape: Any, run: dict[str, int], gpu_name: str, directory: Path | None = None) -> Any:
    """The params of this size class's stored winner, or None where none is stored or this mage-gen cannot
    build them; stale or not (a retune starts from them whatever their kernel text is now)."""
    entry = _class_entry(op, shape, run, gpu_name, directory)
    try:
        return op.params_from_dict(entry["params"]) if entry else None
    except (ConfigError, KeyError, TypeError):
        return None


def other_gpus_params(op: Op, shape: Any, run: dict[str, int], gpu_name: str,
                      directory: Path | None = None) -> list[tuple[str, Any]]:
    """This size class's stored winner on every other GPU of the folder (its folder name, its params), where this
    mage-gen can build them; a store it cannot read is passed over (it seeds a search, nothing more)."""
    root = directory or tuned_dir()
    found = []
    for folder in sorted(path.parent.name for path in root.glob(f"*/{op.name}.json")):
        if folder == gpu_slug(gpu_name):
            continue
        with contextlib.suppress(StoreError):  # a folder's name is its GPU's slug, and a slug names itself
            if (params := stored_params(op, shape, run, folder, root)) is not None:
                found.append((folder, params))
    return found


def stored_axes(op: Op, shape: Any, run: dict[str, int], gpu_name: str, directory: Path | None = None) -> set[str]:
    """The params this size class's stored winner names: an entry tuned before an axis existed lacks it."""
    entry = _class_entry(op, shape, run, gpu_name, directory)
    params = entry.get("params") if entry else None
    return set(params) if isinstance(params, dict) else set()


def load_winners(op: Op, shape: Any, gpu_name: str, directory: Path | None = None) -> list[Winner]:
    """The stored winner of every size class of a shape, smallest run size first; each refused when the
    templates changed since it was tuned."""
    winners, refused = current_winners(op, shape, gpu_name, directory)
    if refused:
        raise refused[0]
    return winners


def current_winners(op: Op, shape: Any, gpu_name: str,
                    directory: Path | None = None) -> tuple[list[Winner], list[StoreError]]:
    """load_winners where some size classes may be stale (a template changed, and a retune has reached only
    some classes): the winners still current, and why each other class was refused."""
    keys = shape_entries(op, shape, gpu_name, directory)
    if not keys:  # load_entry words the error: no file, or no entry for this shape
        load_entry(op.name, gpu_name, op.shape_key(shape), directory=directory)
    winners, refused = [], []
    for key in keys:
        try:
            winners.append(_winner(op, shape, gpu_name, key, directory))
        except StoreError as exc:
            refused.append(exc)
    return sorted(winners, key=lambda w: sorted((w.run or {}).items())), refused


def load_winner(op: Op, shape: Any, gpu_name: str, run: dict[str, int] | None = None,
                directory: Path | None = None, l2_bytes: int | None = None) -> Winner:
    """The stored winner that serves a launch of `run` (default: the op's run defaults), by dispatch.RULE;
    l2_bytes defaults to the L2 recorded with the entries (the GPU they were tuned on)."""
    return pick_winner(op, shape, load_winners(op, shape, gpu_name, directory), run, l2_bytes)


def pick_winner(op: Op, shape: Any, winners: list[Winner], run: dict[str, int] | None = None,
                l2_bytes: int | None = None) -> Winner:
    """Of a shape's winners (one per size class), the one dispatch.RULE picks for a launch of `run`."""
    if len(winners) == 1:
        return winners[0]
    run = dict(op.run_defaults) if run is None else run
    l2 = l2_bytes if l2_bytes is not None else int(winners[0].entry["gpu"]["l2_bytes"])
    chosen = dispatch.choose(op, shape, run, [dispatch.SizeClass(w.key, w.run or {}) for w in winners], l2)
    return next(w for w in winners if w.key == chosen.key)


def _entry_run(op: Op, entry: dict[str, Any]) -> dict[str, int]:
    run = entry.get("run") if isinstance(entry.get("run"), dict) else {}
    return {name: int(run.get(name, op.run_defaults[name])) for name in op.run_dims}


def _winner(op: Op, shape: Any, gpu_name: str, key: str, directory: Path | None) -> Winner:
    path = store_file(op.name, gpu_name, directory)
    stored = load_entry(op.name, gpu_name, key, directory=directory)
    try:
        params = op.params_from_dict(stored["params"])
        current = op.source(shape, params)
    except ConfigError as exc:
        raise StoreError(f"{path}: entry {key} holds params this mage-gen cannot build ({exc}); "
                         f"run `{_tune_command(op.name, key)}` on this GPU, or pass --config") from None
    # Read again with the hash: the check that refuses a stale entry is load_entry's alone.
    entry = load_entry(op.name, gpu_name, key, current=current, directory=directory)
    return Winner(params=op.params_from_dict(entry["params"]), entry=entry, path=path, key=key,
                  run=_entry_run(op, entry))


def tuned_shapes(op: Op, gpu_name: str, directory: Path | None = None) -> dict[Any, Any]:
    """Every shape with a usable (buildable) entry, mapped to its params: what nearest-shape lookup draws on."""
    path = store_file(op.name, gpu_name, directory)
    if not path.exists():
        return {}
    found = {}
    for entry in _read(path, op.name)["entries"].values():
        try:
            shape = op.shape(**entry["shape"])
            found.setdefault(shape, op.params_from_dict(entry["params"]))
        except (ConfigError, KeyError, TypeError):
            continue
    return found


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside path, fsync, then rename over it: a reader sees the old file or the new one."""
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask decide the mode, as a plain open() would (mkstemp forces 0600).
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    # The rename is durable only once the folder is on disk too; some filesystems cannot fsync a folder.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read(path: Path, op_name: str) -> dict[str, Any]:
    def corrupt(why: str) -> StoreError:
        return StoreError(f"{path} is corrupt ({why}); fix it or remove it (mage-gen will not overwrite it)")

    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise corrupt(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise corrupt("not a JSON object")
    if doc.get("format") not in (1, 2, FORMAT):
        raise corrupt(f"format {doc.get('format')!r}, expected {FORMAT}")
    if doc.get("op") != op_name:
        raise corrupt(f"op {doc.get('op')!r}, expected {op_name!r}")
    if not isinstance(doc.get("entries"), dict):
        raise corrupt("'entries' is not an object")
    if doc["format"] == 1:
        doc = {**doc, "format": 2, "entries": {_class_key(k, e): e for k, e in doc["entries"].items()}}
    if doc["format"] == 2:
        op = OPS.get(op_name)
        entries = {key: _from_format_2(op, entry) for key, entry in doc["entries"].items()} if op else doc["entries"]
        doc = {**doc, "format": FORMAT, "entries": entries}
    return doc


def _from_format_2(op: Op, entry: Any) -> Any:
    """A format-2 entry with its params (and its runner-ups') as the op takes them today."""
    if not isinstance(entry, dict):
        return entry
    shape = entry.get("shape") if isinstance(entry.get("shape"), dict) else {}

    def convert(params: Any) -> Any:
        return op.params_from_format_2(params, shape) if isinstance(params, dict) else params

    entry = {**entry, "params": convert(entry.get("params"))}
    if isinstance(entry.get("runner_ups"), list):
        entry["runner_ups"] = [{**r, "params": convert(r.get("params"))} if isinstance(r, dict) else r
                               for r in entry["runner_ups"]]
    return entry


def _class_key(key: str, entry: Any) -> str:
    """A format-1 key with the size class its entry was tuned at: 'd=768/float32' + its run {'m': 4096}."""
    run = entry.get("run") if isinstance(entry, dict) else None
    return key + _class_suffix(run) if isinstance(run, dict) else key


def _check_entry(entry: Any, where: str, fix: str = "the tuner must fill it in") -> None:
    def bad(why: str) -> StoreError:
        return StoreError(f"{where} {why}; {fix}")

    if not isinstance(entry, dict):
        raise bad("is not an object")
    missing = [key for key in REQUIRED_KEYS if key not in entry]
    if missing:
        raise bad(f"lacks required key(s) {', '.join(missing)}")
    not_dicts = [key for key in _DICT_KEYS if not isinstance(entry[key], dict)]
    if not_dicts:
        raise bad(f"has non-object {', '.join(not_dicts)}")
    missing_gpu = [key for key in REQUIRED_GPU_KEYS if key not in entry["gpu"]]
    if missing_gpu:
        raise bad(f"lacks gpu key(s) {', '.join(missing_gpu)}")
    for kind in TIMING_KINDS:
        timing = entry["timings"].get(kind)
        if not isinstance(timing, dict) or not _TIMING_FIELDS <= set(timing):
            raise bad(f"has no usable {kind} timing (needs {', '.join(sorted(_TIMING_FIELDS))})")
    if not isinstance(entry["date"], str) or not _is_iso_date(entry["date"]):
        raise bad(f"has date {entry['date']!r}, not an ISO 8601 string")


def _is_iso_date(text: str) -> bool:
    try:
        datetime.fromisoformat(text)
    except ValueError:
        return False
    return True


def _tune_command(op_name: str, shape_key: str) -> str:
    """'d=768/float32/m=4096' -> 'mage-gen tune layernorm --d 768 --m 4096': the sizes of a key (its first
    part, and its size class where it has one) are the tune flags."""
    parts = shape_key.split("/")
    sizes = [parts[0], *parts[2:3]]
    flags = [f"--{name} {value}" for group in sizes
             for name, sep, value in (part.partition("=") for part in group.split(",")) if sep]
    return " ".join(["mage-gen", "tune", op_name, *flags])
