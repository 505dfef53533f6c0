"""Inferflow ``model_spec.json`` files, translated to one of our shipped specs.

Inferflow describes a model by structure flags (``network_structure``: type, normalization, activation, position
embedding, ...) and renames the file's tensors to its standard names (``tensor_name_mapping``). The translation
table (``inferflow_compat.yaml``, data only) says which shipped spec each combination of flags is and how the
standard names map onto that spec's modules. So an Inferflow user brings the spec unchanged::

    inferflow.load("models/my_model/model_spec.json")          # weights from its model_files
    inferflow.load("models/my_model", spec="models/my_model/model_spec.json")

Anything the translation cannot honour (a flag value no shipped spec has, a standard name the chosen spec has no
module for, a file format we do not read) is refused with the file and the key.
"""
from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from ..errors import SpecError
from ..loaders.source import WeightSource
from .loader import Spec, load_spec, validate

TABLE = Path(__file__).with_name("inferflow_compat.yaml")
_HF_FORMATS = ("safetensors", "pickle", "std")   # read from the model folder (config.json + weights)
_FILE_FORMATS = ("gguf", "llama2.c")             # one self-describing file
_SUFFIXES = ("weight", "bias")
_MAX_BYTES = 4 << 20
_CHECKED = ("qk_column_order", "tensor_name_pre_mapping")  # refused or allowed by translate(), per file format


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return yaml.safe_load(TABLE.read_text(encoding="utf-8"))


def read_inferflow_spec(path: str | Path) -> dict[str, Any] | None:
    """The JSON object of an Inferflow model spec; None when ``path`` is not one (no ``network_structure``).
    Leading ``#`` lines are a comment header, as Inferflow allows."""
    p = Path(path)
    try:
        if p.suffix != ".json" or not p.is_file() or p.stat().st_size > _MAX_BYTES:
            return None
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    while lines and lines[0].lstrip().startswith("#"):
        lines.pop(0)
    try:
        doc = json.loads("\n".join(lines))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, absurd nesting
        if "network_structure" in "\n".join(lines):
            raise SpecError(str(p), None, f"invalid JSON: {e}") from None
        return None
    if not isinstance(doc, dict) or "network_structure" not in doc:
        return None
    if not isinstance(doc["network_structure"], dict):
        raise SpecError(str(p), "network_structure", "expected a JSON object")
    return doc


def open_model(path: str | Path) -> WeightSource:
    """Open the weights a model_spec.json names; the translated spec rides along as ``source.translated_spec``."""
    p = Path(path)
    doc = read_inferflow_spec(p)
    if doc is None:
        raise SpecError(str(p), None, "not an Inferflow model spec (a JSON object with 'network_structure')")
    src = _open_weights(doc, p)
    src.translated_spec = translate(doc, p, src)
    return src


def _open_weights(doc: dict, path: Path) -> WeightSource:
    from ..loaders import open_file, open_folder

    file, folder = str(path), path.parent
    fmt = doc.get("model_file_format")
    if fmt not in _HF_FORMATS + _FILE_FORMATS:
        raise SpecError(file, "model_file_format", f"{fmt!r} is not supported (supported: "
                                                   f"{', '.join(_HF_FORMATS + _FILE_FORMATS)}; legacy ggml files: "
                                                   f"convert them to GGUF with llama.cpp)")
    files = doc.get("model_files")
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
        raise SpecError(file, "model_files", "expected a non-empty list of file names")
    for n, f in enumerate(files):
        if "\0" in f or len(f) > 255 or not (folder / f).is_file():  # else is_file raises
            raise SpecError(file, f"model_files[{n}]", f"{f!r} not found in {folder}")
    config = doc.get("config_file", "")
    if fmt in _FILE_FORMATS:
        if config:
            raise SpecError(file, "config_file", f"{fmt} files carry their own hyper-parameters; expected \"\"")
        return open_file(folder / files[0])
    if config != "config.json":
        raise SpecError(file, "config_file", f"{config!r}: the hyper-parameters are read from the model folder's "
                                             f"config.json")
    if not (folder / config).is_file():
        raise SpecError(file, "config_file", f"config.json not found in {folder}")
    return open_folder(folder)


def _structure(ns: dict, file: str) -> dict[str, Any]:
    """The flags of ``network_structure`` with the type's implied values and the defaults filled in."""
    t = _table()
    kind = ns.get("type")
    if not isinstance(kind, str) or kind not in t["types"]:
        raise SpecError(file, "network_structure.type", f"{kind!r} is not an Inferflow network type (known: "
                                                        f"{', '.join(t['types'])})")
    known = set(t["defaults"]) | set(t["informational"])
    for key in ns:
        if key not in known and not key.lower().startswith("comment"):
            raise SpecError(file, f"network_structure.{key}", f"not an Inferflow network_structure key (known: "
                                                              f"{', '.join(sorted(known))})")
    out = {**t["defaults"], **t["types"][kind], **{k: v for k, v in ns.items() if k in t["defaults"]}}
    for key, value in out.items():  # flags are names or numbers: a list or object would not even compare
        if isinstance(value, (list, dict)) and not isinstance(t["defaults"].get(key), dict):
            raise SpecError(file, f"network_structure.{key}", f"expected a name or a number, got {value!r:.80}")
    pos = out["position_embedding"]
    out["position_embedding"] = t["position_aliases"].get(pos, pos)
    return out


