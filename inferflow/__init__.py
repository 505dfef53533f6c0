"""inferflow: run any transformer model from a spec file.

    import inferflow
    m = inferflow.load("path/to/model")          # spec auto-detected from the model's config
    m.generate("The capital of France is", max_new_tokens=8)
"""
from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

# torch's import makes ~180k objects, and the cyclic collector walked them again and again while they were made
# (0.1-0.15 s of a 1.1 s import). Off while the package imports, back as it was after; the console scripts then
# freeze what the imports made (freeze_heap), so that no later collection walks it either.
_gc_was_on = gc.isenabled()
gc.disable()

__version__ = "0.1.0"


def _wire_source_tree_components() -> None:
    # In the wheel, components/ is installed as inferflow.components; in a source checkout it sits
    # beside this package, so register it under the same name.
    if "inferflow.components" in sys.modules:
        return
    if importlib.util.find_spec("inferflow.components") is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "components"
    spec = importlib.util.spec_from_file_location("inferflow.components", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["inferflow.components"] = module
    spec.loader.exec_module(module)


_wire_source_tree_components()

try:
    from .errors import FormatError, InferflowError, SpecError, UnsafeFileError, WeightError  # noqa: E402
    from .model.model import Model, load  # noqa: E402
    from .spec.loader import Spec, load_spec  # noqa: E402
finally:
    if _gc_was_on:
        gc.enable()


def freeze_heap() -> None:
    """Leave every object made so far out of the cyclic collector's walks (``gc.freeze``): the imported modules and
    a loaded model live as long as the process, and a full collection over them stalled it for 70 ms or more (a
    server's event loop included). What the console scripts and the service call once they are set up (vLLM does
    the same after start-up); a library user who keeps cyclic garbage around should not call it."""
    gc.freeze()

__all__ = ["load", "Model", "Spec", "load_spec", "InferflowError", "SpecError", "WeightError", "FormatError",
           "UnsafeFileError", "Engine", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # the engine is imported on first use: `import inferflow` stays light for load-and-run scripts
    if name in ("Engine", "EngineConfig", "SamplingParams"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'inferflow' has no attribute {name!r}")
