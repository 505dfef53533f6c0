"""Reading, merging and validating model specs (YAML or INI, one JSON Schema)."""
from __future__ import annotations

import configparser
import copy
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ..errors import SpecError
from .schema_errors import explain

SPEC_SUFFIXES = (".yaml", ".yml", ".ini")
_MAX_SPEC_BYTES = 4 << 20
_MAX_EXTENDS_DEPTH = 16
# libyaml's parser when present: every load matches against all specs, and pure-Python YAML took seconds
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(slots=True)
class Spec:
    """A resolved model spec: the merged document, where it came from, and (after loading) its hyper-parameters."""

    name: str
    file: str
    data: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.data["architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def __repr__(self) -> str:
        return f"Spec({self.name!r}, {self.architecture}, file={self.file!r})"


def search_path() -> list[Path]:
    """Folders searched for spec names: $INFERFLOW_SPEC_PATH entries, then the shipped specs."""
    dirs = [Path(p) for p in os.environ.get("INFERFLOW_SPEC_PATH", "").split(os.pathsep) if p]
    here = Path(__file__).resolve().parent.parent
    for cand in (here / "model_specs", here.parent / "model_specs"):
        if cand.is_dir():
            dirs.append(cand)
    return dirs


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL byte: no such spec
        return False


def find_spec_file(name_or_path: str | os.PathLike, relative_to: Path | None = None) -> Path:
    p = Path(name_or_path)
    if p.suffix in SPEC_SUFFIXES and _is_file(p):
        return p
    dirs = ([relative_to] if relative_to else []) + search_path()
    for d in dirs:
        for suffix in ("",) + SPEC_SUFFIXES:
            cand = d / f"{name_or_path}{suffix}"
            if _is_file(cand) and cand.suffix in SPEC_SUFFIXES:
                return cand
    raise SpecError(str(name_or_path), None, f"no spec file found (looked in {', '.join(map(str, dirs))})")


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, TypeError, RecursionError):  # not YAML (or a bad date): the plain text
        return text


def _listify(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: _listify(v) for k, v in node.items()}
        if node and all(isinstance(k, str) and k.isdigit() for k in node):
            return [node[k] for k in sorted(node, key=int)]
    return node


