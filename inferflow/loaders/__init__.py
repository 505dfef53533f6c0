"""Model-file loaders. Each returns a :class:`~inferflow.loaders.source.WeightSource`."""
from __future__ import annotations

from pathlib import Path

from ..errors import FormatError
from .source import WeightSource


def open_file(path: Path) -> WeightSource:
    """Open a single model file by its content (magic bytes), not only its name."""
    from .hf import HFDirSource

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise FormatError(str(path), f"cannot read: {e}") from None
    if magic == b"GGUF":
        from .gguf import GGUFSource

        return GGUFSource(path)
    if path.suffix == ".safetensors" or path.name in ("config.json", "pytorch_model.bin.index.json"):
        return open_folder(path.parent)
    if magic[:4] == b"PK\x03\x04" or magic[:1] == b"\x80":  # torch.save: zip archive or legacy pickle stream
        return open_torch_file(path)
    from .llama2c import MAGIC, Llama2cSource, looks_like_v0

    if magic == MAGIC.to_bytes(4, "little") or looks_like_v0(path):
        return Llama2cSource.from_bin(path)
    raise FormatError(str(path), "unrecognised model file (supported: safetensors / HF folders, GGUF, torch.save "
                                 ".bin/.pt/.pth, llama2.c .bin)")


def open_folder(folder: Path) -> WeightSource:
    """An HF model folder: safetensors weights, else pickle ``pytorch_model*.bin`` (never unpickled by Python)."""
    from .hf import HFDirSource
    from .pickle_source import PickleSource, pickle_files
    from .quantized import QuantizedSource, is_quantized_folder

    if is_quantized_folder(folder):  # written by `inferflow quantize` (inferflow/quant/saved.py)
        return QuantizedSource(folder)
    if not any(folder.glob("*.safetensors")) and not (folder / "model.safetensors.index.json").is_file() \
            and pickle_files(folder):
        return PickleSource(folder)
    return HFDirSource(folder)


def open_torch_file(path: Path) -> WeightSource:
    """A single torch.save file; a llama2.c training checkpoint ({"model", "model_args"}) becomes llama2c-kind."""
    from .pickle_source import PickleSource

    src = PickleSource(path)
    root = getattr(src, "root", None)
    args = root.get("model_args") if isinstance(root, dict) else None
    if isinstance(args, dict) and {"dim", "n_layers", "n_heads"} <= set(args):
        from .llama2c import Llama2cSource

        return Llama2cSource.from_checkpoint(str(path), args, src.tensors)
    return src
