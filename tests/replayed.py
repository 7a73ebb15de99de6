"""The layer-norm tune replayed on the CPU: the recording of timings made on an H200 that the tuner's tests
(test_tune, test_cli_tune) answer every measurement from, and what they ask of it. conftest.py's recording
fixtures read it."""

from pathlib import Path

from mage_gen.ops import get_op
from mage_gen.space import load_space

RECORDING = Path(__file__).parent / "fixtures" / "layernorm_trials_h200_d768_m4096.json"
RECORD_COMMAND = ("python -m bench.probes.layernorm_trials --d 768 --m 4096 --preset quick "
                  "--out tests/fixtures/layernorm_trials_h200_d768_m4096.json")
H200 = "NVIDIA H200"
OP = get_op("layernorm")
SHAPE = OP.shape(d=768)
RUN = {"m": 4096}
QUICK = load_space(OP, "quick")


def by_kernel(doc: dict) -> dict[str, dict]:
    return {r["kernel"]: r for r in doc["variants"]}


def sqlite(folder: Path) -> str:
    return f"sqlite:///{folder / 'studies.db'}"


def hot_median(doc: dict, kernel: str) -> float | None:
    record = by_kernel(doc)[kernel]
    return record["hot"]["median_us"] if record["hot"] else None
