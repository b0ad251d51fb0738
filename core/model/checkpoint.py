"""Reading Hugging Face checkpoint folders: config.json, generation_config.json and safetensors shards.

Every failure names the file and, for tensors, the tensor: a user with a broken download should know
which file to fetch again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pegainfer.errors import CheckpointError
from pegainfer.parallel.sharding import Shard, vocab_shard

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path.name} not found in {path.parent}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    return read_json(folder / "config.json")


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "generation_config.json"
    return read_json(path) if path.exists() else {}


def checkpoint_dtype(hf_config: dict[str, Any]) -> torch.dtype:
    """The dtype the weights were saved in (``dtype`` in transformers >= 5, ``torch_dtype`` before)."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


class CheckpointReader:
    """Finds every tensor of a folder's safetensors files (with or without an index) and reads them on demand.

    Tracks which tensors were read, so a loader can report checkpoint tensors it never consumed. A reader
    for tensor-parallel rank ``rank`` of ``world_size`` reads only that rank's slices of a sharded tensor
    (``get(..., shard=...)``, see ``pegainfer.parallel.sharding``).
    """

    def __init__(self, folder: str | Path, *, rank: int = 0, world_size: int = 1) -> None:
        self.folder = Path(folder)
        self.rank, self.world_size = rank, world_size
        self._where: dict[str, Path] = {}
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map' object")
            for name, file in weight_map.items():
                path = self.folder / file
                if not path.exists():
                    raise CheckpointError(f"{index.name} maps tensor '{name}' to {file}, which is missing")
                self._where[name] = path
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.folder}")
            for path in files:
                for name in self._keys(path):
                    self._where[name] = path
        self._handles: dict[Path, Any] = {}
        self.consumed: set[str] = set()

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from None

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _handle(self, name: str) -> tuple[Any, Path]:
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"tensor '{name}' is missing from the checkpoint in {self.folder}")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt")
        return handle, path

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor ``name`` as stored (read from the file header only)."""
        handle, path = self._handle(name)
        try:
            return tuple(handle.get_slice(name).get_shape())
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor '{name}' from {path.name}: {exc}") from None

    def get(
        self,
        name: str,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        shard: Shard | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` cast to ``dtype``; CheckpointError naming tensor and file if absent or mis-shaped.

        ``shape`` is the full tensor's; with ``shard`` only this reader's rank's part is read and returned
        (see ``pegainfer.parallel.sharding``)."""
        handle, path = self._handle(name)
        try:
            if shard is None:
                tensor = handle.get_tensor(name)
                full = tuple(tensor.shape)
            else:
                view = handle.get_slice(name)
                full = tuple(view.get_shape())
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor '{name}' from {path.name}: {exc}") from None
        if shape is not None and full != tuple(shape):
            raise CheckpointError(f"tensor '{name}' in {path.name} has shape {full}, expected {tuple(shape)}")
        if shard is not None:
            tensor = self._read_shard(name, path, view, full, shard)
        self.consumed.add(name)
        return tensor if dtype is None else tensor.to(dtype)

    def _read_shard(
        self, name: str, path: Path, view: Any, full: tuple[int, ...], shard: Shard
    ) -> torch.Tensor:
        dim = shard.dim % len(full)
        ranges = shard.ranges(full[dim], self.rank, self.world_size, name)
        parts = []
        try:
            for start, stop in ranges:
                index = (slice(None),) * dim + (slice(start, stop),)
                parts.append(view[index])
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor '{name}' from {path.name}: {exc}") from None
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        if shard.padded:
            rows = vocab_shard(full[dim], self.world_size)
            if tensor.shape[dim] < rows:
                pad = list(tensor.shape)
                pad[dim] = rows - tensor.shape[dim]
                tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
        return tensor

    def unused(self) -> list[str]:
        return sorted(set(self._where) - self.consumed)

    def close(self) -> None:
        self._handles.clear()
