"""Placement of one model over several processes/devices: tensor parallel, layer pipeline, CPU/GPU hybrid.

One concept per file: ``placement`` (the config), ``groups`` (torch.distributed process groups), ``tp_modules``
(the collective-aware wrappers), ``tensor`` (which component is sharded how: a rule table keyed by component
name), ``pipeline`` (contiguous layer ranges per stage, send/recv), ``hybrid`` (first N layers on the CPU),
``packed_split`` (block-aligned slicing of quantized weights), ``apply`` (one entry point; sharding while
loading), ``replicated`` (rank 0 owns the requests, the others replay its step plans), ``micro`` (micro-batched
pipeline steps), ``launch`` (ranks for the service and query files: torchrun's or spawned) and ``serve`` (the
service on several ranks). docs/placement.md.
Every rank runs the same program (SPMD): all ranks call the same Model methods with the same inputs.
"""
from .placement import Placement, parse_devices
from .apply import parallelize

__all__ = ["Placement", "parse_devices", "parallelize"]
