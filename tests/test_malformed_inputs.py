"""Malformed model files are one line each (UserError), never another tensor's bytes or a read outside the folder."""
import json
import os
import struct

import numpy as np
import pytest

from omnijax.errors import UserError
from omnijax.interop import bundle
from omnijax.interop.tensors import TensorIndex, read_header, write_file


def _raw_file(path, header: dict, data: bytes) -> None:
    """A safetensors file with exactly this header (the writer would refuse a wrong one)."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


A, B = np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(100, 104, dtype=np.float32)


def _good(folder):
    folder.mkdir()
    write_file(folder / "model.safetensors", [("a", A.shape, A.dtype), ("b", B.shape, B.dtype)], iter([A, B]))
    return folder


def test_a_good_file_reads_back(tmp_path):
    index = TensorIndex(_good(tmp_path / "ok"))
    assert np.array_equal(index.read("a"), A) and np.array_equal(index.read("b"), B)
    assert np.array_equal(index.read("a", (1, 2)), A[1:2])


@pytest.mark.parametrize("entry, match", [
    # 24 bytes placed over b's bytes: read as `a`, b's values came back
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [16, 40]}, r"tensors 'a' and 'b' claim the same bytes"),
    # fewer bytes than shape x dtype: the rest of `a` is read from b
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}, r"tensor 'a' claims bytes \[0, 16\).*is 24 bytes"),
    # a range longer than shape x dtype (the next tensor's bytes counted in)
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 40]}, r"claims bytes \[0, 40\).*is 24 bytes"),
    # past the end of the file
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [32, 56]}, r"claims bytes \[32, 56\) of the file's 40"),
    ({"dtype": "F32", "shape": [2, 3]}, r"tensor 'a' has a malformed header entry \(no data_offsets\)"),
    ({"dtype": "F32", "data_offsets": [0, 24]}, r"malformed header entry \(no shape\)"),
    ({"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 24]}, r"malformed header entry \(shape \[2, -3\]"),
    ("F32", r"malformed header entry"),
])
def test_header_entries_that_disagree_are_one_line(tmp_path, entry, match):
    folder = tmp_path / "bad"
    folder.mkdir()
    data = A.tobytes() + B.tobytes()  # 24 + 16 bytes
    _raw_file(folder / "model.safetensors",
              {"a": entry, "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}, data)
    with pytest.raises(UserError, match=match):
        read_header(folder / "model.safetensors")
    with pytest.raises(UserError, match=match):
        TensorIndex(folder)


def test_a_missing_tensor_is_one_line(tmp_path):
    index = TensorIndex(_good(tmp_path / "ok"))
    for call in (lambda: index.read("model.embed_tokens.weight"), lambda: index.info("c")):
        with pytest.raises(UserError, match=r"no tensor '(model.embed_tokens.weight|c)' in model.safetensors"):
            call()


def test_an_index_naming_files_outside_the_folder_is_one_line(tmp_path):
    outside = _good(tmp_path / "elsewhere") / "model.safetensors"
    folder = tmp_path / "llm"
    folder.mkdir()
    for where in (str(outside), "../elsewhere/model.safetensors"):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": where}}))
        with pytest.raises(UserError, match="not a file of this folder"):
            TensorIndex(folder)


def _manifest(folder, **changes) -> None:
    m = {"format": bundle.FORMAT, "model": {}, "tokenizer": "llm",
         "parts": {"llm": {"folder": "llm", "format": "hf"}, "encoders.vision": {"folder": "encoders/vision"}}}
    m.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del m[key]
    folder.mkdir(exist_ok=True)
    (folder / bundle.MANIFEST).write_text(json.dumps(m))


def test_bundle_manifests_that_leave_the_folder_or_lack_parts_are_one_line(tmp_path):
    out = tmp_path / "export"
    _manifest(out)
    assert bundle.read_manifest(out)["parts"]["llm"]["folder"] == "llm"   # the well-formed one reads
    secret = tmp_path / "secret"
    secret.mkdir()
    os.symlink(secret, out / "link")
    cases = [
        ({"parts": {"llm": {"folder": "llm"}, "encoders.vision": {"folder": str(secret)}}},
         r"parts.encoders.vision.folder='/.*secret' points outside the export folder"),
        ({"parts": {"llm": {"folder": "../secret"}}}, r"parts.llm.folder='../secret' points outside"),
        ({"parts": {"llm": {"folder": "link"}}}, r"parts.llm.folder='link' points outside"),   # a link out of it
        ({"tokenizer": str(secret)}, r"tokenizer='/.*secret' points outside"),
        ({"tokenizer": "../secret"}, r"tokenizer='../secret' points outside"),
        ({"parts": None}, r"no 'parts' mapping"),
        ({"model": None}, r"no 'model' mapping"),
        ({"parts": {"llm": {"format": "hf"}}}, r"parts.llm has no folder"),
    ]
    for changes, match in cases:
        _manifest(out, **changes)
        with pytest.raises(UserError, match=match):
            bundle.read_manifest(out)
        with pytest.raises(UserError, match=match):   # what `recipes generate DIR` calls first
            bundle.read_bundle(out)
    (out / bundle.MANIFEST).write_text("[1, 2]")
    with pytest.raises(UserError, match="not an export manifest"):
        bundle.read_manifest(out)
