"""What the interpreter raises. Every message names the PTX instruction and its line; memory faults
and races also name the thread (block and thread index) and the address."""

from __future__ import annotations


class InterpError(Exception):
    """The PTX cannot be interpreted, or it did something undefined."""


class UnknownInstruction(InterpError):
    """An instruction (or a form of one) the interpreter does not implement: never skipped."""


class MemoryFault(InterpError):
    """An access outside every buffer, or a misaligned one."""


class RaceError(InterpError):
    """Two threads touched the same shared-memory bytes between two barriers, at least one writing."""


class StaleReadError(InterpError):
    """A read of shared memory that a cp.async still in flight (not yet waited for) is filling."""


class DivergenceError(InterpError):
    """A warp-synchronous instruction (bar.sync, shfl.sync) executed by part of the lanes it needs."""
