"""One study on several GPUs against one GPU: `mage-gen tune --gpus 0,1` and `--gpus 0` with the same budget,
each into a study of its own in the same server storage, the compile cache warmed first so that measuring is
what is shared. Records each run's phases (compiling, measuring, re-timing finalists), its winner and its
timings, and whether the two winners tie, into bench/results/<gpu>x<count>/fleet.json.

    python -m bench.fleet --storage postgresql://USER:PASSWORD@HOST/DB --gpus 0,1
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mage_gen import gpu
from mage_gen.store import gpu_slug, write_atomic
from mage_gen.timing import Timing

from bench._common import provenance

TUNE = ["layernorm", "--d", "768", "--preset", "full", "--trials", "192"]
PHASES = re.compile(r"phases: (.*)")


def tune(storage: str, study: str, gpus: str, folder: Path) -> dict:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mage_gen", "tune", *TUNE, "--storage", storage, "--study", study,
                           "--gpus", gpus, "--tuned", str(folder / "tuned"), "-o", str(folder / "k")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"tune --gpus {gpus} failed: {done.stderr.strip().splitlines()[-1:]}")
    phases = {name.strip(): float(seconds) for name, seconds in
              re.findall(r"([a-z -]+?) ([0-9.]+) s", PHASES.search(done.stdout).group(1))}
    (entry,) = json.loads(next((folder / "tuned").glob("*/layernorm.json")).read_text())["entries"].values()
    return {"gpus": gpus, "study": study, "wall_s": time.monotonic() - began, "phases_s": phases,
            "winner": entry["kernel"], "timings": entry["timings"], "objective": entry["objective"],
            "stdout": done.stdout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True, help="a server database both runs share")
    parser.add_argument("--gpus", default="0,1")
    args = parser.parse_args()
    device = gpu.open_device()
    stamp = time.strftime("%Y%m%d%H%M%S")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        # warm the compile cache: every config of the preset compiled once, untimed
        subprocess.run([sys.executable, "-m", "mage_gen", "variants", *TUNE[:-2], "--json"], check=True,
                       stdout=subprocess.DEVNULL)
        several = tune(args.storage, f"fleet-{stamp}-several", args.gpus, root / "several")
        one = tune(args.storage, f"fleet-{stamp}-one", args.gpus.split(",")[0], root / "one")
    objective = one["objective"]
    mine, theirs = (Timing.from_dict(run["timings"][objective]) for run in (several, one))
    measuring = several["phases_s"]["measuring"] / one["phases_s"]["measuring"]
    doc = {
        "what": "mage-gen tune on several GPUs sharing one study against one GPU, same budget; recorded by "
                "bench/fleet.py",
        "method": {"tune": " ".join(TUNE), "cache": "every config compiled before either run",
                   "storage": args.storage.split("@")[-1]},
        **provenance(device), "several": several, "one": one,
        "summary": {"measuring_time_ratio": measuring, "target": 0.55, "met": measuring <= 0.55,
                    "winners": [several["winner"], one["winner"]],
                    "several_at_most_one_or_tied": mine.median_us <= theirs.median_us or mine.ties_with(theirs)},
    }
    count = len(args.gpus.split(","))
    out = Path("bench/results") / f"{gpu_slug(device.name)}x{count}" / "fleet.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, (json.dumps(doc, indent=1) + "\n").encode())
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
