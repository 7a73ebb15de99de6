"""What a gemm_sm90 launch's order of work asks of DRAM, in a model run on the host: the CTAs of a persistent grid
advance one BK step each at one rate, each step reading its tile's BM×BK slice of A and BN×BK slice of B through an
L2 kept as one least-recently-used set of those slices. For the data-parallel order (CTA c: tiles c, c + G, ...),
stream K over every tile, and stream K over the last, partial wave (`stream_waves`, what the kernel does), it
counts the bytes of A and B read from DRAM, over the bytes of A and B, and the steps of the slowest CTA (ideal: all
steps over G). A tile's pieces, their partials and the epilogues are left out, as are L2's sets, partitions and
lines: the model says whether an order shares operand slices among the CTAs in flight, not a launch's time.

    python -m bench.probes.gemm_sm90_l2_model --shape 2048x28672x4096:silu --l2-mib 50 \\
        --config bm=128,bn=256,grid=132,group=16 --out gemm_sm90_l2_model.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mage_gen import __version__
from mage_gen.ops import get_op
from mage_gen.ops.gemm_sm90 import _kblocks, _units, stream_ctas, stream_waves
from mage_gen.store import write_atomic

ORDERS = ("data-parallel", "stream K, every tile", "stream K, the last wave")


def tile_at(t: int, units_m: int, units_n: int, group: int) -> tuple[int, int]:
    """(row, col) of tile t in the grouped order (super-rows of `group` rows, column by column), as unit_at."""
    first = t // (group * units_n) * group
    rows = min(units_m - first, group)
    at = t % (group * units_n)
    return first + at % rows, at // rows


def schedules(tiles: int, kblocks: int, ctas: int, whole_waves: int) -> list[list[tuple[int, int]]]:
    """Each CTA's (tile, k step) in the order it takes them: `whole_waves` waves of whole tiles, then an even share
    of the other tiles' steps, as the kernel's sk_start deals them."""
    whole = whole_waves * ctas
    streamed = (tiles - whole) * kblocks
    out = []
    for c in range(ctas):
        steps = [(c + w * ctas, kb) for w in range(whole_waves) for kb in range(kblocks)]
        begin, end = c * streamed // ctas, (c + 1) * streamed // ctas
        steps += [(whole + i // kblocks, i % kblocks) for i in range(begin, end)]
        out.append(steps)
    return out


def data_parallel(tiles: int, kblocks: int, ctas: int) -> list[list[tuple[int, int]]]:
    return [[(t, kb) for t in range(c, tiles, ctas) for kb in range(kblocks)] for c in range(ctas)]


def reads(steps: list[list[tuple[int, int]]], grid: tuple[int, int, int], slice_bytes: tuple[int, int],
          l2_bytes: int) -> int:
    """Bytes read from DRAM when every CTA takes its next step in turn, an L2 of l2_bytes holding the slices most
    recently used."""
    units_m, units_n, group = grid
    cache: OrderedDict[tuple[str, int, int], int] = OrderedDict()
    held = missed = 0

    def touch(key: tuple[str, int, int], size: int) -> None:
        nonlocal held, missed
        if key in cache:
            cache.move_to_end(key)
            return
        missed += size
        cache[key] = size
        held += size
        while held > l2_bytes:
            held -= cache.popitem(last=False)[1]

    def ticks() -> Iterator[list[tuple[int, int]]]:
        for i in range(max(map(len, steps))):
            yield [s[i] for s in steps if i < len(s)]

    for tick in ticks():
        for t, kb in tick:
            row, col = tile_at(t, units_m, units_n, group)
            touch(("A", row, kb), slice_bytes[0])
            touch(("B", col, kb), slice_bytes[1])
    return missed


def model(shape, p, l2_bytes: int) -> dict[str, Any]:
    units_m, units_n = _units(shape, p)
    tiles, kblocks, ctas = units_m * units_n, _kblocks(shape), stream_ctas(shape, p)
    item = shape.element.itemsize
    slices = (p.bm * shape.bk * item, p.bn * shape.bk * item)
    operands = (units_m * slices[0] + units_n * slices[1]) * kblocks
    orders = dict(zip(ORDERS, (data_parallel(tiles, kblocks, ctas), schedules(tiles, kblocks, ctas, 0),
                               schedules(tiles, kblocks, ctas, stream_waves(shape, p)))))
    rows = {}
    for name, steps in orders.items():
        dram = reads(steps, (units_m, units_n, p.group), slices, l2_bytes)
        rows[name] = {"dram_over_operands": dram / operands, "steps_of_slowest_cta": max(map(len, steps))}
    return {"tiles": tiles, "kblocks": kblocks, "ctas": ctas, "operand_bytes": operands,
            "ideal_steps": tiles * kblocks / ctas, "whole_waves": stream_waves(shape, p), "orders": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", required=True,
                    help="MxNxK[:silu] (repeatable; silu: B holds a gate's rows and an up's, N of them)")
    ap.add_argument("--config", required=True, help="KEY=VALUE,... of gemm_sm90 (grid a number of CTAs)")
    ap.add_argument("--l2-mib", type=float, required=True, help="the L2 the model keeps, in MiB (the GPU's)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    op = get_op("gemm_sm90")
    values = dict(pair.split("=", 1) for pair in args.config.split(","))
    p = op.params_from_dict({**{k: int(v) if v.isdigit() else v for k, v in values.items()}, "stream_k": True})
    out = {}
    for text in args.shape:
        size, _, gate = text.partition(":")
        m, n, k = (int(v) for v in size.split("x"))
        shape = op.shape(m=m, n=n, k=k, gate=gate or "none")
        out[text] = model(shape, p, int(args.l2_mib * 2**20))
        for name, row in out[text]["orders"].items():
            print(f"{text} {name:24s} DRAM/operands {row['dram_over_operands']:6.2f}  steps of the slowest CTA "
                  f"{row['steps_of_slowest_cta']} (ideal {out[text]['ideal_steps']:.1f})")
    doc = {"method": __doc__.split("\n\n")[0], "config": args.config, "l2_mib": args.l2_mib,
           "shapes": out, "mage_gen": __version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    write_atomic(args.out, (json.dumps(doc, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
