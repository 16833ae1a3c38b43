"""The writer: a parameter state as Hugging Face safetensors files under a layout table's names, shapes and dtypes,
every process taking part in each tensor's gather and process 0 writing; split into
model-0000i-of-0000n.safetensors files with an index beyond MAX_FILE_BYTES, as transformers does."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from omnijax.errors import UserError
from omnijax.interop.gather import gather
from omnijax.interop.layout import Tensor, to_hf
from omnijax.interop.stacked import flat_params, param_dtype
from omnijax.interop.tensors import TensorIndex, write_file

MAX_FILE_BYTES = 5 << 30  # exports split into model-0000i-of-0000n.safetensors beyond this (as transformers)


def _grouped(tensors: list[Tensor]) -> list[tuple[str, list[Tensor]]]:
    groups: dict[str, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.hf, []).append(t)
    return list(groups.items())


def _hf_arrays(groups: list[tuple[str, list[Tensor]]], params: dict[tuple, Any],
               dtypes: dict[str, np.dtype]) -> Iterator[np.ndarray]:
    for name, parts in groups:
        if len(parts) == 1 and parts[0].offset == 0:
            yield np.asarray(to_hf(parts[0], gather(params[parts[0].path])), dtypes[name])
            continue
        out = np.zeros(parts[0].hf_shape, dtypes[name])
        for t in parts:
            rows = to_hf(t, gather(params[t.path]))
            out[t.offset:t.offset + rows.shape[0]] = rows
        yield out


def write_weights(folder: Path, tensors: list[Tensor], params: Any, like: TensorIndex | None,
                   write: bool) -> None:
    """safetensors files (+ index when several) of `tensors`, every process gathering, process 0 writing."""
    flat = flat_params(params)
    missing = [t for t in tensors if t.path not in flat]
    if missing:
        raise UserError(f"parameters lack {'/'.join(map(str, missing[0].path))} (for {missing[0].hf}); "
                        "they do not match the config being exported")
    groups = _grouped(tensors)
    dtypes = {}
    for name, parts in groups:
        if like is not None and name in like:
            dtypes[name] = like.info(name).dtype
        else:
            dtypes[name] = np.dtype(param_dtype(flat[parts[0].path]))
    sizes = {name: math.prod(parts[0].hf_shape) * dtypes[name].itemsize for name, parts in groups}
    files: list[list[tuple[str, list[Tensor]]]] = [[]]
    used = 0
    for g in groups:
        if files[-1] and used + sizes[g[0]] > MAX_FILE_BYTES:
            files.append([])
            used = 0
        files[-1].append(g)
        used += sizes[g[0]]
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for fname, part in zip(names, files):
        arrays = _hf_arrays(part, flat, dtypes)
        header = [(name, parts[0].hf_shape, dtypes[name]) for name, parts in part]
        if write:
            write_file(folder / fname, header, arrays)
        else:
            for _ in arrays:  # every process takes part in each gather
                pass
    if write and len(files) > 1:
        index = {"metadata": {"total_size": int(sum(sizes.values()))},
                 "weight_map": {name: fname for fname, part in zip(names, files) for name, _ in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def dump_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
