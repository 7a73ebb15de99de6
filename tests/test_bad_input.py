"""Bad input, as a user meets it through the real command: one line on stderr that says what is wrong and
what to do, exit code 2, no traceback, nothing on stdout, and nothing written or half-written.

Every case runs in its own tmp_path (tuned/, the user data folder and the working folder all inside it)
and compares every file under tmp_path, path and bytes, before and after the command.
"""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from mage_gen.store import save_entry

RECORDING = Path(__file__).parent / "fixtures" / "layernorm_trials_h200_d768_m4096.json"
H200 = "NVIDIA H200"


def environment(tmp_path: Path) -> dict[str, str]:
    # MAGE_GEN_CACHE stays the session's (conftest sets it); CUDA_VISIBLE_DEVICES="" makes a GPU machine act as CI.
    return {**os.environ, "MAGE_GEN_TUNED": str(tmp_path / "tuned"), "XDG_DATA_HOME": str(tmp_path / "data"),
            "CUDA_VISIBLE_DEVICES": ""}


def mage_gen(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mage_gen", *args], capture_output=True, text=True, timeout=300,
                          env=environment(tmp_path), cwd=tmp_path)


def snapshot(root: Path, leave_out: Callable[[Path], bool] = lambda p: False) -> dict[str, bytes | None]:
    """Every file (bytes) and folder (None) under root: a new empty folder counts as written too."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*")) if not leave_out(p)}


# ---- what some cases prepare before the snapshot ----

def tuned_file(tmp_path: Path) -> Path:
    return tmp_path / "tuned" / "h200" / "layernorm.json"


def corrupt_tuned(tmp_path: Path, make_entry) -> None:
    tuned_file(tmp_path).parent.mkdir(parents=True)
    tuned_file(tmp_path).write_text("{not json")


def stale_tuned(tmp_path: Path, make_entry) -> None:
    # A valid entry, except that the kernel it was tuned with is not today's.
    entry = make_entry(source_hash="0123456789abcdef")
    save_entry("layernorm", H200, "d=768/float32/m=4096", entry, directory=tmp_path / "tuned")


def empty_tuned(tmp_path: Path, make_entry) -> None:
    (tmp_path / "tuned").mkdir()


def study_of_d768(tmp_path: Path, make_entry) -> None:
    # Study S of d=768 in its own storage (it also stores and emits a winner: the rerun must leave both alone).
    (tmp_path / "studies").mkdir()
    done = mage_gen(tmp_path, "tune", "layernorm", "--d", "768", "--replay", str(RECORDING), "--trials", "4",
                    "--seed", "1", "--study", "S", "--storage", f"sqlite:///{tmp_path / 'studies' / 's.db'}",
                    "--out", str(tmp_path / "k768"), "--tuned", str(tmp_path / "tuned"))
    assert done.returncode == 0, done.stderr
    assert tuned_file(tmp_path).is_file()


def study_of_another_tool(tmp_path: Path, make_entry) -> None:
    # Study S made with Optuna directly: a trial of its own, and no mage-gen identity.
    (tmp_path / "studies").mkdir()
    study = optuna.create_study(study_name="S", storage=f"sqlite:///{tmp_path / 'studies' / 's.db'}")
    trial = study.ask({"threads": optuna.distributions.CategoricalDistribution(["few", "many"])})
    study.tell(trial, 1.0)


def regular_file(tmp_path: Path, make_entry) -> None:
    (tmp_path / "file").write_text("a regular file, not a folder\n")


def shipped_entry_only(tmp_path: Path, make_entry) -> None:
    """No tuned/ of the user's: the winners shipped with mage-gen (tuned on an H200) are the ones emit finds."""


def report_study_and_a_file(tmp_path: Path, make_entry) -> None:
    study_dir = tmp_path / "store"  # the test made it: SQLITE's folder
    done = mage_gen(tmp_path, "tune", "layernorm", "--d", "768", "--replay", str(RECORDING), "--trials", "2", "--seed",
                    "1", "--storage", f"sqlite:///{study_dir / 's.db'}", "--out", str(tmp_path / "k"))
    assert done.returncode == 0, done.stderr
    regular_file(tmp_path, make_entry)


