"""HF-layout model folders: config.json plus model.safetensors or index-sharded safetensors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError
from .safetensors import SafetensorsFile
from .source import WeightSource


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, UTF-8 or over-long integers
        raise FormatError(str(path), f"cannot read JSON: {e}") from None


class HFDirSource(WeightSource):
    """Weights of an HF model folder, memory-mapped from its safetensors files."""

    kind = "hf"

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = str(self.folder)
        cfg = self.folder / "config.json"
        self.config = read_json(cfg) if cfg.is_file() else {}
        if not isinstance(self.config, dict):
            raise FormatError(str(cfg), "config.json must hold a JSON object")
        self.config_name = str(cfg)
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise FormatError(str(index), "expected a 'weight_map' object of tensor -> shard file")
            shard_names = sorted(set(weight_map.values()))
        else:
            shard_names = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not shard_names:
            raise FormatError(self.path, "no *.safetensors weights found (pickle and other formats: see docs/formats.md)")
        for shard in shard_names:
            p = self.folder / shard
            if ("\0" in shard or len(shard) > 255  # is_file would raise
                    or not p.is_file() or p.parent.resolve() != self.folder.resolve()):
                raise FormatError(str(index), f"shard {shard!r} missing or outside the model folder")
            f = self.files[shard] = SafetensorsFile(str(p))
            for name in f.infos:
                self.where.setdefault(name, shard)

    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[name]].infos[name].shape

    def get(self, name: str) -> torch.Tensor:
        return self.files[self.where[name]].get(name)

    def file_of(self, name: str) -> str:
        return str(self.folder / self.where[name]) if name in self.where else self.path

    def dtype_of(self, name: str) -> str:
        return str(self.files[self.where[name]].infos[name].dtype).removeprefix("torch.")

    def nbytes(self, name: str) -> int:
        info = self.files[self.where[name]].infos[name]
        return info.end - info.start