def _pick(structure: dict, file: str, src: WeightSource) -> dict:
    """The table row for these flags: among the rows that fit, the spec the model's own config selects."""
    t = _table()
    fitting, refused = [], None
    for row in t["specs"]:
        if any(structure.get(k) != v for k, v in row["when"].items()):
            continue
        handled = set(row["when"]) | set(row.get("accepts", ()))
        odd = [k for k, v in structure.items()
               if k not in handled and k not in _CHECKED and v != t["defaults"].get(k)]
        if odd:
            refused = refused or (row["spec"], odd[0])
            continue
        fitting.append(row)
    if not fitting:
        if refused:
            spec, key = refused
            raise SpecError(file, f"network_structure.{key}", f"{structure[key]!r} is not supported (spec {spec!r} "
                                                              f"fits the other flags but not this one)")
        shown = {k: structure[k] for k in ("architecture", "normalization_function", "activation_function",
                                           "position_embedding") if k in structure}
        raise SpecError(file, "network_structure", f"no shipped spec has this structure: {shown}")
    if len(fitting) > 1:
        from ..model.detect import match_spec

        try:
            own = match_spec(src).name
        except SpecError:
            own = None
        for row in fitting:
            if row["spec"] == own:
                return row
    return fitting[0]


def _own_entry(own: dict, module: str, full: str) -> tuple[Any, str] | None:
    """The spec's own template for a module path (exact key or the longest textual prefix) and the suffix the
    weight loader would append to it."""
    if full in own:
        return own[full], ""
    best = max((k for k in own if module == k or module.startswith(k + ".")), key=len, default=None)
    return (own[best], module[len(best):] + full[len(module):]) if best is not None else None


def _with_suffix(entry: Any, suffix: str) -> list:
    """A spec template as a list of alternatives with ``suffix`` appended to each tensor name."""
    alts = entry if isinstance(entry, list) else [entry]
    out = []
    for a in alts:
        if isinstance(a, str):
            out.append({"name": a + suffix})
        elif isinstance(a, dict) and "name" in a:
            out.append({**a, "name": a["name"] + suffix})
    return out


def _names(ns: dict, row: dict, own: dict, file: str) -> dict[str, Any]:
    """tensor_name_mapping (source -> standard name) as templates of the chosen spec (module path -> source)."""
    mapping = ns.get("tensor_name_mapping") or {}
    if not isinstance(mapping, dict):
        raise SpecError(file, "network_structure.tensor_name_mapping", "expected a JSON object")
    prefix = ns.get("tensor_name_prefix") or ""
    if not isinstance(prefix, str):
        raise SpecError(file, "network_structure.tensor_name_prefix", f"expected a string, got {prefix!r:.80}")
    layout = _table()["layouts"].get(row.get("layout"), {})
    out: dict[str, Any] = {}
    for source, std in mapping.items():
        where = f"network_structure.tensor_name_mapping['{source}']"
        if not isinstance(std, str):
            raise SpecError(file, where, f"expected a standard tensor name, got {std!r}")
        base, _, suffix = std.rpartition(".")
        if suffix not in _SUFFIXES or base not in layout:
            known = ", ".join(f"{n}.weight" for n in layout) or "(none: use an empty mapping)"
            raise SpecError(file, where, f"standard name {std!r} has no counterpart in spec {row['spec']!r} "
                                         f"(known: {known})")
        module = layout[base]
        full = f"{module}.{suffix}"
        if full in out:
            raise SpecError(file, where, f"{std!r} is mapped twice")
        found = _own_entry(own, module, full)
        fallback = _with_suffix(*found) if found else []
        # transforms the spec applies to this tensor (transpose, q/k row order, ...) apply to the renamed one too
        transforms = {k: v for k, v in (fallback[0] if fallback else {}).items() if k not in ("name", "when")}
        if found and any(isinstance(a, dict) and ({"cat", "stack", "zeros"} & set(a))
                         for a in (found[0] if isinstance(found[0], list) else [found[0]])):
            raise SpecError(file, where, f"spec {row['spec']!r} builds {module} from several tensors; "
                                         f"a single renamed tensor cannot replace it")
        names = [prefix + source] if prefix else []
        names.append(source)
        for n in list(names):  # old checkpoints name LayerNorm parameters gamma / beta
            for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
                if n.endswith(old):
                    names.append(n[: -len(old)] + new)
        alts = [{"name": n, **transforms} for n in dict.fromkeys(names)]
        # Inferflow's built-in names still apply to whatever the mapping does not rename: the spec's own template
        out[full] = alts + [a for a in fallback if a["name"] not in names]
    return out


def translate(doc: dict, path: str | Path, src: WeightSource) -> Spec:
    """The shipped spec that a model_spec.json describes, with its hyper-parameters and tensor names applied."""
    file = str(path)
    ns = doc["network_structure"]
    structure = _structure(ns, file)
    if structure["qk_column_order"] != 2 and src.kind == "hf":
        raise SpecError(file, "network_structure.qk_column_order",
                        f"{structure['qk_column_order']}: q/k rows in interleaved RoPE order are read from GGUF and "
                        f"llama2.c files; safetensors/pickle checkpoints must hold HF's rotate-half order (2)")
    if structure["tensor_name_pre_mapping"]:
        raise SpecError(file, "network_structure.tensor_name_pre_mapping",
                        "not supported: put the final source names in tensor_name_mapping")
    row = _pick(structure, file, src)
    base = load_spec(row["spec"])
    data = copy.deepcopy(base.data)
    params = data.setdefault("params", {})
    for key, param in row.get("params", {}).items():
        if key in ns and param in params:
            params[param] = ns[key]  # a constant: the value the Inferflow spec states wins over config.json
    for key in ("vocab_size",):
        if doc.get(key) is not None and key in params:
            params[key] = doc[key]
    weights = data.setdefault("weights", {})
    kind = src.kind
    own = weights.get(kind) or {}
    weights[kind] = {**own, **_names(ns, row, own, file)}
    validate(data, file)
    return Spec(name=base.name, file=f"{file} (as {Path(base.file).name})", data=data)
