"""tuned/: winners saved and read back, corrupt and stale files refused, writes never half-done."""

import json
import os
from pathlib import Path

import pytest

from mage_gen import store
from mage_gen.errors import MageError, StoreError
from mage_gen.ops import get_op
from mage_gen.ops.layernorm import Params
from mage_gen.store import REQUIRED_KEYS, gpu_slug, load_entry, load_winner, save_entry, store_file, tuned_dir

OP = get_op("layernorm")
H200 = "NVIDIA H200"
KEY = "d=768/float32"


def leftovers(folder):
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".tmp"))


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
    ("  Tesla  V100 ", "tesla-v100"),
])
def test_gpu_slug(name, slug):
    assert gpu_slug(name) == slug


def test_gpu_slug_refuses_a_name_with_nothing_left():
    with pytest.raises(MageError, match="cannot name"):
        gpu_slug("NVIDIA GeForce")


def test_tuned_dir_follows_env_then_cwd(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGE_GEN_TUNED", str(tmp_path / "elsewhere"))
    assert tuned_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("MAGE_GEN_TUNED")
    monkeypatch.chdir(tmp_path)
    assert tuned_dir() == tmp_path / "tuned"


def test_round_trip(tmp_path, synthetic_entry):
    entry = synthetic_entry()
    path = save_entry("layernorm", H200, KEY, entry, directory=tmp_path)
    assert path == tmp_path / "h200" / "layernorm.json"
    assert load_entry("layernorm", H200, KEY, directory=tmp_path) == json.loads(json.dumps(entry))
    doc = json.loads(path.read_text())
    assert doc["format"] == 3 and doc["op"] == "layernorm" and doc["gpu"] == H200 and list(doc["entries"]) == [KEY]
    # readable diffs: sorted keys, two-space indent
    assert path.read_text() == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    assert leftovers(tmp_path) == []


def test_env_chooses_the_folder(tmp_path, monkeypatch, synthetic_entry):
    monkeypatch.setenv("MAGE_GEN_TUNED", str(tmp_path))
    save_entry("layernorm", H200, KEY, synthetic_entry())
    assert (tmp_path / "h200" / "layernorm.json").is_file()
    assert load_entry("layernorm", H200, KEY)["kernel"] == "layernorm_row_d768_t128_v4_r1_approx_nc"


def test_saving_one_shape_keeps_the_others(tmp_path, synthetic_entry):
    save_entry("layernorm", H200, KEY, synthetic_entry(), directory=tmp_path)
    other = synthetic_entry(d=1024, params={"template": "multirow", "threads": 32, "rows_per_block": 4})
    save_entry("layernorm", H200, "d=1024/float32", other, directory=tmp_path)
    replaced = synthetic_entry(objective="cold")
    save_entry("layernorm", H200, KEY, replaced, directory=tmp_path)
    assert load_entry("layernorm", H200, "d=1024/float32", directory=tmp_path) == json.loads(json.dumps(other))
    assert load_entry("layernorm", H200, KEY, directory=tmp_path)["objective"] == "cold"
    # another GPU is another file
    save_entry("layernorm", "NVIDIA GeForce RTX 4090", KEY, synthetic_entry(), directory=tmp_path)
    assert sorted(p.parent.name for p in tmp_path.rglob("*.json")) == ["h200", "rtx-4090"]


@pytest.mark.parametrize("content, says", [
    ("{ not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"format": 4, "op": "layernorm", "entries": {}}', "format 4"),
    ('{"format": 1, "op": "softmax", "entries": {}}', "op 'softmax'"),
    ('{"format": 1, "op": "layernorm", "entries": []}', "'entries' is not an object"),
])
def test_corrupt_file_is_refused_and_left_byte_identical(tmp_path, synthetic_entry, content, says):
    path = store_file("layernorm", H200, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    before = path.read_bytes()
    with pytest.raises(StoreError) as saving:
        save_entry("layernorm", H200, KEY, synthetic_entry(), directory=tmp_path)
    with pytest.raises(StoreError) as loading:
        load_entry("layernorm", H200, KEY, directory=tmp_path)
    for raised in (saving.value, loading.value):
        message = str(raised)
        assert str(path) in message and says in message and "fix it or remove it" in message
        assert "\n" not in message
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_missing_file_says_how_to_make_it(tmp_path):
    with pytest.raises(StoreError) as raised:
        load_entry("layernorm", H200, KEY, directory=tmp_path)
    message = str(raised.value)
    assert str(store_file("layernorm", H200, tmp_path)) in message
    assert "mage-gen tune layernorm --d 768" in message and "--config" in message and "\n" not in message


def test_missing_entry_names_the_file_and_what_it_has(tmp_path, synthetic_entry):
    save_entry("layernorm", H200, "d=1024/float32", synthetic_entry(d=1024), directory=tmp_path)
    with pytest.raises(StoreError) as raised:
        load_entry("layernorm", H200, KEY, directory=tmp_path)
    message = str(raised.value)
    assert str(store_file("layernorm", H200, tmp_path)) in message
    assert "no entry for d=768/float32" in message and "d=1024/float32" in message
    assert "mage-gen tune layernorm --d 768" in message


def test_stale_entry_is_refused_only_when_asked(tmp_path, synthetic_entry):
    save_entry("layernorm", H200, KEY, synthetic_entry(source_hash="0123456789abcdef"), directory=tmp_path)
    current = OP.source(OP.shape(d=768), Params(template="row", threads=128, vector=16))
    assert load_entry("layernorm", H200, KEY, directory=tmp_path)["source_hash"] == "0123456789abcdef"
    with pytest.raises(StoreError, match="its kernel has changed since it was tuned") as raised:
        load_entry("layernorm", H200, KEY, current=current, directory=tmp_path)
    assert "0123456789abcdef" in str(raised.value) and current.source_hash in str(raised.value)
    assert "mage-gen tune layernorm --d 768" in str(raised.value)


def test_a_template_edit_that_leaves_a_kernel_as_it_was_keeps_its_winner(tmp_path, synthetic_entry):
    # the template files hash differently, the text the winner's params render to is the same
    entry = synthetic_entry(template_hash="0123456789abcdef")
    save_entry("layernorm", H200, KEY, entry, directory=tmp_path)
    assert load_winner(OP, OP.shape(d=768), H200, directory=tmp_path).entry["template_hash"] == "0123456789abcdef"


@pytest.mark.parametrize("template_hash, stale", [("0123456789abcdef", True), (None, False)])
def test_an_entry_without_a_source_hash_is_judged_by_its_template_files(tmp_path, synthetic_entry,
                                                                        template_hash, stale):
    entry = synthetic_entry()
    del entry["source_hash"]
    entry["template_hash"] = template_hash or entry["template_hash"]
    save_entry("layernorm", H200, KEY, entry, directory=tmp_path)
    if stale:
        with pytest.raises(StoreError, match="template hash 0123456789abcdef"):
            load_winner(OP, OP.shape(d=768), H200, directory=tmp_path)
    else:
        assert load_winner(OP, OP.shape(d=768), H200, directory=tmp_path).key == KEY


def test_load_winner_rebuilds_params_and_checks_the_templates(tmp_path, synthetic_entry):
    params = {"template": "multirow", "threads": 64, "rows_per_block": 2, "hint": "stream"}
    save_entry("layernorm", H200, KEY, synthetic_entry(params=params), directory=tmp_path)
    winner = load_winner(OP, OP.shape(d=768), H200, directory=tmp_path)
    assert winner.params == Params(template="multirow", threads=64, rows_per_block=2, hint="stream")
    assert winner.path == store_file("layernorm", H200, tmp_path)
    save_entry("layernorm", H200, KEY, synthetic_entry(params=params, source_hash="stale"), directory=tmp_path)
    with pytest.raises(StoreError, match="its kernel has changed"):
        load_winner(OP, OP.shape(d=768), H200, directory=tmp_path)


def test_params_the_op_no_longer_accepts_are_a_store_error(tmp_path, synthetic_entry):
    entry = synthetic_entry()
    entry["params"]["threads"] = 100
    save_entry("layernorm", H200, KEY, entry, directory=tmp_path)
    with pytest.raises(StoreError, match="threads-multiple-of-32") as raised:
        load_winner(OP, OP.shape(d=768), H200, directory=tmp_path)
    assert str(store_file("layernorm", H200, tmp_path)) in str(raised.value)


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_entry_without_a_required_key_is_not_saved(tmp_path, synthetic_entry, key):
    entry = synthetic_entry()
    del entry[key]
    with pytest.raises(StoreError, match=f"lacks required key.*{key}"):
        save_entry("layernorm", H200, KEY, entry, directory=tmp_path)
    assert not store_file("layernorm", H200, tmp_path).exists()


@pytest.mark.parametrize("damage, says", [
    (lambda e: e.pop("date"), "lacks required key(s) date"),
    (lambda e: e["gpu"].pop("l2_bytes"), "lacks gpu key(s) l2_bytes"),
    (lambda e: e["timings"].pop("cold"), "no usable cold timing"),
    (lambda e: e["timings"]["hot"].pop("median_us"), "no usable hot timing"),
    (lambda e: e.update(peers=[]), "non-object peers"),
    (lambda e: e.update(date="yesterday"), "not an ISO 8601 string"),
])
def test_hand_damaged_entry_is_refused_on_load(tmp_path, synthetic_entry, damage, says):
    path = save_entry("layernorm", H200, KEY, synthetic_entry(), directory=tmp_path)
    doc = json.loads(path.read_text())
    damage(doc["entries"][KEY])
    path.write_text(json.dumps(doc))
    with pytest.raises(StoreError) as raised:
        load_entry("layernorm", H200, KEY, directory=tmp_path)
    message = str(raised.value)
    assert says in message and str(path) in message and "mage-gen tune layernorm --d 768" in message


def test_failed_replace_leaves_the_old_file_and_no_scratch(tmp_path, synthetic_entry, monkeypatch):
    path = save_entry("layernorm", H200, KEY, synthetic_entry(), directory=tmp_path)
    before = path.read_bytes()

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(StoreError, match="cannot write .*No space left on device"):
        save_entry("layernorm", H200, "d=1024/float32", synthetic_entry(d=1024), directory=tmp_path)
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in path.parent.iterdir()) == ["layernorm.json"]


def test_entry_json_cannot_hold_leaves_the_old_file(tmp_path, synthetic_entry):
    path = save_entry("layernorm", H200, KEY, synthetic_entry(), directory=tmp_path)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        save_entry("layernorm", H200, "d=1024/float32", synthetic_entry(d=1024, objective=object()),
                   directory=tmp_path)
    assert path.read_bytes() == before and leftovers(tmp_path) == []


def test_write_atomic_replaces_with_the_umask_mode(tmp_path):
    target = tmp_path / "f.json"
    target.write_text("old")
    umask = os.umask(0o022)
    try:
        store.write_atomic(target, b"new")
    finally:
        os.umask(umask)
    assert target.read_bytes() == b"new"
    assert target.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_every_committed_winner_renders_to_the_kernel_it_was_tuned_with():
    # A change to a template or an op module that alters a committed winner's kernel makes it stale: the
    # runtime would then run default configs.
    for path in sorted((Path(__file__).parent.parent / "tuned").glob("*/*.json")):
        doc = json.loads(path.read_text())
        op = get_op(doc["op"])
        stale = [key for key, e in doc["entries"].items()
                 if "source_hash" not in e or not store.is_current(e, op.source(op.shape(**e["shape"]),
                                                                               op.params_from_dict(e["params"])))]
        assert not stale, f"{path}: {stale} were tuned with kernels that have changed since; re-tune them"


def test_a_missing_entry_names_the_others_in_their_numbers_order_and_says_how_many_more(tmp_path, synthetic_entry):
    for d in (96, 768, 1024, 128, 4096, 512, 2048, 8192, 16384, 64):
        save_entry("layernorm", "NVIDIA H200", f"d={d}", synthetic_entry(), directory=tmp_path)
    with pytest.raises(StoreError) as caught:
        load_entry("layernorm", "NVIDIA H200", "d=100", directory=tmp_path)
    assert "it has 10 entries: d=64, d=96, d=128, d=512, d=768, d=1024, d=2048, d=4096, and 2 more" in str(caught.value)
