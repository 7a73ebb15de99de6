"""Emitted kernels: four files that stand alone, carry their provenance, and build with plain nvcc."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import mage_gen
from mage_gen.compile import nvrtc_version
from mage_gen.emit import emit
from mage_gen.errors import MageError
from mage_gen.ops import get_op
from mage_gen.ops.layernorm import Params
from mage_gen.store import save_entry
from mage_gen.variants import build

OP = get_op("layernorm")
SHAPE = OP.shape(d=768)
C_TYPES = {"out": "float*", "in": "const float*", "i32": "int", "f32": "float"}
JINJA_LEFT = re.compile(r"\{%-?\s*(if|elif|else|endif|for|endfor|set|endset|macro|endmacro|call|endcall|"
                        r"import|from|include|filter|raw|block)\b")
NAMES = ["layernorm_d768.cu", "layernorm_d768.ptx", "layernorm_d768.cubin", "layernorm_d768.launch.json"]


def test_emit_writes_the_four_files_of_the_variant(tmp_path):
    params = Params(template="multirow", threads=64, rows_per_block=2, hint="stream")
    out = tmp_path / "new" / "kernels"  # made when missing
    paths = emit(OP, SHAPE, params, "sm_90", out, None)
    assert paths == [out / name for name in NAMES]
    variant = build(OP, SHAPE, params, "sm_90")
    assert (out / "layernorm_d768.cubin").read_bytes() == variant.compiled.cubin
    assert (out / "layernorm_d768.ptx").read_text() == variant.compiled.ptx
    assert (out / "layernorm_d768.cu").read_text().endswith(variant.source.text)
    assert not [p for p in out.iterdir() if p.name not in NAMES]  # no scratch files left


def test_source_header_carries_provenance(tmp_path, synthetic_entry):
    entry = synthetic_entry()
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, entry)
    text = (tmp_path / "layernorm_d768.cu").read_text()
    header = text.split("\n\n", 1)[0]  # the provenance comment ends at the first blank line
    flat = " ".join(header.split())  # the key column's width is the header's business
    for expected in ("layernorm_row_d768_t128_v4_r1_approx_nc", "d=768", "threads=128", "sm_90",
                     f"layernorm/resident.cu.j2 (hash {entry['template_hash']})", mage_gen.__version__,
                     f"NVRTC {nvrtc_version()}", "NVIDIA H200", "grid (M, 1, 1), block (128, 1, 1)",
                     "float* y, const float* x, const float* w, const float* b, int M, float eps",
                     "5.120 us median, spread 0.030 us", "9.520 us median",
                     f"vs torch hot 6.410 us median; this kernel's hot median / torch's = {5.12 / 6.41:.3f}"):
        assert expected in flat, expected
    assert all(line.startswith("//") for line in header.strip().splitlines())
    # PTX operand lists open with "{%0", so Jinja is a tag keyword after "{%", or any "{{" / "{#"
    assert not JINJA_LEFT.search(text) and "{{" not in text and "{#" not in text


def test_without_provenance_the_header_says_so(tmp_path):
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, None)
    text = (tmp_path / "layernorm_d768.cu").read_text()
    assert "timings none" in " ".join(text.split()) and "NVIDIA" not in text and " us median" not in text


def test_newline_in_a_stored_value_cannot_escape_the_comment(tmp_path, synthetic_entry):
    entry = synthetic_entry()
    entry["gpu"]["name"] = "NVIDIA H200\nint injected = 1;"
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, entry)
    lines = (tmp_path / "layernorm_d768.cu").read_text().splitlines()
    assert not [line for line in lines if line.startswith("int injected")]


def test_launch_json_round_trips(tmp_path, synthetic_entry):
    entry = synthetic_entry()
    params = Params(template="multirow", threads=32, rows_per_block=4)
    emit(OP, OP.shape(d=1024), params, "sm_80", tmp_path, entry)
    doc = json.loads((tmp_path / "layernorm_d1024.launch.json").read_text())
    assert doc["kernel"] == "layernorm_multirow_d1024_t32_v4_r4_approx_nc" and doc["arch"] == "sm_80"
    assert doc["launch"] == {"grid": ["(M + 3) / 4", 1, 1], "block": [128, 1, 1], "dynamic_shared_bytes": 0}
    assert [(a["name"], a["type"]) for a in doc["args"]] == [(a.name, C_TYPES[a.kind]) for a in OP.args]
    assert OP.params_from_dict(doc["params"]) == params
    assert OP.shape(**doc["shape"]) == OP.shape(d=1024)
    assert doc["provenance"] == json.loads(json.dumps(entry))
    assert doc["template_hash"] == OP.source(OP.shape(d=1024), params).template_hash


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("d, params", [
    (768, Params()),
    (1000, Params(template="multirow", threads=32, vector=4, rows_per_block=4, hint="stream")),
    (65536, Params(template="wide", threads=256, rsqrt="exact", hint="none")),
])
def test_emitted_source_builds_with_plain_nvcc(tmp_path, synthetic_entry, d, params):
    paths = emit(OP, OP.shape(d=d), params, "sm_90", tmp_path, synthetic_entry())
    cubin = tmp_path / "nvcc.cubin"
    done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", str(paths[0]), "-o", str(cubin)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    # extern "C": the entry keeps its plain name, so a driver-API caller finds it by the name in launch.json
    assert OP.kernel_name(OP.shape(d=d), params).encode() + b"\0" in cubin.read_bytes()


def test_unwritable_out_dir_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(MageError) as raised:
        emit(OP, SHAPE, Params(), "sm_90", blocker / "kernels", None)
    assert str(blocker / "kernels") in str(raised.value) and "\n" not in str(raised.value)


def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    emit(OP, SHAPE, Params(), "sm_90", tmp_path, None)
    before = (tmp_path / "layernorm_d768.cu").read_bytes()

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(MageError, match="No space left on device"):
        emit(OP, SHAPE, Params(threads=64), "sm_90", tmp_path, None)
    assert (tmp_path / "layernorm_d768.cu").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NAMES)


# ---- the command line ----

def mage_gen_cli(*args, tuned=None, gpu=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("MAGE_GEN_TUNED", "MAGE_GEN_GPU")}
    if tuned is not None:
        env["MAGE_GEN_TUNED"] = str(tuned)
    if gpu is not None:
        env["MAGE_GEN_GPU"] = gpu
    return subprocess.run([sys.executable, "-m", "mage_gen", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def assert_one_line_error(done, says):
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_cli_emits_this_gpus_winner(tmp_path, synthetic_entry):
    # a SYNTHETIC entry: real census and template hash, made-up timings
    winner = {"template": "multirow", "threads": 64, "rows_per_block": 2, "hint": "stream"}
    save_entry("layernorm", "NVIDIA H200", "d=768/float32", synthetic_entry(params=winner), directory=tmp_path / "tuned")
    out = tmp_path / "out"
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(out), tuned=tmp_path / "tuned",
                        gpu="NVIDIA H200")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(out / name) for name in NAMES]
    doc = json.loads((out / "layernorm_d768.launch.json").read_text())
    assert doc["kernel"] == "layernorm_multirow_d768_t64_v4_r2_approx_stream"
    assert doc["provenance"]["gpu"]["name"] == "NVIDIA H200"
    assert "5.120 us median" in (out / "layernorm_d768.cu").read_text()


def test_cli_gpu_option_beats_the_environment_and_out_defaults_to_kernels(tmp_path, synthetic_entry):
    # a SYNTHETIC entry for another GPU model
    save_entry("layernorm", "NVIDIA GeForce RTX 4090", "d=768/float32", synthetic_entry(),
               directory=tmp_path / "tuned")
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "--gpu", "NVIDIA GeForce RTX 4090",
                        gpu="NVIDIA H200", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "kernels" / "layernorm_d768.cubin").is_file()


def test_cli_config_needs_no_gpu_and_gives_no_timings(tmp_path):
    done = mage_gen_cli("emit", "layernorm", "--d", "1024", "-o", str(tmp_path), "--arch", "sm_80",
                        "--config", "template=multirow,threads=32", "--config", "rows_per_block=4",
                        tuned=tmp_path / "empty")
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "layernorm_d1024.launch.json").read_text())
    assert doc["provenance"] is None and doc["arch"] == "sm_80"
    # unnamed params keep the op's defaults
    assert doc["params"] == OP.params_to_dict(Params(template="multirow", threads=32, rows_per_block=4))
    assert "timings none" in " ".join((tmp_path / "layernorm_d1024.cu").read_text().split())


def test_the_regenerate_line_of_a_matmul_header_rebuilds_the_same_kernel(tmp_path):
    mm = get_op("matmul")
    shape = mm.shape(m=256, n=256, k=256)
    params = mm.params_type(bm=128, bn=128, bk=16, tm=16, tn=8, buffers=3, split=True, sync="one")
    emit(mm, shape, params, "sm_90", tmp_path / "first", None)
    name = "matmul_m256_n256_k256"
    header = (tmp_path / "first" / f"{name}.cu").read_text().split("\n\n", 1)[0]
    command = next(line for line in header.splitlines() if "mage-gen emit" in line).split("mage-gen ", 1)[1].split()
    done = mage_gen_cli(*command, "-o", str(tmp_path / "again"), tuned=tmp_path / "empty")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "again" / f"{name}.ptx").read_bytes() == (tmp_path / "first" / f"{name}.ptx").read_bytes()


def test_cli_without_a_winner(tmp_path):
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path,
                        gpu="NVIDIA H200")
    assert_one_line_error(done, "run `mage-gen tune layernorm --d 768` on this GPU, or pass --config")
    assert not (tmp_path / "out").exists()


def test_cli_without_a_gpu_name(tmp_path):
    # No GPU on the test machine: device_name() cannot answer, so --gpu or --config is needed.
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("a GPU answers here, so its name is found")
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path)
    assert_one_line_error(done, "pass --gpu NAME")


def test_cli_stale_winner(tmp_path, synthetic_entry):
    # a SYNTHETIC entry whose templates have changed since it was tuned
    save_entry("layernorm", "NVIDIA H200", "d=768/float32", synthetic_entry(template_hash="0123456789abcdef"),
               directory=tmp_path)
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path,
                        gpu="NVIDIA H200")
    assert_one_line_error(done, "made from another template version")
    assert not (tmp_path / "out").exists()


def test_cli_corrupt_store(tmp_path):
    path = tmp_path / "h200" / "layernorm.json"
    path.parent.mkdir()
    path.write_text("{ half a file")
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(tmp_path / "out"), tuned=tmp_path,
                        gpu="NVIDIA H200")
    assert_one_line_error(done, f"{path} is corrupt")
    assert path.read_text() == "{ half a file"


def test_cli_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = mage_gen_cli("emit", "layernorm", "--d", "768", "-o", str(blocker / "kernels"), "--config", "threads=64")
    assert_one_line_error(done, f"cannot write kernels to {blocker / 'kernels'}")


@pytest.mark.parametrize("args, says", [
    (["emit", "layernorm", "--config", "threads=64"], "needs --d"),
    (["emit", "layernorm", "--d", "768", "--config", "threads=100"], "threads-multiple-of-32"),
    (["emit", "layernorm", "--d", "768", "--config", "threads=64", "--arch", "sm_10"], "arch"),
    (["emit", "softmax", "--d", "768", "--config", "threads=64"], "unknown op"),
])
def test_cli_bad_input(tmp_path, args, says):
    assert_one_line_error(mage_gen_cli(*args, cwd=tmp_path), says)
    assert not (tmp_path / "kernels").exists()
