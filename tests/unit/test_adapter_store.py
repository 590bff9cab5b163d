"""The adapter store finds ControlNets by name through its index; paths, symlink escapes and
pickle files never get in."""

from __future__ import annotations

import os

import pytest

from backends.core.adapters.store import CONTROLNET_WEIGHTS, AdapterStore
from backends.core.request.adapter_inputs import check_name
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


def _lora_store(tmp_path):
    root = tmp_path / "store"
    (root / "loras").mkdir(parents=True)
    (root / "loras" / "mine.safetensors").write_bytes(b"inside")
    (tmp_path / "outside.safetensors").write_bytes(b"outside")
    return root, AdapterStore(root)


def _refused(entry):
    from backends.core.adapters.store import NotInStore

    with pytest.raises(NotInStore) as err:
        entry.file.read_bytes()
    message = str(err.value)
    assert message.startswith("loras: LoRA 'mine'") and "/" not in message  # its name, never a path
    return message


def test_a_file_swapped_for_a_symlink_after_the_scan_is_never_read(tmp_path):
    root, store = _lora_store(tmp_path)
    entry = store.lora("mine")
    assert entry.file.read_bytes() == b"inside"
    (root / "loras" / "mine.safetensors").unlink()
    os.symlink(tmp_path / "outside.safetensors", root / "loras" / "mine.safetensors")
    assert "no longer a file inside the adapter store" in _refused(entry)


def test_a_folder_swapped_for_a_symlink_after_the_scan_is_never_read(tmp_path):
    root, store = _lora_store(tmp_path)
    os.rename(root / "loras", tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "mine.safetensors").write_bytes(b"outside")
    os.symlink(tmp_path / "elsewhere", root / "loras")
    _refused(store.lora("mine"))


def test_a_store_replaced_after_the_scan_is_never_read(tmp_path):
    root, store = _lora_store(tmp_path)
    os.rename(root, tmp_path / "old-store")
    (root / "loras").mkdir(parents=True)
    (root / "loras" / "mine.safetensors").write_bytes(b"planted")
    assert "folder was replaced" in _refused(store.lora("mine"))


def test_a_fifo_or_folder_in_a_files_place_is_refused_without_blocking(tmp_path):
    root, store = _lora_store(tmp_path)
    (root / "loras" / "mine.safetensors").unlink()
    os.mkfifo(root / "loras" / "mine.safetensors")  # opening it for reading would block without O_NONBLOCK
    assert "not a regular file" in _refused(store.lora("mine"))


def test_load_lora_reads_through_the_store_file(tmp_path):
    from backends.core.adapters.lora import load_lora
    from backends.core.adapters.store import NotInStore

    root, store = _lora_store(tmp_path)
    (root / "loras" / "mine.safetensors").unlink()
    os.symlink("/etc/passwd", root / "loras" / "mine.safetensors")
    with pytest.raises(NotInStore):
        load_lora("mine", store.lora("mine").file)
