"""The one debug config of the FP8 package: A/B switches for measurements, not training options.

Benchmarks and `dev/` scripts change it with `set_debug_config` (which returns the previous
values, to restore them); nothing in the product writes it. Under torch.compile each value read
while tracing is guarded, so flipping one recompiles rather than reusing a stale graph.

- `amax_in_graph` (default True): under torch.compile, tensorwise quantization takes max|x|
  from `cuda.linear_ops.producer_amax`, computed in the graph, instead of running its own amax
  pass; Inductor fuses the row maxima into the kernel that produced x (RMSNorm, SwiGLU and
  their backwards, RoPE's backward), so x is not read an extra time. False restores the amax
  pass (`benchmarks/model_a_dp1.sh` `<recipe>_amaxpass` rows, `dev/bench_producer_amax.py`).
- `max_plans` (default 1024): how many prepared quantization plans `cuda.linear_ops` keeps
  (one per token count) before it starts over.
- `tiles` (default empty): launch configurations by kernel key, each replacing that key's entry
  of `cuda.quantize_common.TILE_CONFIG` at lookup (an empty dict turns that kernel off where
  TILE_CONFIG allows it); `benchmarks/bench_fp8.py --sweep` and tests set it. Call
  `cuda.linear_ops.clear_plans()` after changing it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class DebugConfig:
    amax_in_graph: bool = True
    max_plans: int = 1024
    tiles: dict = dataclasses.field(default_factory=dict)


DEBUG = DebugConfig()
"""Read by the FP8 code; changed only through `set_debug_config`."""


def set_debug_config(**changes) -> dict:
    """Set the named fields of `DEBUG` in place; returns their previous values
    (`set_debug_config(**previous)` restores them). An unknown name raises TypeError."""
    fields = {field.name for field in dataclasses.fields(DebugConfig)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"unknown FP8 debug settings {unknown}; known: {sorted(fields)}")
    previous = {name: getattr(DEBUG, name) for name in changes}
    for name, value in changes.items():
        setattr(DEBUG, name, value)
    return previous
