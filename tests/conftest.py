import os
import shutil
import tempfile

import pytest

_MEMORY = "/dev/shm"


def pytest_configure(config):
    """Temporary folders in memory where the machine has a tmpfs: an Optuna study commits to SQLite for every
    trial, and each commit waits on the disk (about 1.6 ms on CI), which the study tests do thousands of times."""
    if config.option.basetemp is None and os.path.isdir(_MEMORY) and os.access(_MEMORY, os.W_OK):
        config.option.basetemp = tempfile.mkdtemp(prefix="mage-gen-tests-", dir=_MEMORY)
        config._mage_gen_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    folder = getattr(config, "_mage_gen_basetemp", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, every GPU test on one worker, one at a time: a kernel timed beside another test's would
    be timed wrong, and the device fixture opens the GPU once per module there."""
    for item in items:
        if item.get_closest_marker("gpu") or "device" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("gpu"))


@pytest.fixture(autouse=True, scope="session")
def _private_compile_cache(tmp_path_factory):
    """Tests compile into their own cache so that a cold cache is really cold and nothing leaks out."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MAGE_GEN_CACHE", str(tmp_path_factory.mktemp("nvrtc-cache")))
    yield
    mp.undo()


@pytest.fixture
def synthetic_entry():
    """make(params=None, **overrides) -> a SYNTHETIC tuned/ entry: the census and template hash are real
    (compiled here), the GPU, timings and peers are made up in the shape the tuner records them."""
    from datetime import datetime, timezone

    import mage_gen
    from mage_gen.compile import nvrtc_version
    from mage_gen.ops import get_op
    from mage_gen.timing import Timing
    from mage_gen.variants import build

    op = get_op("layernorm")

    def make(d: int = 768, params: dict | None = None, **overrides) -> dict:
        p = op.params_from_dict(params or {"template": "row", "threads": 128, "vector": 16})
        variant = build(op, op.shape(d=d), p, "sm_90")
        entry = {
            "shape": {"d": d},
            "params": op.params_to_dict(p),
            "kernel": variant.source.kernel_name,
            "template": variant.source.template,
            "template_hash": variant.source.template_hash,
            "source_hash": variant.source.source_hash,
            "objective": "hot",
            "timings": {"hot": Timing.from_samples("hot", [5.10, 5.12, 5.14, 5.20, 5.11]).to_dict(),
                        "cold": Timing.from_samples("cold", [9.40, 9.52, 9.61, 9.45, 9.70]).to_dict()},
            "peers": {"torch": {"hot": Timing.from_samples("hot", [6.40, 6.41, 6.45, 6.39, 6.50]).to_dict(),
                                "cold": Timing.from_samples("cold", [10.2, 10.3, 10.1, 10.4, 10.2]).to_dict()}},
            "census": variant.census.to_dict(),
            "gpu": {"name": "NVIDIA H200", "cc": "9.0", "driver": "580.82.07", "sms": 132,
                    "l2_bytes": 52428800},
            "nvrtc": nvrtc_version(),
            "mage_gen": mage_gen.__version__,
            "date": datetime(2025, 11, 30, 6, 0, tzinfo=timezone.utc).isoformat(),
        }
        entry.update(overrides)
        return entry

    return make


@pytest.fixture(scope="module")
def device():
    """The GPU, or a clean skip where there is no CUDA driver (CI)."""
    from mage_gen import gpu
    from mage_gen.errors import NoGpuError

    try:
        return gpu.open_device()
    except NoGpuError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def stream(device):
    from mage_gen import gpu

    return gpu.Stream()


# ---- the recording the tuner's tests replay (tests/replayed.py) ----

@pytest.fixture(scope="session")
def recording_path():
    from replayed import RECORD_COMMAND, RECORDING

    if not RECORDING.is_file():
        pytest.fail(f"{RECORDING} is missing: these tests replay timings recorded on an H200. Record it there "
                    f"with `{RECORD_COMMAND}` and commit it.", pytrace=False)
    return RECORDING


@pytest.fixture(scope="session")
def recording_doc(recording_path) -> dict:
    import json

    return json.loads(recording_path.read_text())


@pytest.fixture
def recording(recording_doc) -> dict:
    """A private copy of the recording, free to modify into a derived one."""
    import copy

    return copy.deepcopy(recording_doc)
