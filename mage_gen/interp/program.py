"""An entry decoded once: instructions as closures over pre-resolved register slots and immediates."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mage_gen.interp.errors import InterpError, UnknownInstruction
from mage_gen.interp.memory import Global
from mage_gen.interp.parse import Entry

OP, BRA, BAR, EXIT, ARRIVE = 0, 1, 2, 3, 4  # instruction kinds the warp loop dispatches on

# bf16 has no numpy type: its registers hold the bits (the conversions in alu read and write them as such),
# as do the packed pairs bf16x2 and f16x2.
DTYPES = {"pred": np.bool_, "b8": np.uint8, "u8": np.uint8, "s8": np.int8, "b16": np.uint16, "u16": np.uint16,
          "s16": np.int16, "f16": np.float16, "bf16": np.uint16, "b32": np.uint32, "u32": np.uint32,
          "s32": np.int32, "f32": np.float32, "bf16x2": np.uint32, "f16x2": np.uint32, "tf32": np.uint32, "b64": np.uint64,
          "u64": np.uint64, "s64": np.int64, "f64": np.float64}
SPECIALS = ("%tid.x", "%tid.y", "%tid.z", "%ntid.x", "%ntid.y", "%ntid.z", "%ctaid.x", "%ctaid.y", "%ctaid.z",
            "%nctaid.x", "%nctaid.y", "%nctaid.z", "%laneid", "%warpid", "%cluster_ctarank", "%cluster_nctarank")
LANES = 32
CONST_GENERIC_BASE = 0x7C00_0000_0000  # address of the module's first .const byte


@dataclass(slots=True)
class Instr:
    kind: int
    fn: Callable[[Any, Any], None] | None
    guard: int  # predicate slot, or -1
    neg: bool  # @!p
    target: int  # branch target (kind BRA)
    line: int
    text: str
    uni: bool = False  # bra.uni: the branch promises not to diverge


@dataclass
class Program:
    entry: Entry
    instrs: list[Instr] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=dict)  # register name -> slot
    slot_dtypes: list[Any] = field(default_factory=list)
    shared_offsets: dict[str, int] = field(default_factory=dict)  # shared symbol -> window address
    static_shared: int = 0  # bytes before the dynamic (extern) array
    dynamic_align: int = 16
    async_proxy: bool = False  # uses mbarriers, TMA or wgmma: its blocks keep hopper.AsyncState
    cross_block: bool = False  # has gpu-scope fences or global atomics: its launch keeps a memory.Visibility
    constants: bytes = b""  # the module's .const arrays, one after another (const_offsets)
    const_offsets: dict[str, int] = field(default_factory=dict)
    # the module's .global arrays, at the first global addresses (memory.Global lays them out before the launch's
    # buffers), by name
    global_offsets: dict[str, int] = field(default_factory=dict)


def view(x: np.ndarray, dt) -> np.ndarray:
    """A register's lanes seen as type dt (same size: a reinterpretation, as PTX's bit types allow)."""
    if x.dtype == dt:
        return x
    if x.dtype.itemsize == np.dtype(dt).itemsize:
        return x.view(dt)
    if dt is np.bool_ or x.dtype == np.bool_:
        return x.astype(dt)
    if x.dtype.kind in "iu" and np.dtype(dt).kind in "iu":  # st of a wider register: truncated
        return x.astype(dt)
    raise InterpError(f"a register holding {x.dtype} read as {np.dtype(dt)}")


def parse_int(text: str) -> int:
    t = text.strip()
    neg = t.startswith("-")
    t = t.lstrip("-+")
    if t.endswith("U"):
        t = t[:-1]
    v = int(t, 16) if t.lower().startswith("0x") else int(t, 8) if len(t) > 1 and t.startswith("0") else int(t)
    return -v if neg else v


def immediate(text: str, dt) -> np.ndarray | None:
    """The literal as a 0-d array of dt, or None where text is not a literal."""
    t = text.strip()
    dt = np.dtype(dt)
    if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", t):
        bits = np.array(int(t[2:], 16), dtype=np.uint32).view(np.float32)
        return bits.astype(dt) if dt.kind == "f" else bits.view(dt) if dt.itemsize == 4 else None
    if re.fullmatch(r"0[dD][0-9a-fA-F]{16}", t):
        bits = np.array(int(t[2:], 16), dtype=np.uint64).view(np.float64)
        return bits.astype(dt)
    if re.fullmatch(r"[-+]?(0[xX][0-9a-fA-F]+|\d+)U?", t):
        v = parse_int(t)
        if dt.kind == "f":
            return np.array(v, dtype=dt)
        if dt == np.bool_:
            return np.array(bool(v))
        bits = dt.itemsize * 8
        return np.array(v & ((1 << bits) - 1), dtype=f"u{dt.itemsize}").view(dt)
    if re.fullmatch(r"[-+]?\d+\.\d*(e[-+]?\d+)?", t):
        return np.array(float(t), dtype=dt)
    return None


class Decoder:
    """Turns statements into Instrs; builders (alu.py, memops.py) call src/dst to resolve operands."""

    def __init__(self, entry: Entry):
        self.entry = entry
        self.prog = Program(entry)
        offset = 0
        for var in entry.shared:
            if var.size == 0:  # extern: the dynamic array, after every static one
                self.prog.dynamic_align = max(self.prog.dynamic_align, var.align)
                continue
            offset = -(-offset // var.align) * var.align
            self.prog.shared_offsets[var.name] = offset
            offset += var.size
        self.prog.static_shared = offset
        for name, data in entry.constants.items():
            self.prog.const_offsets[name] = CONST_GENERIC_BASE + len(self.prog.constants)
            self.prog.constants += data.ljust(-(-len(data) // 16) * 16, b"\0")
        self.prog.global_offsets = dict(zip(entry.globals, Global.layout(list(map(len, entry.globals.values())))))
        self.dynamic_names = [v.name for v in entry.shared if v.size == 0]
        self.params = {p.name: p for p in entry.params}
        for name in SPECIALS:
            self.slot(name)

    def dynamic_base(self) -> int:
        a = self.prog.dynamic_align
        return -(-self.prog.static_shared // a) * a

    def symbol(self, name: str) -> int | None:
        """Shared-window address of a shared variable, the address of a .const or .global array, or None."""
        if name in self.prog.shared_offsets:
            return self.prog.shared_offsets[name]
        if name in self.prog.const_offsets:
            return self.prog.const_offsets[name]
        if name in self.prog.global_offsets:
            return self.prog.global_offsets[name]
        if name in self.dynamic_names:
            return self.dynamic_base()
        return None

    def reg_type(self, name: str) -> str:
        if name in self.entry.reg_types:
            return self.entry.reg_types[name]
        prefix = re.sub(r"\d+$", "", name)
        if prefix in self.entry.reg_types:
            return self.entry.reg_types[prefix]
        if name in SPECIALS:
            return "u32"
        raise InterpError(f"undeclared register {name}")

    def is_register(self, text: str) -> bool:
        """%name, or a name a .reg declared without the % (as inline assembly often names its own)."""
        return text.startswith("%") or text in self.entry.reg_types

    def slot(self, name: str) -> int:
        s = self.prog.slots.get(name)
        if s is None:
            s = self.prog.slots[name] = len(self.prog.slot_dtypes)
            self.prog.slot_dtypes.append(DTYPES[self.reg_type(name)])
        return s

    # ---- operands ----
    def src(self, text: str, dt) -> Callable[[list], Any]:
        """A getter r -> lanes (or a 0-d constant) of the operand seen as dt."""
        text = text.strip()
        neg = text.startswith("!")
        if neg:
            text = text[1:]
        if self.is_register(text):
            s = self.slot(text)
            if neg:
                return lambda r: ~r[s]
            return lambda r: view(r[s], dt)
        imm = immediate(text, dt)
        if imm is None and (addr := self.symbol(text)) is not None:
            imm = np.array(addr, dtype=dt)
        if imm is None:
            raise UnknownInstruction(f"operand {text!r} not understood")
        return lambda r: imm

    def const(self, text: str, dt) -> np.ndarray | None:
        """The operand's value where it is a literal (or a shared symbol), else None."""
        imm = immediate(text.strip(), dt)
        if imm is None and (addr := self.symbol(text.strip())) is not None:
            imm = np.array(addr, dtype=dt)
        return imm

    def dst(self, text: str) -> int:
        text = text.strip()
        if text == "_":
            return -1
        if not self.is_register(text):
            raise UnknownInstruction(f"destination {text!r} is not a register")
        return self.slot(text)

    def vector(self, text: str) -> list[str]:
        text = text.strip()
        if text.startswith("{"):
            return [x.strip() for x in text[1:-1].split(",")]
        return [text]

    def address(self, text: str) -> tuple[Callable[[list], Any], np.uint64]:
        """[reg+off] / [sym+off] / [imm]: (getter of the base as u64, constant byte offset as u64: a
        negative offset wraps, as the address arithmetic does)."""
        inner = text.strip()
        if not (inner.startswith("[") and inner.endswith("]")):
            raise UnknownInstruction(f"address operand {text!r} not understood")
        inner = inner[1:-1].replace(" ", "")
        m = re.fullmatch(r"([%\w$.]+?)(?:\+(-?(?:0x[0-9a-fA-F]+|\d+)))?", inner)
        if not m:
            raise UnknownInstruction(f"address operand {text!r} not understood")
        base = m.group(1)
        off = np.uint64((parse_int(m.group(2)) if m.group(2) else 0) & 0xFFFFFFFFFFFFFFFF)
        if self.is_register(base):
            s = self.slot(base)
            return (lambda r: view(r[s], np.uint64) if r[s].dtype.itemsize == 8 else r[s].astype(np.uint64)), off
        if base in self.params:
            raise UnknownInstruction(f"parameter {base} used outside ld.param")
        if (addr := self.symbol(base)) is not None:
            return (lambda r: np.uint64(addr)), off
        if re.fullmatch(r"\d+|0x[0-9a-fA-F]+", base):
            return (lambda r: np.uint64(parse_int(base))), off
        raise UnknownInstruction(f"address operand {text!r}: unknown symbol {base}")

