"""PTX text → entries: parameters, register declarations, shared variables and statements.

Only the structure is read here; what each statement means is decode.py's job."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mage_gen.interp.errors import InterpError

_TYPE_SIZES = {"pred": 1, "b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
               "b32": 4, "u32": 4, "s32": 4, "f32": 4, "bf16x2": 4, "f16x2": 4, "tf32": 4, "b64": 8, "u64": 8, "s64": 8,
               "f64": 8}


@dataclass(frozen=True)
class Statement:
    line: int  # 1-based line in the PTX text
    text: str  # the statement as written, for error messages
    guard: str | None  # '%p1' or '!%p1' or None
    opcode: str  # 'ld.global.nc.v4.f32'
    operands: tuple[str, ...]  # raw operand strings ('{%f1, %f2}' stays one operand)


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    offset: int
    size: int


@dataclass(frozen=True)
class SharedVar:
    name: str
    align: int
    size: int  # 0 for an extern (dynamic) array


@dataclass
class Entry:
    name: str
    params: list[Param] = field(default_factory=list)
    reg_types: dict[str, str] = field(default_factory=dict)  # '%f' prefix or '%f3' name -> type
    shared: list[SharedVar] = field(default_factory=list)  # in declaration order (module ones first)
    labels: dict[str, int] = field(default_factory=dict)  # label -> index of the next statement
    body: list[Statement] = field(default_factory=list)
    constants: dict[str, bytes] = field(default_factory=dict)  # module .const arrays of bytes, by name
    globals: dict[str, bytes] = field(default_factory=dict)  # module .global arrays of bytes (initial values), by name


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_SHARED = re.compile(r"^(?:\.extern\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)\s*(?:\[(\d*)\])?$")
_REG = re.compile(r"^\.reg\s+\.(\w+)\s+(.+)$")
_PARAM = re.compile(r"^\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)(?:\[(\d+)\])?$")
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\((.*?)\)", re.S)
# a module-scope .const array of bytes with its initial values (what NVRTC makes of a __constant__ table)
_CONST = re.compile(r"^[ \t]*\.const\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+([\w$]+)\s*\[(\d+)\]\s*(?:=\s*\{([^}]*)\})?\s*;",
                    re.M)
# the same in global memory (what NVRTC makes of a __device__ table)
_GLOBAL = re.compile(r"^[ \t]*(?:\.visible\s+)?\.global\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+([\w$]+)\s*\[(\d+)\]\s*"
                     r"(?:=\s*\{([^}]*)\})?\s*;", re.M)


def split_operands(text: str) -> tuple[str, ...]:
    """Split on commas outside braces and brackets."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return tuple(out)


def _statements(text: str, first_line: int):
    """(line, statement text) for every ';'-terminated statement or label, comments removed."""
    clean = _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    line = first_line
    buf, buf_line = [], None
    for i, ch in enumerate(clean):
        if ch == "\n":
            line += 1
        if buf_line is None and not ch.isspace() and ch not in "{}":
            buf_line = line
        if buf_line is None:
            continue
        buf.append(ch)
        if ch == ";" or (ch == ":" and re.fullmatch(r"\s*[\w$]+:", "".join(buf))):
            yield buf_line, "".join(buf).strip()
            buf, buf_line = [], None
    if "".join(buf).strip():
        raise InterpError(f"line {buf_line}: unterminated statement {''.join(buf).strip()!r}")


def _add_shared(entry_or_list: list[SharedVar], m: re.Match) -> None:
    align, typ, name, count = m.groups()
    size = _TYPE_SIZES[typ] * (int(count) if count else (0 if count == "" else 1))
    entry_or_list.append(SharedVar(name, int(align or _TYPE_SIZES[typ]), size))


def _module_arrays(pattern: re.Pattern, space: str, ptx: str) -> dict[str, bytes]:
    """The module-scope arrays of bytes `pattern` finds, with their initial values (zeros past the last given)."""
    arrays = {}
    for cm in pattern.finditer(_COMMENT.sub("", ptx)):
        typ, name, count, values = cm.groups()
        if typ not in ("b8", "u8"):
            raise InterpError(f"a .{space} array of .{typ} is not supported (bytes only)")
        data = bytes(int(v, 0) & 0xFF for v in values.split(",")) if values else b""
        arrays[name] = data.ljust(int(count), b"\0")
    return arrays


def parse(ptx: str) -> dict[str, Entry]:
    """Every .entry of the module, by name."""
    module_shared: list[SharedVar] = []
    constants, globals_ = (_module_arrays(pattern, space, ptx) for pattern, space in ((_CONST, "const"),
                                                                                      (_GLOBAL, "global")))
    entries: dict[str, Entry] = {}
    pos = 0
    for m in _ENTRY.finditer(ptx):
        # module-scope declarations before this entry
        for decl in re.findall(r"^[ \t]*((?:\.extern\s+)?\.shared\b[^;]*);", _COMMENT.sub("", ptx[pos:m.start()]), re.M):
            if not (sm := _SHARED.match(decl.strip())):
                raise InterpError(f"cannot read module-scope shared declaration {decl.strip()!r}")
            _add_shared(module_shared, sm)
        entry = Entry(m.group(1))
        offset = 0
        for raw in split_operands(m.group(2)):
            pm = _PARAM.match(raw.strip())
            if not pm:
                raise InterpError(f"entry {entry.name}: cannot read parameter {raw.strip()!r}")
            align, typ, name, count = pm.groups()
            size = _TYPE_SIZES[typ] * int(count or 1)
            al = int(align or _TYPE_SIZES[typ])
            offset = -(-offset // al) * al
            entry.params.append(Param(name, typ, offset, size))
            offset += size
        # the body: from the '{' after the header to its matching '}'
        open_at = ptx.index("{", m.end())
        depth, i = 0, open_at
        while True:
            if ptx[i] == "{":
                depth += 1
            elif ptx[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        body_line = ptx.count("\n", 0, open_at) + 1
        entry.shared.extend(module_shared)
        entry.constants, entry.globals = constants, globals_
        for line, st in _statements(ptx[open_at + 1:i], body_line):
            if st.endswith(":"):
                entry.labels[st[:-1].strip()] = len(entry.body)
                continue
            s = st.rstrip(";").strip()
            if s.startswith("."):
                if rm := _REG.match(s):
                    for decl in rm.group(2).split(","):
                        decl = decl.strip()
                        if pm := re.fullmatch(r"(%[A-Za-z_$]+)<(\d+)>", decl):
                            entry.reg_types[pm.group(1)] = rm.group(1)
                        else:
                            entry.reg_types[decl] = rm.group(1)
                elif sm := _SHARED.match(s):
                    _add_shared(entry.shared, sm)
                elif s.startswith(".pragma"):
                    pass
                elif s.startswith(".local"):
                    raise InterpError(f"line {line}: local memory ({s!r}) is not supported")
                else:
                    raise InterpError(f"line {line}: unknown directive {s!r}")
                continue
            guard = None
            if s.startswith("@"):
                guard, s = s[1:].split(None, 1)
            parts = s.split(None, 1)
            entry.body.append(Statement(line, st, guard, parts[0],
                                        split_operands(parts[1]) if len(parts) > 1 else ()))
        pos = i
        entries[entry.name] = entry
    if not entries:
        raise InterpError("no .entry in the PTX")
    return entries
