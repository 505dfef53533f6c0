"""The placement config: Inferflow's ``devices`` string or the explicit form, parsed into one dataclass.

``devices`` (Inferflow syntax): ``cpu``; ``0`` (one GPU); ``0;1`` (layer pipeline, one stage per ``;`` group);
``0&1`` (tensor parallel inside a group); ``0&1;2&3`` (hybrid: TP groups inside pipeline stages).
Explicit form: ``tensor_parallel: N``, ``pipeline_parallel: N`` (even split of layers) or
``pipeline_stages: [[0, 15], [16, 31]]`` (inclusive layer ranges), ``cpu_layers: N``, ``host_embeddings``,
``micro_batches: N`` (a pipeline engine step runs as N overlapping micro-batches, micro.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InferflowError

_KEYS = ("devices", "tensor_parallel", "pipeline_parallel", "pipeline_stages", "cpu_layers", "host_embeddings",
         "micro_batches")


@dataclass(slots=True)
class Placement:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_stages: list[tuple[int, int]] | None = None  # inclusive decoder layer ranges, one per stage
    devices: list[list[int]] | None = None                # GPU ids per stage (None: CPU / one rank per device)
    cpu: bool = False                                     # ``devices: cpu``
    cpu_layers: int = 0
    host_embeddings: bool = False
    micro_batches: int = 1                                # engine steps of a pipeline as N micro-batches
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def coords(self, rank: int) -> tuple[int, int]:
        """(pipeline stage, tensor-parallel rank) of a global rank: ranks of one stage are consecutive."""
        return rank // self.tensor_parallel, rank % self.tensor_parallel

    def device_index(self, rank: int) -> int | None:
        """The GPU id a rank should use (None when the placement names none)."""
        if self.devices is None:
            return None
        stage, t = self.coords(rank)
        return self.devices[stage][t]

    def stage_ranges(self, num_layers: int, key: str = "pipeline_stages") -> list[tuple[int, int]]:
        """Half-open [start, stop) layer ranges per stage, validated against the stack's layer count."""
        pp = self.pipeline_parallel
        if self.pipeline_stages is None:
            if num_layers < pp:
                raise InferflowError(f"pipeline_parallel: {pp} stages but only {num_layers} layers")
            base, rem = divmod(num_layers, pp)
            out, start = [], 0
            for s in range(pp):
                n = base + (1 if s < rem else 0)
                out.append((start, start + n))
                start += n
            return out
        out, expect = [], 0
        for a, b in self.pipeline_stages:
            if a != expect or b < a:
                raise InferflowError(f"{key}: ranges must be contiguous from layer 0, got {self.pipeline_stages}")
            out.append((a, b + 1))
            expect = b + 1
        if expect != num_layers:
            raise InferflowError(f"{key}: ranges cover layers 0..{expect - 1} but the model has {num_layers}")
        return out

    @classmethod
    def from_config(cls, cfg: "str | dict[str, Any] | Placement | None") -> "Placement":
        """A placement from a ``devices`` string, a dict of the keys above, or None (one process)."""
        if cfg is None:
            return cls()
        if isinstance(cfg, Placement):
            return cfg
        if isinstance(cfg, str):
            return parse_devices(cfg)
        if not isinstance(cfg, dict):
            raise InferflowError(f"placement: expected a devices string or a mapping, got {type(cfg).__name__}")
        unknown = [k for k in cfg if k not in _KEYS]
        if unknown:
            raise InferflowError(f"placement: unknown key {unknown[0]!r} (use {', '.join(_KEYS)})")
        p = parse_devices(str(cfg["devices"])) if cfg.get("devices") is not None else cls()
        if "tensor_parallel" in cfg:
            tp = _pos_int(cfg["tensor_parallel"], "tensor_parallel")
            if p.devices is not None and tp != p.tensor_parallel:
                raise InferflowError(f"tensor_parallel: {tp} disagrees with devices ({p.tensor_parallel} per stage)")
            p.tensor_parallel = tp
        if "pipeline_parallel" in cfg:
            pp = _pos_int(cfg["pipeline_parallel"], "pipeline_parallel")
            if p.devices is not None and pp != p.pipeline_parallel:
                raise InferflowError(f"pipeline_parallel: {pp} disagrees with devices ({p.pipeline_parallel} stages)")
            p.pipeline_parallel = pp
        if cfg.get("pipeline_stages") is not None:
            st = cfg["pipeline_stages"]
            if not isinstance(st, (list, tuple)) or not st or not all(
                    isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                       and v >= 0 for v in r) for r in st):
                raise InferflowError(f"pipeline_stages: expected a list of [first, last] layer pairs, got {st!r}")
            if "pipeline_parallel" in cfg and len(st) != p.pipeline_parallel or p.devices is not None and \
                    len(st) != p.pipeline_parallel:
                raise InferflowError(f"pipeline_stages: {len(st)} ranges but {p.pipeline_parallel} pipeline stages")
            p.pipeline_stages = [(int(a), int(b)) for a, b in st]
            p.pipeline_parallel = len(st)
        if "cpu_layers" in cfg:
            p.cpu_layers = _nonneg_int(cfg["cpu_layers"], "cpu_layers")
            if p.cpu_layers and p.world_size > 1:
                raise InferflowError("cpu_layers: the CPU/GPU hybrid is single-process; drop tensor/pipeline parallel")
        if "micro_batches" in cfg:
            p.micro_batches = _pos_int(cfg["micro_batches"], "micro_batches")
        if "host_embeddings" in cfg:
            if not isinstance(cfg["host_embeddings"], bool):
                raise InferflowError(f"host_embeddings: expected true/false, got {cfg['host_embeddings']!r}")
            p.host_embeddings = cfg["host_embeddings"]
        return p


def _pos_int(v: Any, key: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InferflowError(f"{key}: expected a positive integer, got {v!r}")
    return v


def _nonneg_int(v: Any, key: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise InferflowError(f"{key}: expected a non-negative integer, got {v!r}")
    return v


def parse_devices(text: str) -> Placement:
    """Inferflow's ``devices`` string: ``;`` separates pipeline stages, ``&`` the GPUs of one TP group."""
    s = text.strip().replace(" ", "")
    if s.lower() == "cpu":
        return Placement(cpu=True)
    if not s:
        raise InferflowError("devices: empty (use e.g. 'cpu', '0', '0;1', '0&1' or '0&1;2&3')")
    stages: list[list[int]] = []
    for part in s.split(";"):
        ids = []
        for tok in part.split("&"):
            if not tok.isdigit():
                raise InferflowError(f"devices: {tok!r} in {text!r} is not a GPU id (use e.g. '0&1;2&3' or 'cpu')")
            ids.append(int(tok))
        stages.append(ids)
    flat = [d for st in stages for d in st]
    if len(set(flat)) != len(flat):
        raise InferflowError(f"devices: a GPU appears twice in {text!r}")
    if len({len(st) for st in stages}) != 1:
        raise InferflowError(f"devices: every stage needs the same number of GPUs, got {text!r}")
    return Placement(tensor_parallel=len(stages[0]), pipeline_parallel=len(stages), devices=stages)