def not_a_recording(tmp_path: Path, make_entry) -> None:
    (tmp_path / "recording.json").write_text("[]\n")


TUNE_REPLAY = ["tune", "layernorm", "--d", "768", "--replay", str(RECORDING)]
SQLITE = "sqlite:///{tmp}/store/s.db"

# (id, args ({tmp} is tmp_path), setup or None, fragments the one line must hold: the problem, then what to do)
CASES = [
    ("d-zero", ["inspect", "layernorm", "--d", "0"], None, ["d-range", "d=0", "give the row length as --d"]),
    ("d-negative", ["inspect", "layernorm", "--d", "-5"], None, ["d-range", "d=-5", "--d"]),
    ("d-not-a-number", ["inspect", "layernorm", "--d", "abc"], None, ["'--d'", "integer"]),
    ("d-beyond-every-template", ["variants", "layernorm", "--d", str(2**21)], None, ["d-range", "--d"]),
    ("unknown-op", ["inspect", "softmax", "--d", "768"], None, ["unknown op 'softmax'", "known: ", "layernorm"]),
    ("unknown-preset", ["variants", "layernorm", "--d", "768", "--preset", "huge"], None,
     ["unknown preset 'huge'", "use one of quick"]),
    ("infeasible-inspect", ["inspect", "layernorm", "--d", "768", "--config", "threads=100"], None,
     ["threads-multiple-of-32", "must be a multiple of 32"]),
    ("infeasible-emit", ["emit", "layernorm", "--d", "768", "--config", "rows_per_block=4", "-o", "{tmp}/k"], None,
     ["rows-per-block", "use template multirow"]),
    ("arch-inspect", ["inspect", "layernorm", "--d", "768", "--arch", "sm_10"], None,
     ["'sm_10' is not an architecture", "use one of sm_"]),
    ("arch-emit", ["emit", "layernorm", "--d", "768", "--config", "threads=128", "--arch", "sm_10", "-o", "{tmp}/k"],
     None, ["'sm_10' is not an architecture", "use one of sm_"]),
    ("arch-tune", [*TUNE_REPLAY, "--arch", "sm_10", "--storage", SQLITE], None,
     ["'sm_10' is not an architecture", "use one of sm_"]),
    ("corrupt-tuned", ["emit", "layernorm", "--d", "768", "--gpu", H200, "-o", "{tmp}/k"], corrupt_tuned,
     ["is corrupt", "fix it or remove it"]),
    ("stale-tuned", ["emit", "layernorm", "--d", "768", "--gpu", H200, "-o", "{tmp}/k"], stale_tuned,
     ["is stale", "run `mage-gen tune layernorm --d 768 --m 4096`"]),
    ("no-winner", ["emit", "layernorm", "--d", "768", "--gpu", "NVIDIA A100-SXM4-80GB", "-o", "{tmp}/k"], empty_tuned,
     ["no tuned layernorm kernels for NVIDIA A100-SXM4-80GB", "$MAGE_GEN_TUNED",
      "run `mage-gen tune layernorm --d 768`"]),
    ("no-gpu-to-pick-a-winner", ["emit", "layernorm", "--d", "768", "-o", "{tmp}/k"], empty_tuned,
     ["no GPU reachable", "pass --gpu NAME"]),
    ("storage-unreachable", [*TUNE_REPLAY, "--storage", "postgresql://nobody@127.0.0.1:1/none"], None,
     ["cannot open Optuna storage", "give a reachable database URL with --storage"]),
    ("storage-folder-missing", [*TUNE_REPLAY, "--storage", "sqlite:///{tmp}/no/such/folder/s.db"], None,
     ["cannot open Optuna storage", "give a reachable database URL with --storage"]),
    ("study-of-another-shape", ["tune", "layernorm", "--d", "1024", "--replay", str(RECORDING), "--study", "S",
                                "--storage", "sqlite:///{tmp}/studies/s.db", "--out", "{tmp}/k1024"], study_of_d768,
     ["study 'S' belongs to", "'d': 768", "choose another --study name"]),
    ("study-of-another-tool", [*TUNE_REPLAY, "--study", "S", "--storage", "sqlite:///{tmp}/studies/s.db",
                               "--out", "{tmp}/k"], study_of_another_tool,
     ["study 'S' was not made by mage-gen tune", "choose another --study name"]),
    ("replay-missing", ["tune", "layernorm", "--d", "768", "--replay", "{tmp}/none.json", "--storage", SQLITE], None,
     ["none.json", "bench/probes/layernorm_trials.py"]),
    ("replay-not-a-recording", ["tune", "layernorm", "--d", "768", "--replay", "{tmp}/recording.json",
                                "--storage", SQLITE], not_a_recording, ["recording.json", "bench/probes/layernorm_trials.py"]),
    ("tune-without-gpu", ["tune", "layernorm", "--d", "96", "--config", "residual=true"], None,
     ["needs an NVIDIA GPU", "`mage-gen variants layernorm --d 96 --config residual=true` compiles and counts them"]),
    ("config-key-twice", ["inspect", "layernorm", "--d", "768", "--config", "threads=64,threads=128"], None,
     ["threads is given twice (64 and 128)", "give it once"]),
    ("emit-for-an-arch-never-timed", ["emit", "layernorm", "--d", "768", "--gpu", H200, "--arch", "sm_80", "-o",
                                      "{tmp}/k"], shipped_entry_only,
     ["were tuned on NVIDIA H200 (sm_90)", "built for sm_80 they would be kernels nobody timed there",
      "leave --arch out"]),
    ("report-password-hidden", ["report", "layernorm", "--d", "768", "--storage",
                                "postgresql://user:s3cret@127.0.0.1:1/none", "--study", "S", "-o", "{tmp}/r"], None,
     ["cannot open Optuna storage", "***", "give the --storage the tune used"]),
    ("report-out-a-file", ["report", "layernorm", "--d", "768", "--storage", "sqlite:///{tmp}/store/s.db", "-o",
                           "{tmp}/file"], report_study_and_a_file, ["cannot write the report to {tmp}/file", "--out"]),
    ("worker-on-sqlite", ["worker", "--storage", "sqlite:///{tmp}/store/s.db", "--study", "S"], None,
     ["a worker joins a study that the tune and other workers write too", "SQLite", "postgresql://"]),
    ("objective-unknown", [*TUNE_REPLAY, "--objective", "warm", "--storage", SQLITE], None,
     ["objective: use hot, cold, both", "'warm'"]),
    ("config-decimal", ["inspect", "layernorm", "--d", "768", "--config", "threads=128.5"], None,
     ["threads is a whole number", "'128.5'"]),
    ("config-exponent", ["inspect", "layernorm", "--d", "768", "--config", "threads=1e2"], None,
     ["threads is a whole number", "'1e2'"]),
    ("config-word-for-a-number", ["inspect", "layernorm", "--d", "768", "--config", "rows_per_block=two"], None,
     ["rows_per_block is a whole number", "'two'"]),
    ("flag-and-config-disagree", ["inspect", "layernorm", "--d", "768", "--threads", "64", "--config", "threads=128"],
     None, ["--threads 64 and --config threads=128 disagree", "give it once"]),
    ("test-only-switch", ["emit", "matmul", "--m", "64", "--n", "64", "--k", "64", "--config", "plant=offset_units",
                          "-o", "{tmp}/k"], None, ["unknown matmul parameter(s) ['plant']", "known:"]),
    ("arch-the-op-cannot-use", ["inspect", "matmul", "--m", "64", "--n", "64", "--k", "64", "--arch", "sm_75"], None,
     ["matmul needs sm_80 or newer, got sm_75", "choose another --arch"]),
    ("report-storage-missing", ["report", "layernorm", "--d", "768", "--storage", "sqlite:///{tmp}/none.db", "-o",
                                "{tmp}/r"], None, ["sqlite:///{tmp}/none.db does not exist", "give the --storage"]),
    ("report-storage-unreachable", ["report", "layernorm", "--d", "768", "--storage",
                                    "postgresql://nobody@127.0.0.1:1/none", "--study", "S", "-o", "{tmp}/r"], None,
     ["cannot open Optuna storage", "give the --storage the tune used"]),
    ("arch-the-dtype-cannot-use", ["inspect", "layernorm", "--d", "768", "--dtype", "bf16", "--arch", "sm_75"], None,
     ["layernorm d768_bf16 needs sm_80 or newer, got sm_75", "choose another --arch"]),
    ("empty-preset", ["variants", "layernorm", "--d", "1"], None,
     ["no config of preset quick is valid", "try a wider --preset", "full"]),
    ("tune-m-not-sizes", [*TUNE_REPLAY, "--m", "4096,lots", "--storage", SQLITE], None,
     ["--m takes a whole number, several separated by commas, or auto", "'4096,lots'"]),
    ("tune-matmul-several-m", ["tune", "matmul", "--m", "64,128", "--n", "64", "--k", "64"], None,
     ["matmul fixes M when it is generated", "give one --m"]),
    # gemm_sm90's entries are classes over M: several M are several shapes, checked each before a GPU is looked for
    ("tune-gemm-several-m-one-out-of-range", ["tune", "gemm_sm90", "--m", "16,2000000", "--n", "64", "--k", "64"],
     None, ["m-range", "got 2000000"]),
    ("tune-gemm-several-m-one-study", ["tune", "gemm_sm90", "--m", "16,32", "--n", "64", "--k", "64", "--study",
                                       "S"], None, ["one --study name cannot hold several size classes"]),
    ("tune-m-zero", [*TUNE_REPLAY, "--m", "0", "--storage", SQLITE], None, ["m-range", "1.."]),
    ("replay-at-another-m", [*TUNE_REPLAY, "--m", "4096,65536", "--storage", SQLITE], None,
     ["recording was made at {{'m': 4096}}", "give --m to match it"]),
    ("one-study-several-classes", [*TUNE_REPLAY, "--m", "4096,65536", "--study", "S", "--storage", SQLITE], None,
     ["one --study name cannot hold several size classes", "leave --study out"]),
    ("emit-out-unwritable", ["emit", "layernorm", "--d", "768", "--config", "threads=128", "-o", "{tmp}/file/k"],
     regular_file, ["{tmp}/file/k", "--out"]),
    ("tune-out-unwritable", [*TUNE_REPLAY, "--trials", "2", "--seed", "1", "--storage", SQLITE, "--out",
                             "{tmp}/file/k", "--tuned", "{tmp}/tuned"], regular_file, ["{tmp}/file/k", "--out"]),
]


