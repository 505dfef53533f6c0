"""PyTorch pickle checkpoints (``pytorch_model.bin``, sharded ``.bin`` + index, single ``.pt``/``.pth``) as a
WeightSource, read with our own pickle interpreter: nothing in the file is imported or executed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError
from .hf import read_json
from .source import WeightSource
from .torch_file import TensorRef, TorchFile

INDEX = "pytorch_model.bin.index.json"
# Where training scripts nest the weights: {"model": state_dict, "optimizer": ..., "model_args": ...}
STATE_KEYS = ("state_dict", "model_state_dict", "model", "module", "ema")
MAX_NESTING = 8


def pickle_files(folder: Path) -> list[str]:
    """Shard names of an HF folder's pickle weights (empty when it has none)."""
    index = folder / INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise FormatError(str(index), "expected a 'weight_map' object of tensor -> shard file")
        return sorted(set(weight_map.values()))
    return sorted(p.name for p in folder.glob("pytorch_model*.bin"))


def _flatten(obj: Any, prefix: str, out: dict[str, TensorRef], depth: int = 0, seen: set[int] | None = None) -> None:
    if isinstance(obj, TensorRef):
        out[prefix] = obj
    elif isinstance(obj, dict) and depth < MAX_NESTING:
        # each dict is walked once: a pickle's memo can make a dict hold itself (or one shared dict) under many
        # keys, and walking every path would take keys ** MAX_NESTING steps
        seen = set() if seen is None else seen
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for k, v in obj.items():
            if isinstance(k, (str, int)) and not isinstance(k, bool):
                _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1, seen)


def state_dict(root: Any) -> dict[str, TensorRef]:
    """The tensors of a checkpoint: those under a well-known key ("model", "state_dict", ...) when one holds
    tensors (training checkpoints also carry optimizer state), else every tensor of the root and its nested
    dicts under dotted names."""
    if not isinstance(root, dict):
        raise FormatError(None, f"checkpoint root is a {type(root).__name__}, expected a dict of tensors")
    for key in STATE_KEYS:
        sub = root.get(key)
        if isinstance(sub, dict) and any(isinstance(v, TensorRef) for v in sub.values()):
            root = sub
            break
    out: dict[str, TensorRef] = {}
    _flatten(root, "", out)
    out = {k.replace("_orig_mod.", ""): v for k, v in out.items()}  # torch.compile wrapper prefix
    if out and all(k.startswith("module.") for k in out):  # DistributedDataParallel wrapper
        out = {k[len("module."):]: v for k, v in out.items()}
    return out


class PickleSource(WeightSource):
    """Weights of torch.save files: a folder (``pytorch_model.bin`` or shards + index) or one file."""

    kind = "hf"

    def __init__(self, path: str | Path):
        p = Path(path)
        self.path = str(p)
        folder = p if p.is_dir() else p.parent
        shards = pickle_files(p) if p.is_dir() else [p.name]
        if not shards:
            raise FormatError(self.path, f"no pytorch_model*.bin or {INDEX} found")
        cfg = folder / "config.json"
        self.config = read_json(cfg) if cfg.is_file() else {}
        if not isinstance(self.config, dict):
            raise FormatError(str(cfg), "config.json must hold a JSON object")
        self.config_name = str(cfg)
        self.files: dict[str, TorchFile] = {}
        self.tensors: dict[str, TensorRef] = {}
        self.where: dict[str, str] = {}
        for shard in shards:
            f = folder / shard
            if "\0" in shard or len(shard) > 255 or not f.is_file() or f.parent.resolve() != folder.resolve():
                raise FormatError(self.path, f"shard {shard!r} missing or outside the model folder")
            tf = self.files[shard] = TorchFile(f)
            try:
                tensors = state_dict(tf.obj)
            except FormatError as e:
                raise FormatError(str(f), e.problem) from None
            for name, ref in tensors.items():
                if name not in self.tensors:
                    self.tensors[name], self.where[name] = ref, shard
        if len(self.files) == 1:
            self.root = next(iter(self.files.values())).obj  # the whole unpickled checkpoint (model_args, ...)

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].size

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name].load()

    def file_of(self, name: str) -> str:
        return str(Path(self.files[self.where[name]].path)) if name in self.where else self.path

    def dtype_of(self, name: str) -> str:
        return str(self.tensors[name].dtype).removeprefix("torch.")

    def nbytes(self, name: str) -> int:
        ref, n = self.tensors[name], 1
        for s in ref.size:
            n *= s
        return n * ref.dtype.itemsize
