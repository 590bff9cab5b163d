"""The adapter store finds ControlNets by name through its index; paths, symlink escapes and
pickle files never get in."""

from __future__ import annotations

import os

import pytest

from backends.core.adapters.store import CONTROLNET_WEIGHTS, AdapterStore, check_name
from backends.core.request.params import InvalidInput


def make_controlnet(root, name, weights=CONTROLNET_WEIGHTS):
    folder = root / "controlnets" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / weights).write_bytes(b"\0" * 16)
    return folder


def test_index_and_lookup(tmp_path):
    make_controlnet(tmp_path, "canny")
    make_controlnet(tmp_path, "depth-v1.1")
    store = AdapterStore(tmp_path)
    assert sorted(store.controlnets) == ["canny", "depth-v1.1"]
    entry = store.controlnet("depth-v1.1")
    assert entry.weights == (tmp_path / "controlnets" / "depth-v1.1" / CONTROLNET_WEIGHTS).resolve()
    assert entry.nbytes == 16


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "", ".hidden", "a" * 200, "x\0y", "..", "c:\\x"])
def test_path_like_names_are_refused_by_name(tmp_path, name):
    make_controlnet(tmp_path, "canny")
    with pytest.raises(InvalidInput, match="controlnets: .* is not a valid adapter name"):
        AdapterStore(tmp_path).controlnet(name)


def test_unknown_name(tmp_path):
    with pytest.raises(InvalidInput, match="controlnets: unknown ControlNet 'nope'"):
        AdapterStore(tmp_path).controlnet("nope")


def test_symlinks_out_of_the_store_are_not_indexed(tmp_path):
    store_root, outside = tmp_path / "store", tmp_path / "outside"
    secret = make_controlnet(outside, "secret")
    (store_root / "controlnets").mkdir(parents=True)
    os.symlink(secret, store_root / "controlnets" / "linked")  # whole folder escapes
    inner = make_controlnet(store_root, "inner")
    (inner / CONTROLNET_WEIGHTS).unlink()
    os.symlink(secret / CONTROLNET_WEIGHTS, inner / CONTROLNET_WEIGHTS)  # one file escapes
    store = AdapterStore(store_root)
    assert store.controlnets == {}
    with pytest.raises(InvalidInput, match="unknown ControlNet 'linked'"):
        store.controlnet("linked")


def test_pickle_only_controlnets_are_not_indexed(tmp_path, caplog):
    make_controlnet(tmp_path, "old", weights="diffusion_pytorch_model.bin")
    store = AdapterStore(tmp_path)
    assert "old" not in store.controlnets
    assert "pickle files are refused" in caplog.text


def test_check_name_accepts_the_documented_alphabet():
    assert check_name("controlnets", "Ab9_.-z") == "Ab9_.-z"


def test_loras_are_indexed_by_file_name_and_pickles_refused(tmp_path, caplog):
    loras = tmp_path / "loras"
    loras.mkdir()
    (loras / "papercut.safetensors").write_bytes(b"\0" * 8)
    (loras / "old.ckpt").write_bytes(b"\0")
    (loras / "old2.bin").write_bytes(b"\0")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.safetensors"
    outside.write_bytes(b"\0")
    os.symlink(outside, loras / "escape.safetensors")
    store = AdapterStore(tmp_path)
    assert sorted(store.loras) == ["papercut"] and store.lora("papercut").nbytes == 8
    assert "pickle files are refused" in caplog.text
    for name, match in (("old", "unknown LoRA 'old'"), ("escape", "unknown LoRA 'escape'"),
                        ("../x", "is not a valid adapter name")):
        with pytest.raises(InvalidInput, match=match):
            store.lora(name)