# Cases whose search runs before the error: the study's storage may change (finished trials are kept there),
# the tuned/ file and the kernels may not.
SEARCH_RUNS = {"tune-out-unwritable"}


@pytest.mark.parametrize("case, args, setup, says", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, synthetic_entry, case, args, setup, says):
    storage = tmp_path / "store"  # the folder of SQLITE
    storage.mkdir()
    if setup:
        setup(tmp_path, synthetic_entry)
    leave_out = (lambda p: p == storage or storage in p.parents) if case in SEARCH_RUNS else (lambda p: False)
    before = snapshot(tmp_path, leave_out)
    done = mage_gen(tmp_path, *(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("mage-gen: error: ")
    for fragment in says:
        assert fragment.format(tmp=tmp_path) in lines[0], lines[0]
    assert done.stdout == ""
    after = snapshot(tmp_path, leave_out)
    assert after.keys() == before.keys(), f"written: {sorted(after.keys() - before.keys())}, " \
                                          f"removed: {sorted(before.keys() - after.keys())}"
    changed = [path for path in before if before[path] != after[path]]
    assert not changed, f"changed: {changed}"
    if tuned_file(tmp_path).is_file() and tuned_file(tmp_path).read_text() != "{not json":
        json.loads(tuned_file(tmp_path).read_text())  # a prepared tuned/ file is still whole