def _set_path(root: dict, path: list[str], value: Any, file: str) -> None:
    node = root
    for part in path[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise SpecError(file, ".".join(path), f"'{part}' is both a value and a section")
        node = nxt
    node[path[-1]] = value


def parse_ini(text: str, file: str) -> dict[str, Any]:
    """INI form: section names are dotted key paths (numeric parts index lists); values are YAML scalars/flows."""
    cp = configparser.ConfigParser(interpolation=None, strict=True, delimiters=("=",), comment_prefixes=("#", ";"))
    cp.optionxform = str  # keys are case-sensitive, as in YAML
    try:
        cp.read_string(text, source=file)
    except configparser.Error as e:
        raise SpecError(file, None, f"invalid INI: {e}") from None
    root: dict[str, Any] = {}
    for section in cp.sections():
        base = [] if section == "spec" else section.split(".")
        for key, raw in cp.items(section):
            _set_path(root, base + key.split("."), _parse_scalar(raw), file)
    return _listify(root)


# Every load without a spec reads and validates all specs: parsed documents (by file, mtime and size) and
# documents that passed the schema are remembered, so matching costs milliseconds, not seconds.
_DOCS: dict[tuple[str, int, int], dict[str, Any]] = {}
_VALID: set[str] = set()


def read_document(path: Path) -> dict[str, Any]:
    file = str(path)
    try:
        st = path.stat()
        if st.st_size > _MAX_SPEC_BYTES:
            raise SpecError(file, None, f"spec larger than {_MAX_SPEC_BYTES} bytes")
        key = (file, st.st_mtime_ns, st.st_size)
        if key in _DOCS:
            return copy.deepcopy(_DOCS[key])
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(file, None, f"cannot read spec: {e}") from None
    if path.suffix == ".ini":
        doc = parse_ini(text, file)
    else:
        try:
            doc = yaml.load(text, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader (C or Python)
        except (yaml.YAMLError, ValueError, TypeError, RecursionError) as e:  # ValueError: e.g. a bad date
            raise SpecError(file, None, f"invalid YAML: {type(e).__name__}: {e}") from None
    if not isinstance(doc, dict):
        raise SpecError(file, None, f"a spec must be a mapping at top level, got {type(doc).__name__}")
    check_size(doc, file)
    if len(_DOCS) > 256:
        _DOCS.clear()
    _DOCS[key] = copy.deepcopy(doc)
    return doc


_MAX_VALUES = 1 << 18  # every shipped spec has under 2,000
_MAX_NESTING = 64


def check_size(doc: Any, file: str) -> None:
    """Refuse a document that expands to more values than any spec has (YAML aliases: a few hundred bytes can
    name 10^9 values, and merging, validating and hashing walk each one), nests absurdly deep or contains itself
    (a recursive alias), before anything walks it recursively."""
    count, stack = 0, [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > _MAX_VALUES:
            raise SpecError(file, None, f"the document expands to more than {_MAX_VALUES} values (YAML aliases?)")
        if depth > _MAX_NESTING:
            raise SpecError(file, None, f"values nested deeper than {_MAX_NESTING} levels (or a recursive alias)")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for kv in node.items() for v in kv)
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)


def deep_merge(base: dict, over: dict) -> dict:
    """Dicts merge key by key; lists and scalars in ``over`` replace; a null value deletes the key."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None and k in out:
            del out[k]
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _resolve_extends(doc: dict, path: Path, depth: int, seen: tuple[Path, ...]) -> dict:
    bases = doc.get("extends") or []
    if isinstance(bases, str):
        bases = [bases]
    if depth > _MAX_EXTENDS_DEPTH:
        raise SpecError(str(path), "extends", f"extends nested deeper than {_MAX_EXTENDS_DEPTH}")
    merged: dict[str, Any] = {}
    for b in bases:
        if not isinstance(b, str):
            raise SpecError(str(path), "extends", f"expected a spec name or path, got {b!r}")
        try:
            bpath = find_spec_file(b, relative_to=path.parent).resolve()
        except SpecError as e:
            raise SpecError(str(path), "extends", f"base spec {b!r}: {e.problem}") from None
        if bpath in seen:
            chain = " -> ".join(p.name for p in seen[seen.index(bpath):] + (bpath,))
            raise SpecError(str(path), "extends", f"circular extends: {chain}")
        merged = deep_merge(merged, _resolve_extends(read_document(bpath), bpath, depth + 1, seen + (bpath,)))
    merged = deep_merge(merged, {k: v for k, v in doc.items() if k != "extends"})
    return merged


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads((Path(__file__).parent / "schema.json").read_text())


def validate(doc: dict, file: str) -> None:
    try:
        key = json.dumps(doc, sort_keys=True, default=repr)
    except (TypeError, ValueError):  # keys of mixed types: validate every time
        key = None
    if key is not None and key in _VALID:
        return
    errors = list(jsonschema.Draft202012Validator(schema()).iter_errors(doc))
    if errors:
        raise SpecError(file, *explain(errors, schema()))
    if key is not None:
        if len(_VALID) > 512:
            _VALID.clear()
        _VALID.add(key)


def load_spec(name_or_path: str | os.PathLike) -> Spec:
    """Find, read, merge (``extends``) and validate a spec."""
    return checked(read_spec(name_or_path))


def read_spec(name_or_path: str | os.PathLike) -> Spec:
    """Find, read and merge (``extends``) a spec, without the schema check: :func:`checked` does that. Model
    detection reads every spec but needs only the one that matches checked (the schema costs ~5 ms a spec)."""
    path = find_spec_file(name_or_path).resolve()
    doc = _resolve_extends(read_document(path), path, 0, (path,))
    if not isinstance(doc.get("name"), str):  # the schema's message names the key
        validate(doc, str(path))
    return Spec(name=doc["name"], file=str(path), data=doc)


def checked(spec: Spec) -> Spec:
    """``spec`` once its document passes the schema and the architecture's structure rules (else SpecError)."""
    validate(spec.data, spec.file)
    _check_structure(spec.data, spec.file)
    return spec


def _check_structure(doc: dict, file: str) -> None:
    arch = doc["architecture"]
    need = {"decoder_only": ["decoder"], "encoder_only": ["encoder"], "encoder_decoder": ["encoder", "decoder"]}[arch]
    for key in need:
        if key not in doc:
            raise SpecError(file, key, f"missing required key '{key}' for architecture {arch}")
    extra = {"encoder", "decoder"} - set(need)
    for key in extra:
        if key in doc:
            raise SpecError(file, key, f"architecture {arch} has no '{key}' stack")


def spec_files() -> list[Path]:
    """Every spec file on the search path, in search order (a name's first file is the one that counts)."""
    return [p for d in search_path() for p in sorted(d.iterdir())
            if p.suffix in SPEC_SUFFIXES and not p.name.startswith("_")]


def all_specs(errors: list[SpecError] | None = None) -> list[Spec]:
    """Every spec on the search path (first one of a name wins).

    With ``errors`` given, a broken spec file is collected there instead of raising, so one bad file on
    $INFERFLOW_SPEC_PATH cannot stop every other model from being detected.
    """
    seen: dict[str, Spec] = {}
    for p in spec_files():
        try:
            spec = load_spec(p)
        except SpecError as e:
            if errors is None:
                raise
            errors.append(e)
            continue
        seen.setdefault(spec.name, spec)
    return list(seen.values())
