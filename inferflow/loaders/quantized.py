"""Reading inferflow's quantized model folders (written by ``inferflow quantize``; layout: quant/saved.py).

The source carries its own spec (the document the model was quantized with), whose tensor-name mapping is the
identity: weights are stored under internal names, quantized ones as the exact blocks load-time quantization
produced, so a reload is bit-identical. Hyper-parameters resolve from the original source's config (kept in the
metadata, or in metadata.gguf for GGUF sources, which also serves the tokenizer).
"""
from __future__ import annotations

import json
from pathlib import Path
import torch

from ..errors import FormatError
from ..quant.packed import PackedTensor
from ..quant.saved import GGUF_METADATA, MARKER, WEIGHTS
from .safetensors import SafetensorsFile, read_header
from .source import WeightSource


def is_quantized_folder(folder: Path) -> bool:
    path = Path(folder) / WEIGHTS
    if not path.is_file():
        return False
    try:
        _, metadata, _ = read_header(str(path))
    except FormatError:
        return False
    return MARKER in (metadata or {})


class QuantizedSource(WeightSource):
    def __init__(self, folder: str | Path):
        from ..spec.loader import Spec

        self.folder = Path(folder)
        self.path = str(self.folder)
        self.file = SafetensorsFile(str(self.folder / WEIGHTS))
        try:
            info = json.loads(self.file.metadata[MARKER])
            self.kind = info["kind"]
            self.packed = {n: (int(d["type"]), tuple(d["shape"])) for n, d in info["tensors"].items()}
            aliases: dict[str, str] = info.get("aliases", {})
            spec_data = info["spec"]
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(str(self.folder / WEIGHTS), f"malformed {MARKER} metadata: {e}") from None
        self.info = info
        if self.kind == "gguf":
            from .gguf import GGUFSource

            self.meta = GGUFSource(self.folder / GGUF_METADATA)
            self.gguf_metadata_path = self.meta.path
            self.config, self.arch, self.config_name = self.meta.config, self.meta.arch, self.meta.path
        else:
            self.config, self.arch = info.get("config") or {}, info.get("arch")
            self.config_name = str(self.folder / WEIGHTS)
        # identity mapping: the stored names are the internal ones; aliases name the tensor stored for them
        mapping = {top: top for top in ("encoder", "decoder", "head")}
        mapping.update(aliases)
        spec_data = {**spec_data, "weights": {self.kind: mapping}}
        self.translated_spec = Spec(name=info.get("spec_name", spec_data.get("name", "?")),
                                    file=str(self.folder / WEIGHTS), data=spec_data)

    def names(self) -> list[str]:
        return list(self.file.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.file.infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self.packed[name][1] if name in self.packed else tuple(self.file.infos[name].shape)

    def get(self, name: str) -> torch.Tensor | PackedTensor:
        t = self.file.get(name)
        if name in self.packed:
            qtype, shape = self.packed[name]
            return PackedTensor(t, qtype, shape)
        return t

    def dtype_of(self, name: str) -> str:
        from ..quant import ggml

        if name in self.packed:
            return ggml.type_name(self.packed[name][0])
        return str(self.file.infos[name].dtype).removeprefix("torch.")

    def nbytes(self, name: str) -> int:
        info = self.file.infos[name]
        return info.end - info.start

    # GGUF sources: the tokenizer reads metadata arrays
    def has_array(self, key: str) -> bool:
        return self.meta.has_array(key) if self.kind == "gguf" else False

    def array(self, key: str) -> list | None:
        return self.meta.array(key) if self.kind == "gguf" else None

    def array_length(self, key: str) -> int | None:
        return self.meta.array_length(key) if self.kind == "gguf" else None

    def mapped(self) -> list:
        """The weights file's mapping, and the GGUF metadata file's."""
        own = [self.file._mm] if getattr(self.file, "_mm", None) is not None and not self.file._mm.closed else []
        meta = getattr(self, "meta", None)
        return own + (meta.mapped() if meta is not None else [])
