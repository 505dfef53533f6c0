"""Fuzz targets shared by the in-suite fuzz tests (tests/test_fuzz_*.py) and the long runner (tools/fuzz.py).

Each target has valid tiny seed files (fuzz_seeds.py), structure-aware mutators (fuzz_mutators.py), and a
``load`` that reads the file completely (every tensor, every metadata array). The oracle,
:func:`run_one`, says what one input did: ``ok`` (loaded), ``refused`` (an InferflowError naming the file), or a
bug: another exception, an error that does not name the file, a hang past the deadline, or a Python allocation
out of proportion to the input.
"""
from __future__ import annotations

import random
import signal
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fuzz_mutators import mutate_bytes, mutate_ini, mutate_json, mutate_pickle, mutate_safetensors, mutate_yaml
from fuzz_seeds import (gguf_seeds, inferflow_seeds, ini_seeds, llama2c_seeds, pickle_seeds, request_seeds,
                        rezip, safetensors_seeds, torch_seeds, yaml_seeds, zip_members)
from inferflow.errors import InferflowError

DEADLINE_S = 5.0
ALLOC_FACTOR, ALLOC_SLACK = 64, 48 << 20  # Python-heap peak allowed: 64 x the input + 48 MiB


class Hang(BaseException):
    """Raised by the deadline alarm; a BaseException so no ``except Exception`` in the code under test eats it."""


# ---- loaders: read everything ---------------------------------------------------------------------------------
def _read_source(src: Any) -> None:
    for name in src.names():
        t = src.get(name)
        assert tuple(t.shape) == tuple(src.shape(name)), (name, t.shape, src.shape(name))
    for key in list(getattr(src, "_arrays", {})):
        src.array(key)


def load_torch(path: Path) -> None:
    from inferflow.loaders import open_file

    _read_source(open_file(path))


def load_raw_pickle(path: Path) -> None:
    from inferflow.loaders.pickle_reader import load_pickle
    from inferflow.loaders.torch_file import TorchFile

    tf = TorchFile.__new__(TorchFile)  # the allow-list of a real torch file, without opening one
    tf.path, tf.size, tf.storages = str(path), path.stat().st_size, {}
    from inferflow.loaders.pickle_globals import allowed_globals

    g = allowed_globals({"_rebuild_tensor_v2": tf._rebuild, "_rebuild_tensor_v3": tf._rebuild_v3,
                         "_rebuild_parameter": tf._parameter})
    load_pickle(path.read_bytes(), str(path), g, tf._persistent_load)


def load_safetensors(path: Path) -> None:
    from inferflow.loaders.safetensors import SafetensorsFile

    f = SafetensorsFile(str(path))
    for name, info in f.infos.items():
        assert tuple(f.get(name).shape) == info.shape


def load_gguf(path: Path) -> None:
    from inferflow.loaders.gguf import GGUFSource

    _read_source(GGUFSource(path))


def load_llama2c(path: Path) -> None:
    from inferflow.loaders.llama2c import Llama2cSource

    _read_source(Llama2cSource.from_bin(path))


_CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def load_spec_file(path: Path) -> None:
    from inferflow.spec.loader import load_spec
    from inferflow.spec.params import resolve_params

    spec = load_spec(path)
    resolve_params(spec, "hf", _CONFIG)


class _FakeSource:
    kind, config, arch, path = "hf", _CONFIG, None, "fake"

    def names(self) -> list[str]:
        return []


def load_inferflow(path: Path) -> None:
    from inferflow.spec.inferflow_compat import read_inferflow_spec, translate

    doc = read_inferflow_spec(path)
    if doc is not None:
        translate(doc, path, _FakeSource())


def load_request(path: Path) -> None:
    from request_parsing import check_body

    check_body(path.read_bytes(), str(path))


# ---- targets --------------------------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    suffix: str
    seeds: Callable[[], list[bytes]]
    load: Callable[[Path], None]
    mutate: Callable[[bytes, random.Random], bytes]
    wrap: Callable[[bytes, int], bytes] | None = None  # seed index, mutated bytes -> file bytes
    _seeds: list[bytes] = field(default_factory=list)

    def seed_list(self) -> list[bytes]:
        if not self._seeds:
            self._seeds.extend(self.seeds())
        return self._seeds


_ZIP_CACHE: dict[int, dict[str, bytes]] = {}


def _wrap_pickle_cached(pkl: bytes, i: int) -> bytes:
    if i not in _ZIP_CACHE:
        _ZIP_CACHE[i] = zip_members(torch_seeds(False)[i % 2])
    return rezip({k: (pkl if k.endswith("data.pkl") else v) for k, v in _ZIP_CACHE[i].items()})


TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("pickle", ".pt", pickle_seeds, load_torch, mutate_pickle, _wrap_pickle_cached),
    Target("raw_pickle", ".pkl", pickle_seeds, load_raw_pickle, mutate_pickle),
    Target("torch_zip", ".pt", lambda: torch_seeds(False), load_torch, mutate_bytes),
    Target("torch_legacy", ".pt", lambda: torch_seeds(True), load_torch,
           lambda d, r: mutate_pickle(d, r) if r.random() < 0.5 else mutate_bytes(d, r)),
    Target("safetensors", ".safetensors", safetensors_seeds, load_safetensors, mutate_safetensors),
    Target("gguf", ".gguf", gguf_seeds, load_gguf, mutate_bytes),
    Target("llama2c", ".bin", llama2c_seeds, load_llama2c, lambda d, r: mutate_bytes(d, r, head=64)),
    Target("spec_yaml", ".yaml", yaml_seeds, load_spec_file, mutate_yaml),
    Target("spec_ini", ".ini", ini_seeds, load_spec_file, mutate_ini),
    Target("inferflow_json", ".json", inferflow_seeds, load_inferflow, mutate_json),
    Target("request_body", ".json", request_seeds, load_request, mutate_json),
]}


# ---- the oracle -----------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str          # "ok" | "refused" | "bug"
    detail: str = ""   # the error type and message (bugs: what was wrong)


_COUNTER = [0]


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def run_one(target: Target, data: bytes, folder: Path, seed_index: int = 0, deadline: float = DEADLINE_S,
            measure_alloc: bool = False) -> Outcome:
    """Write ``data`` (wrapped as the target's container) to ``folder`` and load it completely."""
    payload = target.wrap(data, seed_index) if target.wrap else data
    _COUNTER[0] += 1  # a fresh name per input: caches keyed by (path, mtime, size) must not answer for an old one
    path = folder / f"fuzz_input_{_COUNTER[0]}{target.suffix}"
    path.write_bytes(payload)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, deadline)
    if measure_alloc:
        tracemalloc.start()
    try:
        target.load(path)
        outcome = Outcome("ok")
    except Hang:
        outcome = Outcome("bug", f"Hang: no answer within {deadline} s")
    except InferflowError as e:
        msg = str(e)
        outcome = Outcome("refused", f"{type(e).__name__}: {msg[:300]}") if path.name in msg else \
            Outcome("bug", f"{type(e).__name__} without the file name: {msg[:300]}")
    except RecursionError as e:
        outcome = Outcome("bug", f"RecursionError: {str(e)[:200]}")
    except Exception as e:  # noqa: BLE001 - exactly what the oracle looks for
        outcome = Outcome("bug", f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        path.unlink(missing_ok=True)
        if measure_alloc:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
    if measure_alloc and outcome.kind != "bug" and peak > ALLOC_FACTOR * len(payload) + ALLOC_SLACK:
        outcome = Outcome("bug", f"Allocation: Python heap peak {peak} bytes for a {len(payload)}-byte input")
    return outcome
