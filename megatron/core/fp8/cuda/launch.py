"""Triton launches with little host work: `launch(kernel, grid, args, constexprs)`.

`kernel[grid](...)` re-binds and hashes its specialization key on every call (about a third of
a ~20 us launch on an H200 host, up to six per Fp8Linear step). Here the compiled kernel is
looked up by what Triton specializes on (tensor dtype and 16-byte alignment; int == 1, % 16,
fits int32; constexprs and options by value; the device) and its launcher called directly, as
Triton's run does (metadata and hooks included, so profilers still see it). The first launch
of a key goes through Triton; after a failed direct call, Triton's path for the process.
"""

from __future__ import annotations

import functools

import torch

_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg"))
_INT32 = range(-(2**31), 2**31)

# (kernel, device, constexpr/option values, argument keys) -> (compiled kernel, tail args)
_compiled: dict[tuple, tuple] = {}
_direct = {"enabled": True, "why_not": "", "launches": 0}


def reset_launch_cache() -> None:
    """Forget every kept compiled kernel and turn direct launches back on, with the launch
    count at 0 (tests and benchmarks that swap kernels or measure from a clean state)."""
    _compiled.clear()
    _direct.update(enabled=True, why_not="", launches=0)


def set_direct_launch(enabled: bool) -> None:
    """Turn the direct path on or off (off: every launch goes through Triton's own call)."""
    _direct["enabled"] = enabled
    if not enabled:
        _direct["why_not"] = "turned off by set_direct_launch"


def direct_launch_status() -> str:
    """'direct (N launches)' while cached launches run, else why they were turned off."""
    if _direct["enabled"]:
        return f"direct ({_direct['launches']} launches)"
    return f"triton jit ({_direct['why_not']})"


def aligned_16(t: torch.Tensor) -> bool:
    """Whether t starts at a 16-byte boundary: what Triton specializes a pointer on, what TMA
    and cuBLASLt need (of every scale too: a view into stacked scales may not be one, gemm.py)."""
    return t.data_ptr() % 16 == 0


def _arg_key(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value.dtype, aligned_16(value))
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, value in _INT32)
    if isinstance(value, float):
        return ("float",)
    return ("other", value)


def _raw_stream(device: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


@functools.cache
def _knobs():
    """triton.knobs.runtime (its launch hooks are read at every launch), imported once."""
    try:
        from triton import knobs
    except ImportError:  # Triton before knobs (3.3): no direct path
        return None
    return knobs.runtime


def _key(kernel, device: int, args: tuple, constexprs: dict) -> tuple:
    return (id(kernel), device, tuple(constexprs.values()), tuple(map(_arg_key, args)))


def _grid_3d(grid: tuple) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def _run_compiled(kernel, grid_3d, args, constexprs, compiled, tail, device, runtime) -> None:
    """Exactly what Triton's JITFunction.run does once it has found the compiled kernel. If
    the launcher rejects the call (its argument checks fail before anything runs, so
    relaunching is safe), launch through Triton and turn the direct path off."""
    stream = _raw_stream(device)
    try:
        metadata = compiled.launch_metadata(grid_3d, stream, *args, *tail)
        compiled.run(
            *grid_3d,
            stream,
            compiled.function,
            compiled.packed_metadata,
            metadata,
            runtime.launch_enter_hook,
            runtime.launch_exit_hook,
            *args,
            *tail,
        )
    except (TypeError, AttributeError, RuntimeError) as err:
        _direct["enabled"], _direct["why_not"] = False, f"{type(err).__name__}: {err}"[:200]
        kernel[grid_3d](*args, **constexprs)
        return
    _direct["launches"] += 1


def launch(kernel, grid: tuple, args: tuple, constexprs: dict) -> None:
    """kernel[grid](*args, **constexprs), where args are the kernel's leading runtime
    parameters in order and constexprs holds every constexpr parameter and launch option."""
    if torch.compiler.is_compiling():
        # torch.compile traces user Triton kernels through kernel[grid]; keep that call.
        kernel[grid](*args, **constexprs)
        return
    device = args[0].get_device()
    key = _key(kernel, device, args, constexprs)
    entry = _compiled.get(key)
    runtime = _knobs() if entry is not None and _direct["enabled"] else None
    if runtime is None:
        compiled = kernel[grid](*args, **constexprs)
        if entry is None and _direct["enabled"]:
            _remember(key, kernel, compiled, len(args), constexprs)
        return
    compiled, tail = entry
    _run_compiled(kernel, _grid_3d(grid), args, constexprs, compiled, tail, device, runtime)


def _remember(key, kernel, compiled, n_args: int, constexprs: dict) -> None:
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    names = kernel.arg_names[n_args:]
    if any(name not in constexprs for name in names):
        return  # a parameter left at its default: let Triton bind it every time
    tail = tuple(constexprs[name] for name in names)
    if any(name in _OPTIONS for name in names):
        return
    _compiled[key] = (compiled, tail)


class LaunchSite:
    """One call site launching `kernel` again and again with the same grid, constexprs, dtypes
    and int values, only the tensors changing: after the first launch it holds the compiled
    kernel, so a launch skips even the key above. `site(args, alignment)`: `alignment` is any
    hashable the caller derives for which tensor arguments are 16-byte aligned (one compiled
    kernel per value); everything else must stay fixed (one site per shape, dtypes and flags).
    """

    __slots__ = ("kernel", "grid", "constexprs", "_held")

    def __init__(self, kernel, grid: tuple, constexprs: dict) -> None:
        self.kernel = kernel
        self.grid = _grid_3d(grid)
        self.constexprs = constexprs
        # alignment -> (compiled kernel, constexpr tail, device, triton.knobs.runtime)
        self._held: dict = {}

    def __call__(self, args: tuple, alignment) -> None:
        held = self._held.get(alignment)
        if held is not None and _direct["enabled"] and not torch.compiler.is_compiling():
            _run_compiled(self.kernel, self.grid, args, self.constexprs, *held)
            return
        # Under torch.compile tracing launch() keeps Triton's own call, held or not.
        launch(self.kernel, self.grid, args, self.constexprs)
        if held is None and _direct["enabled"] and not torch.compiler.is_compiling():
            self._hold(args, alignment)

    def _hold(self, args: tuple, alignment) -> None:
        device = args[0].get_device()
        entry = _compiled.get(_key(self.kernel, device, args, self.constexprs))
        runtime = _knobs()
        if entry is not None and runtime is not None:
            self._held[alignment] = (entry[0], entry[1], device, runtime)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def as_2d_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, cols) of the 2-D view quantization works on: leading dims fold into rows."""
    if len(shape) == 0:
        return 1, 1
    cols = int(shape[-1])
    rows = 1
    for dim in shape[:-1]:
        rows *= int(dim)
    return rows, cols
