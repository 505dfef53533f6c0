"""Builds a :class:`Net` from a spec and its resolved hyper-parameters, using the component registry."""
from __future__ import annotations

from typing import Any

from torch import nn

from .. import registry
from ..errors import SpecError
from ..spec.expr import resolve
from ..spec.loader import Spec
from .flow import Flow, Net, Stack

_RESERVED = set(dir(nn.Module)) | {"plan", "first_input"}
FLOW_INPUTS = {"embed": ("input_ids", "positions", "token_type_ids"), "layers": ("x",), "final": ("x",), "head": ("x",)}


def _when(step: dict, names: dict, where: tuple) -> bool:
    cond = step.get("when", True)
    return bool(resolve(cond, names, where=(where[0], f"{where[1]}.when")))


def build_flow(spec: Spec, steps: list[dict], names: dict[str, Any], key: str, kind: str) -> Flow | None:
    """Instantiate one flow; ``key`` is the spec key path used in error messages."""
    if not steps:
        return None
    bound = set(FLOW_INPUTS[kind])
    built: list[tuple[str, nn.Module, tuple[str, ...] | None]] = []
    for n, step in enumerate(steps):
        where = (spec.file, f"{key}[{n}]")
        if not _when(step, names, where):
            continue
        name = step["name"]
        if name in _RESERVED or name in bound:
            raise SpecError(spec.file, f"{key}[{n}].name", f"step name {name!r} is reserved or used twice")
        inputs = step.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if inputs is not None:
            for inp in inputs:
                if inp not in bound:
                    raise SpecError(spec.file, f"{key}[{n}].input",
                                    f"unknown input {inp!r} (defined before this step: {', '.join(sorted(bound))})")
            inputs = tuple(inputs)
        params = resolve(step.get("params", {}), names, where=(spec.file, f"{key}[{n}].params"))
        module = registry.create(step["component"], params, where=(spec.file, f"{key}[{n}]"))
        built.append((name, module, inputs))
        bound.add(name)
    if not built:
        return None
    return Flow(built, FLOW_INPUTS[kind][0])


def build_stack(spec: Spec, stack_key: str, params: dict[str, Any]) -> Stack:
    data = spec.data[stack_key]
    position = None
    pos = data.get("position")
    # a list holds alternatives, the first whose `when` holds wins (one spec for RoPE or ALiBi checkpoints)
    choices = pos if isinstance(pos, list) else [] if pos is None else [pos]
    for n, pos in enumerate(choices):
        key = f"{stack_key}.position" + (f"[{n}]" if isinstance(data["position"], list) else "")
        if _when(pos, params, (spec.file, key)):
            pparams = resolve(pos.get("params", {}), params, where=(spec.file, f"{key}.params"))
            position = registry.create(pos["component"], pparams, where=(spec.file, key))
            break
    embed = build_flow(spec, data.get("embed", []), params, f"{stack_key}.embed", "embed")
    count = resolve(data["layers"]["count"], params, where=(spec.file, f"{stack_key}.layers.count"))
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise SpecError(spec.file, f"{stack_key}.layers.count", f"expected a non-negative integer, got {count!r}")
    layers = []
    for i in range(count):
        flow = build_flow(spec, data["layers"]["steps"], {**params, "i": i}, f"{stack_key}.layers.steps", "layers")
        if flow is None:
            raise SpecError(spec.file, f"{stack_key}.layers.steps", f"layer {i} has no steps")
        layers.append(flow)
    final = build_flow(spec, data.get("final", []), params, f"{stack_key}.final", "final")
    return Stack(stack_key, embed, position, layers, final)


def assemble(spec: Spec, params: dict[str, Any]) -> Net:
    """Build the network's modules; weights are declared (meta) and filled later by the weight loader."""
    encoder = build_stack(spec, "encoder", params) if "encoder" in spec.data else None
    decoder = build_stack(spec, "decoder", params) if "decoder" in spec.data else None
    head = build_flow(spec, spec.data.get("head", []), params, "head", "head")
    return Net(encoder, decoder, head)
