"""CPU twin of Fp8Linear's prepared quantize launches (megatron/core/fp8/cuda/linear_ops.py,
`OperandPlan` / `quantize_operands`) and of its direct GEMM (`_direct_scaled_mm`).

Fake kernels with the real kernels' parameter names (read from triton_*.py) stand in
for Triton: every launch is recorded, whether it went through `kernel[grid](...)` (Triton's
jit path) or through the held compiled kernel's launcher (the direct path), so the kernels,
grids, argument order and constexprs of each recipe are checked without a GPU. The real
kernels run on the H200 in test_cuda_linear.py."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from megatron.core.fp8.cuda import gemm as cuda_gemm
from megatron.core.fp8.cuda import launch, linear_ops
from megatron.core.fp8.cuda import quantize_blockwise as qbw
from megatron.core.fp8.cuda import quantize_common as qc
from megatron.core.fp8.cuda import quantize_mxfp8 as qmx
from megatron.core.fp8.cuda import quantize_per_tensor as qpt
from megatron.core.fp8.cuda.launch import ceil_div
from megatron.core.fp8.debug import set_debug_config
from megatron.core.fp8.quantized_tensor import Fp8Operand

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M, K = 256, 384
KERNELS = (
    "amax_partials_kernel",
    "per_tensor_cast_kernel",
    "block_1x128_rows_kernel",
    "block_128x1_cols_kernel",
    "block_1x128_fused_kernel",
    "block_1x128_pair_kernel",
    "block_128x128_kernel",
    "mxfp8_kernel",
    "mxfp8_quads_kernel",
)
STREAM = 1234


def _signatures() -> dict[str, tuple[list[str], list[str]]]:
    """kernel name -> (parameter names, constexpr parameter names), in signature order."""
    nodes = [
        node
        for path in pathlib.Path(qc.__file__).parent.glob("triton_*.py")
        for node in ast.parse(path.read_text()).body
    ]
    found = {}
    for node in nodes:
        if isinstance(node, ast.FunctionDef) and node.name in KERNELS:
            params = node.args.args
            constexpr = [
                p.arg
                for p in params
                if p.annotation is not None and ast.unparse(p.annotation) == "tl.constexpr"
            ]
            found[node.name] = ([p.arg for p in params], constexpr)
    assert sorted(found) == sorted(KERNELS)
    return found


SIGNATURES = _signatures()


class FakeCompiled:
    def __init__(self, kernel):
        self.kernel = kernel
        self.function, self.packed_metadata = "function", "packed"

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)

    def run(self, grid0, grid1, grid2, stream, function, packed, metadata, enter, exit_, *rest):
        kernel = self.kernel
        n_args = len(kernel.runtime_names)
        args, tail = rest[:n_args], rest[n_args:]
        assert (stream, function, packed) == (STREAM, "function", "packed")
        assert metadata == ("metadata", (grid0, grid1, grid2), STREAM)
        assert (enter, exit_) == ("enter hook", "exit hook")
        kernel.log.append(
            dict(
                path="direct",
                kernel=kernel.name,
                grid=(grid0, grid1, grid2),
                args=args,
                constexprs=dict(zip(kernel.constexpr_names, tail, strict=True)),
            )
        )


class FakeKernel:
    """A Triton JITFunction as launch.py sees it: arg_names, and kernel[grid](...) that
    records the launch and returns a compiled kernel."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.arg_names, self.constexpr_names = SIGNATURES[name]
        self.runtime_names = [n for n in self.arg_names if n not in self.constexpr_names]

    def __getitem__(self, grid):
        def call(*args, **passed):
            assert len(args) == len(self.runtime_names), (self.name, len(args))
            constexprs = {name: passed[name] for name in self.constexpr_names if name in passed}
            options = {name: value for name, value in passed.items() if name not in constexprs}
            self.log.append(
                dict(
                    path="jit",
                    kernel=self.name,
                    grid=tuple(grid),
                    args=args,
                    constexprs=constexprs,
                    options=options,
                    passed=passed,
                )
            )
            return FakeCompiled(self)

        return call


class FakeKernels:
    """What quantize_common.triton_kernels() returns: the kernels and grid_size."""

    def __init__(self):
        self.log: list[dict] = []
        for name in KERNELS:
            setattr(self, name, FakeKernel(name, self.log))

    @staticmethod
    def grid_size(rows, cols, tile_rows, tile_cols):
        return (ceil_div(rows, tile_rows) * ceil_div(cols, tile_cols),)

    def take(self) -> list[dict]:
        taken = list(self.log)
        self.log.clear()
        return taken


class FakeRuntime:
    launch_enter_hook = "enter hook"
    launch_exit_hook = "exit hook"


@pytest.fixture
def kernels(tiles, monkeypatch):
    fakes = FakeKernels()
    monkeypatch.setattr(qc, "triton_kernels", lambda: fakes)
    launch.reset_launch_cache()
    monkeypatch.setattr(launch, "_knobs", lambda: FakeRuntime)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: STREAM)
    # The tests below check the two single-copy 1x128 kernels; test_fused_1x128_* the fused
    # one, test_pair_1x128_* the paired one.
    tiles("block_1x128_pair", {})
    tiles("block_1x128_fused", {})
    linear_ops.clear_plans()
    yield fakes
    linear_ops.clear_plans()
    launch.reset_launch_cache()  # no fake kernel stays cached


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def same_tensor(a, b) -> bool:
    """The same bytes read the same way: address, dtype, shape and strides."""
    return _layout(a) == _layout(b)


def same_args(actual: tuple, expected: tuple) -> bool:
    if len(actual) != len(expected):
        return False
    for a, b in zip(actual, expected):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                return False
            if not same_tensor(a, b):
                return False
        elif type(a) is not type(b) or a != b:
            return False
    return True


def assert_same_launch(got: dict, want: dict) -> None:
    """Two recorded launches ran the same kernel on the same grid with the same constexprs
    and arguments."""
    assert (got["kernel"], got["grid"]) == (want["kernel"], want["grid"])
    assert got["constexprs"] == want["constexprs"]
    assert same_args(got["args"], want["args"])


OPTIONS = {
    "tensorwise": dict(recipe="tensorwise", fp8_dtype=E4M3, role="input", power_2_scale=True),
    "delayed": dict(recipe="delayed", fp8_dtype=E4M3, role="input", power_2_scale=False),
    "blockwise input": dict(recipe="blockwise", fp8_dtype=E4M3, role="input", power_2_scale=False),
    "blockwise weight": dict(recipe="blockwise", fp8_dtype=E4M3, role="weight", power_2_scale=True),
    "mxfp8": dict(recipe="mxfp8", fp8_dtype=E4M3, role="input", power_2_scale=False),
    "mxfp8 grad": dict(recipe="mxfp8", fp8_dtype=E5M2, role="grad", power_2_scale=False),
    # An input's transposed copy read at once (recomputed for wgrad in backward), not saved.
    "mxfp8 input read at once": dict(
        recipe="mxfp8", fp8_dtype=E4M3, role="input", power_2_scale=False, saved=False
    ),
}
# Hand-computed for M=256, K=384 with quantize.TILE_CONFIG: (kernel, grid) per launch.
GRIDS = {
    # amax: ceil(98304 / 16384) = 6 blocks -> 8 programs; cast_t: ceil(384/64) * ceil(256/256)
    "tensorwise": [("amax_partials_kernel", (8, 1, 1)), ("per_tensor_cast_kernel", (6, 1, 1))],
    "delayed": [("per_tensor_cast_kernel", (6, 1, 1))],
    # rows: ceil(384/128) * ceil(256/(64*1)); cols: ceil(256/128) * ceil(384/64)
    "blockwise input": [
        ("block_1x128_rows_kernel", (12, 1, 1)),
        ("block_128x1_cols_kernel", (12, 1, 1)),
    ],
    "blockwise weight": [("block_128x128_kernel", (6, 1, 1))],  # 2 x 3 blocks
    # rowwise values: ceil(256/32) * ceil(384/32); the kept columnwise bytes (4 chunks of 32
    # columns per program): ceil(256/32) * ceil(384/128)
    "mxfp8": [("mxfp8_quads_kernel", (96, 1, 1)), ("mxfp8_quads_kernel", (24, 1, 1))],
    "mxfp8 grad": [("mxfp8_quads_kernel", (96, 1, 1))],  # both copies as values, one pass
    "mxfp8 input read at once": [("mxfp8_quads_kernel", (96, 1, 1))],
}


def _extra(case: str) -> dict:
    if case == "delayed":
        return dict(scale=torch.tensor(2.0), amax_history=torch.zeros(8))
    return {}


def _expected_specs(case: str) -> list[tuple]:
    """(kernel, grid, constexprs) of each launch, from quantize.py's generic spec helpers."""
    options = OPTIONS[case]
    fp8_dtype, pow2 = options["fp8_dtype"], options["power_2_scale"]
    common = dict(fp8_dtype=fp8_dtype, power_2_scale=pow2, input_dtype=torch.bfloat16)
    if case in ("tensorwise", "delayed"):
        specs = []
        partials = 0
        if case == "tensorwise":
            kernel, grid, constexprs, _ = qpt.amax_partials_spec(M * K)
            specs.append((kernel, grid, constexprs))
            partials = grid[0]
        specs.append(
            qpt.per_tensor_cast_spec(
                M,
                K,
                write_row=True,
                write_t=True,
                record=case == "delayed",
                recipe=options["recipe"],
                amax_partials=partials,
                **common,
            )
        )
        return specs
    if case == "blockwise input":
        return [
            qbw.block_1x128_rows_spec(M, K, record=False, row_scale_t=True, **common),
            qbw.block_128x1_cols_spec(M, K, columnwise=False, write_t=True, record=False, **common),
        ]
    if case == "blockwise weight":
        return [qbw.block_128x128_spec(M, K, write_row=True, write_t=True, record=False, **common)]
    mx = dict(write_t=False, record=False, fp8_dtype=fp8_dtype)
    if case in ("mxfp8 grad", "mxfp8 input read at once"):
        return [qmx.mxfp8_spec(M, K, rowwise=True, columnwise=True, dequant=True, **mx)]
    return [
        qmx.mxfp8_spec(M, K, rowwise=True, columnwise=False, dequant=True, **mx),
        qmx.mxfp8_spec(M, K, rowwise=False, columnwise=True, dequant=False, **mx),
    ]


def _quantize(x, case, **extra):
    return linear_ops.quantize_operands(
        x, rowwise=True, transposed=True, **OPTIONS[case], **(extra or _extra(case))
    )


@pytest.mark.parametrize("case", list(OPTIONS))
def test_first_call_goes_through_triton_then_direct_with_the_same_launches(kernels, case):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    _quantize(x, case)
    first = kernels.take()
    _quantize(x, case)
    second = kernels.take()
    expected = GRIDS[case]
    assert [(r["path"], r["kernel"], r["grid"]) for r in first] == [
        ("jit", name, grid) for name, grid in expected
    ]
    assert [(r["path"], r["kernel"], r["grid"]) for r in second] == [
        ("direct", name, grid) for name, grid in expected
    ]
    assert [r["constexprs"] for r in first] == [r["constexprs"] for r in second]
    assert launch._direct["launches"] == len(expected)
    assert len(linear_ops._plans) == 1
    # The jit launches pass exactly the spec helpers' constexprs and launch options, on the
    # spec's kernel and grid; the direct launches pass every constexpr in signature order.
    specs = _expected_specs(case)
    assert len(specs) == len(first)
    for record, (kernel, grid, constexprs) in zip(first, specs):
        assert getattr(kernels, record["kernel"]) is kernel
        assert record["grid"] == (*grid, 1, 1)
        assert record["passed"] == constexprs
        assert set(record["options"]) == {"num_warps"}
    for record in second:
        names = getattr(kernels, record["kernel"]).constexpr_names
        assert list(record["constexprs"]) == names
    # Both calls read the same input; the second writes fresh outputs.
    for one, two in zip(first, second):
        assert one["args"][0] is x and two["args"][0] is x
        assert one["args"][1].data_ptr() != two["args"][1].data_ptr()


def test_tensorwise_partial_maxima_reach_the_cast(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    for _ in range(2):
        row, col = _quantize(x, "tensorwise")
        amax, cast = kernels.take()
        partials = amax["args"][1]
        programs = amax["grid"][0]
        assert programs == 8 and programs & (programs - 1) == 0
        assert programs <= qpt.AMAX_PARTIALS
        assert partials.dtype == torch.float32 and partials.shape == (programs,)
        assert same_args(amax["args"], (x, partials, M * K, 1))  # 6 blocks over 8 programs
        # 6 blocks over 8 programs: two programs have none, so the loads are masked.
        assert amax["constexprs"] == {"BLOCK": 16384, "EVEN": False}
        assert cast["constexprs"]["AMAX_PARTIALS"] == programs
        assert cast["constexprs"]["SCALE_GIVEN"] is False and cast["constexprs"]["POW2"] is True
        assert cast["constexprs"]["WRITE_ROW"] is True and cast["constexprs"]["WRITE_T"] is True
        args = cast["args"]
        assert args[3] is partials and args[4] is partials
        data, data_t, scale_inv = args[1], args[2], args[5]
        expected = qpt.per_tensor_cast_args(x, data, data_t, None, partials, scale_inv, None)
        assert same_args(args, expected)
        assert args[6] is scale_inv and args[7:] == (M, K)  # no history: a placeholder
        _check_per_tensor_operands(row, col, data, data_t, scale_inv)


def test_tensorwise_given_amax_skips_the_amax_pass(kernels):
    # The max|x| that the producer computed (producer_amax, in x's dtype): no amax pass, the
    # cast reads the one value (AMAX_PARTIALS 0), and the plan is not the amax pass's.
    x = torch.randn(M, K, dtype=torch.bfloat16)
    _quantize(x, "tensorwise")
    kernels.take()
    given = linear_ops.producer_amax(x)
    for _ in range(2):
        row, col = _quantize(x, "tensorwise", amax=given)
        (cast,) = kernels.take()
        assert cast["kernel"] == "per_tensor_cast_kernel" and cast["grid"] == (6, 1, 1)
        assert cast["constexprs"]["AMAX_PARTIALS"] == 0
        assert cast["constexprs"]["SCALE_GIVEN"] is False
        args = cast["args"]
        assert args[3] is given and args[4] is given
        expected = qpt.per_tensor_cast_args(x, args[1], args[2], None, given, args[5], None)
        assert same_args(args, expected)
        _check_per_tensor_operands(row, col, args[1], args[2], args[5])
    assert sorted(str(key[-3]) for key in linear_ops._plans) == ["None", "torch.bfloat16"]
    # An fp32 amax is a plan of its own: the kernel held for the bf16 one reads 2 bytes.
    _quantize(x, "tensorwise", amax=given.float())
    (cast,) = kernels.take()
    assert cast["path"] == "jit" and len(linear_ops._plans) == 3
    with pytest.raises(ValueError, match="0-d float"):
        _quantize(x, "tensorwise", amax=given.reshape(1))
    # Other recipes have no amax pass to skip: a given amax changes nothing.
    history = torch.zeros(8)
    _quantize(x, "delayed", scale=torch.tensor(2.0), amax_history=history, amax=given)
    (cast,) = kernels.take()
    assert cast["args"][4] is not given and cast["constexprs"]["SCALE_GIVEN"] is True


def test_producer_amax_is_the_nan_ignoring_max_magnitude():
    x = torch.tensor([[1.5, -7.25, float("nan")], [0.0, 3.0, -0.5]], dtype=torch.bfloat16)
    amax = linear_ops.producer_amax(x)
    assert amax.dim() == 0 and amax.dtype == torch.bfloat16 and float(amax) == 7.25
    x[1, 0] = float("-inf")
    assert float(linear_ops.producer_amax(x)) == float("inf")
    assert float(linear_ops.producer_amax(torch.full((2, 2), float("nan")))) == 0.0


def test_producer_amax_fused_into_a_norm_is_the_max_of_the_rounded_output():
    # Compiled, Inductor computes the row maxima in the norm's kernel from values it may not
    # have rounded to bf16 yet; rounding is monotonic, so the bf16 result still equals
    # max|output| of the bf16 output it stores. (A max taken in fp32 and kept in fp32 would
    # not: it is above the rounded max or below it for almost every input.)
    def norm_and_amax(x, weight):
        x32 = x.float()
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * weight).to(x.dtype)
        return out, linear_ops.producer_amax(out)

    torch.manual_seed(5)
    x = torch.randn(64, 512, dtype=torch.bfloat16) * 3
    weight = torch.rand(512) * 2 + 0.1
    torch._dynamo.reset()
    compiled = torch.compile(norm_and_amax)
    for trial in range(4):
        out, amax = compiled(x * (1 + trial / 7), weight)
        want = out.float().abs().max()
        assert amax.dtype == torch.bfloat16 and float(amax) == float(want)


def test_tensorwise_amax_programs_cover_every_block(kernels):
    # Blocks of 16384 elements -> the next power of two of programs, at most AMAX_PARTIALS:
    # 64 x 64: 1 block, 1 program; 272 x 1024: 17 blocks, 32 programs; 300 x 1000: 19 blocks
    # (the last one partial), 32 programs; 256 x 2048: 32 blocks, 32 programs of 1 block;
    # 2048 x 4096: 512 blocks, 256 programs of 2 blocks. Only the last two are covered
    # exactly (EVEN: no load masks).
    for (rows, cols), programs, blocks_per_program, even in (
        ((64, 64), 1, 1, False),
        ((272, 1024), 32, 1, False),
        ((300, 1000), 32, 1, False),
        ((256, 2048), 32, 1, True),
        ((2048, 4096), qpt.AMAX_PARTIALS, 2, True),
    ):
        x = torch.zeros(rows, cols, dtype=torch.bfloat16)
        _quantize(x, "tensorwise")
        amax, cast = kernels.take()
        assert amax["grid"] == (programs, 1, 1)
        assert amax["args"][2:] == (rows * cols, blocks_per_program)
        assert programs * blocks_per_program * 16384 >= rows * cols
        assert amax["constexprs"]["EVEN"] is even
        assert cast["constexprs"]["AMAX_PARTIALS"] == programs
        assert cast["args"][3].shape == (programs,)


def _check_per_tensor_operands(row, col, data, data_t, scale_inv):
    assert row.data.dtype == E4M3 and row.data.shape == (M, K) and row.data.stride() == (K, 1)
    assert col.data.dtype == E4M3 and col.data.shape == (K, M) and col.data.stride() == (M, 1)
    assert data.dtype == torch.uint8 and row.data.data_ptr() == data.data_ptr()
    assert data_t.dtype == torch.uint8 and col.data.data_ptr() == data_t.data_ptr()
    assert row.scale_inv is scale_inv and col.scale_inv is scale_inv
    assert scale_inv.dtype == torch.float32 and scale_inv.dim() == 0


def test_delayed_cast_reads_the_scale_and_records_into_the_history(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    scale, history = torch.tensor(2.0), torch.zeros(8)
    for _ in range(2):
        row, col = _quantize(x, "delayed", scale=scale, amax_history=history)
        (cast,) = kernels.take()
        args = cast["args"]
        assert args[3] is scale and args[4] is scale  # no amax: the scale stands in
        record = args[6]
        assert record.dtype == torch.int32 and record.shape == (8,)
        assert record.data_ptr() == history.data_ptr()
        assert cast["constexprs"]["SCALE_GIVEN"] is True and cast["constexprs"]["RECORD_AMAX"]
        assert cast["constexprs"]["AMAX_PARTIALS"] == 0 and cast["constexprs"]["POW2"] is False
        _check_per_tensor_operands(row, col, args[1], args[2], args[5])
        # The generic launch helper passes the same arguments and constexprs on the same grid.
        qpt.launch_per_tensor_cast(
            x,
            data=args[1],
            data_t=args[2],
            scale=scale,
            amax=None,
            scale_inv=args[5],
            record_bits=history.view(torch.int32),
            fp8_dtype=E4M3,
            recipe="delayed",
            power_2_scale=False,
        )
        (generic,) = kernels.take()
        assert_same_launch(generic, cast)


def test_delayed_without_history_writes_no_record(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    linear_ops.quantize_operands(
        x, rowwise=True, transposed=False, scale=torch.tensor(1.0), **OPTIONS["delayed"]
    )
    (cast,) = kernels.take()
    args = cast["args"]
    assert cast["constexprs"]["RECORD_AMAX"] is False and cast["constexprs"]["WRITE_T"] is False
    assert args[2] is args[1]  # the absent transposed output points at the rowwise bytes
    assert args[6] is args[5]  # the absent record points at scale_inv
    assert cast["grid"] == (ceil_div(K, 64) * ceil_div(M, 64 * 4), 1, 1)  # "cast" tiles


def test_delayed_needs_an_fp32_scale(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 scale"):
        _quantize(x, "delayed", scale=None, amax_history=torch.zeros(8))
    with pytest.raises(ValueError, match="fp32 scale"):
        _quantize(x, "delayed", scale=torch.tensor(2.0, dtype=torch.float64))
    assert kernels.log == [] and linear_ops._plans == {}


def _assert_1x128_operands(row, col, row_bytes, row_sinv_t, col_t, col_sinv, rows=M) -> None:
    """The blockwise input operands of a rows x K tensor (rows in (128, 256]) over the
    launch's buffers."""
    # Rowwise operand: bytes [rows, K], scale (rows, K/128) outer-dim-major.
    assert row.data.dtype == E4M3 and row.data.shape == (rows, K)
    assert row.data.data_ptr() == row_bytes.data_ptr()
    assert row.scale_inv.shape == (rows, 3) and row.scale_inv.stride() == (1, rows)
    assert row.scale_inv.data_ptr() == row_sinv_t.data_ptr()
    # Transposed operand [K, rows]: 1x128 blocks along rows, scale (K, 2) strides (1, K).
    assert col.data.dtype == E4M3 and col.data.shape == (K, rows)
    assert col.data.stride() == (rows, 1) and col.data.data_ptr() == col_t.data_ptr()
    assert col.scale_inv.shape == (K, 2) and col.scale_inv.stride() == (1, K)
    assert col.scale_inv.data_ptr() == col_sinv.data_ptr()


def test_blockwise_input_launches_and_layouts(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    for _ in range(2):
        row, col = _quantize(x, "blockwise input")
        rows_launch, cols_launch = kernels.take()
        r_args, c_args = rows_launch["args"], cols_launch["args"]
        row_bytes, row_sinv_t = r_args[1], r_args[2]
        col_t, col_sinv = c_args[1], c_args[2]
        assert same_args(r_args, (x, row_bytes, row_sinv_t, row_sinv_t, M, K))
        assert same_args(c_args, (x, col_t, col_sinv, col_t, col_sinv, M, K))
        assert row_sinv_t.shape == (3, M) and row_sinv_t.dtype == torch.float32
        assert col_t.shape == (K, M) and col_sinv.shape == (2, K)
        assert rows_launch["constexprs"]["ROW_SCALE_T"] is True
        assert cols_launch["constexprs"]["COLUMNWISE"] is False
        assert cols_launch["constexprs"]["WRITE_T"] is True
        _assert_1x128_operands(row, col, row_bytes, row_sinv_t, col_t, col_sinv)
        qbw.launch_block_1x128(
            x,
            row=row_bytes,
            row_sinv=row_sinv_t,
            col=None,
            col_sinv=col_sinv,
            col_t=col_t,
            record_bits=None,
            row_scale_t=True,
            fp8_dtype=E4M3,
            power_2_scale=False,
        )
        generic = kernels.take()
        for mine, theirs in zip((rows_launch, cols_launch), generic, strict=True):
            assert_same_launch(theirs, mine)


def test_blockwise_weight_launch_and_layouts(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    for _ in range(2):
        row, col = _quantize(x, "blockwise weight")
        (cast,) = kernels.take()
        args = cast["args"]
        data, scale_inv, data_t, scale_inv_t = args[1:5]
        assert same_args(args, (x, data, scale_inv, data_t, scale_inv_t, scale_inv, M, K))
        assert cast["constexprs"]["POW2"] is True and cast["constexprs"]["TILE"] == 128
        assert row.data.shape == (M, K) and row.data.data_ptr() == data.data_ptr()
        assert row.scale_inv is scale_inv
        assert scale_inv.shape == (2, 3) and scale_inv.stride() == (3, 1)
        assert col.data.shape == (K, M) and col.data.stride() == (M, 1)
        assert col.data.dtype == E4M3 and col.data.data_ptr() == data_t.data_ptr()
        assert col.scale_inv is scale_inv_t
        assert scale_inv_t.shape == (3, 2) and scale_inv_t.stride() == (2, 1)
        qbw.launch_block_128x128(
            x,
            data=data,
            scale_inv=scale_inv,
            data_t=data_t,
            scale_inv_t=scale_inv_t,
            record_bits=None,
            fp8_dtype=E4M3,
            power_2_scale=True,
        )
        (generic,) = kernels.take()
        assert_same_launch(generic, cast)


def test_mxfp8_grad_dequantized_launch_and_layouts(kernels):
    # The grad's copies are read at once: both as values, from one pass.
    x = torch.randn(M, K, dtype=torch.bfloat16)
    for _ in range(2):
        row, col = _quantize(x, "mxfp8 grad")
        (cast,) = kernels.take()
        args = cast["args"]
        values, col_values = args[1], args[3]
        # Absent scales, transpose and record point at the rowwise values.
        assert same_args(args, (x, values, values, col_values, values, values, values, M, K))
        assert cast["kernel"] == "mxfp8_quads_kernel" and "WRITE_T" not in cast["constexprs"]
        assert cast["constexprs"]["DEQUANT"] is True
        assert cast["constexprs"]["ROWWISE"] and cast["constexprs"]["COLUMNWISE"]
        assert row.scale_inv is None and col.scale_inv is None
        assert row.data is values and values.dtype == torch.bfloat16
        assert values.shape == (M, K) and values.stride() == (K, 1)
        assert col.data.shape == (K, M) and col.data.stride() == (1, K)
        assert col.data.data_ptr() == col_values.data_ptr() and col_values.shape == (M, K)
        qmx.launch_mxfp8(
            x,
            row=values,
            row_e=None,
            col=col_values,
            col_e=None,
            col_t=None,
            record_bits=None,
            fp8_dtype=E5M2,
            dequant=True,
        )
        (generic,) = kernels.take()
        assert_same_launch(generic, cast)


@pytest.mark.parametrize("role", ["input", "weight"])
def test_mxfp8_kept_copy_is_bytes_and_scales(kernels, role):
    # An input's or weight's transposed copy is kept for backward: 32x1 bytes and E8M0
    # scales (one byte per element), written by a second pass; the rowwise copy, read at
    # once by the forward GEMM, stays dequantized values.
    x = torch.randn(M, K, dtype=torch.bfloat16)
    options = dict(OPTIONS["mxfp8"], role=role)
    for _ in range(2):
        row, col = linear_ops.quantize_operands(x, rowwise=True, transposed=True, **options)
        values_cast, bytes_cast = kernels.take()
        args = values_cast["args"]
        values = args[1]
        assert same_args(args, (x, values, values, values, values, values, values, M, K))
        assert values_cast["constexprs"]["DEQUANT"] is True
        assert values_cast["constexprs"]["ROWWISE"] and not values_cast["constexprs"]["COLUMNWISE"]
        assert row.data is values and values.dtype == torch.bfloat16 and row.scale_inv is None
        args = bytes_cast["args"]
        col_bytes, col_e = args[3], args[4]
        assert same_args(args, (x, col_bytes, col_e, col_bytes, col_e, col_bytes, col_e, M, K))
        flags = bytes_cast["constexprs"]
        assert flags["DEQUANT"] is False and flags["COLUMNWISE"] and not flags["ROWWISE"]
        assert col_bytes.dtype == torch.uint8 and col_bytes.shape == (M, K)
        assert col_e.dtype == torch.uint8 and col_e.shape == (M // 32, K)
        assert col.data.dtype == E4M3 and col.data.shape == (K, M) and col.data.stride() == (1, K)
        assert col.data.data_ptr() == col_bytes.data_ptr() and col.scale_inv is col_e


def test_mxfp8_copy_read_at_once_is_values_from_one_pass(kernels):
    # The same input with saved=False (fc2's wgrad input, recomputed in backward and read at
    # once): both copies are dequantized values from one launch, as for a grad; the plan is
    # held apart from the saved one's.
    x = torch.randn(M, K, dtype=torch.bfloat16)
    _, saved_col = linear_ops.quantize_operands(
        x, rowwise=True, transposed=True, **OPTIONS["mxfp8"]
    )
    assert len(kernels.take()) == 2
    row, col = linear_ops.quantize_operands(
        x, rowwise=True, transposed=True, **OPTIONS["mxfp8 input read at once"]
    )
    (cast,) = kernels.take()
    assert cast["constexprs"]["DEQUANT"] is True
    assert cast["constexprs"]["ROWWISE"] and cast["constexprs"]["COLUMNWISE"]
    assert col.scale_inv is None and col.data.dtype == torch.bfloat16
    assert col.data.shape == (K, M) and saved_col.data.dtype == E4M3
    assert sorted(key[-1] for key in linear_ops._plans) == [False, True]


@pytest.mark.parametrize("rows", [256, 200])  # 200: a ragged last block of 8 rows
def test_emulated_mxfp8_gemm_dequantizes_kept_bytes(rows):
    # wgrad reading a kept input copy: the GEMM dequantizes the 32x1 bytes in the other
    # operand's dtype and multiplies, equal to the product of the dequantized values.
    from megatron.core.fp8 import quantize
    from megatron.core.fp8.reference import dequantize_reference

    torch.manual_seed(0)
    x = torch.randn(rows, K, dtype=torch.bfloat16) * 3
    x[:, :40] *= 50.0
    ref = quantize(
        x,
        recipe="mxfp8",
        fp8_dtype=E4M3,
        role="input",
        rowwise=False,
        columnwise=True,
        backend="reference",
    )
    kept = Fp8Operand(ref.columnwise_data.view(E4M3).t(), ref.columnwise_scale_inv)
    dy_t = Fp8Operand(torch.randn(64, rows, dtype=torch.bfloat16), None)
    got = linear_ops.gemm(dy_t, kept, recipe="mxfp8", out_dtype=torch.float32, fast_accum=False)
    values = dequantize_reference(
        ref.columnwise_data,
        ref.columnwise_scale_inv,
        recipe="mxfp8",
        fp8_dtype=E4M3,
        role="input",
        columnwise=True,
        out_dtype=torch.bfloat16,
    )
    assert torch.equal(got, torch.mm(dy_t.data, values).float())
    both_bytes = Fp8Operand(kept.data.t(), None)
    with pytest.raises(ValueError, match="at most one"):
        linear_ops.gemm(
            Fp8Operand(both_bytes.data, kept.scale_inv),
            kept,
            recipe="mxfp8",
            out_dtype=torch.float32,
            fast_accum=False,
        )


def _sites(plan) -> list:
    names = ("amax", "cast", "col_cast", "rows_site", "cols_site", "fused_site")
    return [getattr(plan, name) for name in names if getattr(plan, name, None) is not None]


@pytest.mark.parametrize("case", list(OPTIONS))
def test_a_misaligned_input_is_held_separately(kernels, case):
    aligned = torch.randn(M, K, dtype=torch.bfloat16)
    misaligned = torch.empty(M * K + 8, dtype=torch.bfloat16)[1 : 1 + M * K].view(M, K)
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 == 2
    n = len(GRIDS[case])
    paths = []
    for x in (aligned, aligned, misaligned, misaligned, aligned):
        _quantize(x, case)
        launches = kernels.take()
        assert all(record["args"][0] is x for record in launches)
        paths.append([record["path"] for record in launches])
    assert paths == [["jit"] * n, ["direct"] * n, ["jit"] * n, ["direct"] * n, ["direct"] * n]
    (plan,) = linear_ops._plans.values()  # one plan: alignment is not part of its key
    sites = _sites(plan)
    assert len(sites) == n and all(len(site._held) == 2 for site in sites)
    assert len(launch._compiled) == 2 * n


def test_delayed_scale_and_history_alignment_are_part_of_the_key(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    # What a flush leaves: the scales and histories of several metas as rows of one tensor.
    scales, histories = torch.tensor([1.0, 2.0]), torch.zeros(2, 3)
    scale_row1, history_row1 = scales.unbind(0)[1], histories.unbind(0)[1]
    assert scale_row1.data_ptr() % 16 == 4 and history_row1.data_ptr() % 16 == 12
    calls = [
        (scales.unbind(0)[0], histories.unbind(0)[0]),
        (scale_row1, histories.unbind(0)[0]),
        (scales.unbind(0)[0], history_row1),
        (scale_row1, history_row1),
    ]
    paths = []
    for _ in range(2):
        for scale, history in calls:
            _quantize(x, "delayed", scale=scale, amax_history=history)
            (cast,) = kernels.take()
            assert cast["args"][3] is scale
            assert cast["args"][6].data_ptr() == history.data_ptr()
            paths.append(cast["path"])
    assert paths == ["jit"] * 4 + ["direct"] * 4
    (plan,) = linear_ops._plans.values()
    assert sorted(plan.cast._held) == [
        (True, False, False),
        (True, False, True),
        (True, True, False),
        (True, True, True),
    ]


def test_cleared_plans_are_rebuilt_from_the_compiled_kernels(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    _quantize(x, "tensorwise")
    old_plan = next(iter(linear_ops._plans.values()))
    kernels.take()
    linear_ops.clear_plans()
    assert linear_ops._plans == {}
    _quantize(x, "tensorwise")
    # A new plan, whose sites find the kernels in launch's process-wide cache: no compile.
    assert [r["path"] for r in kernels.take()] == ["direct", "direct"]
    (new_plan,) = linear_ops._plans.values()
    assert new_plan is not old_plan and all(len(site._held) == 1 for site in _sites(new_plan))


def test_each_shape_and_output_set_gets_its_own_plan(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    _quantize(x, "blockwise input")
    linear_ops.quantize_operands(x, rowwise=True, transposed=False, **OPTIONS["blockwise input"])
    linear_ops.quantize_operands(
        x[:128], rowwise=True, transposed=True, **OPTIONS["blockwise input"]
    )
    assert len(linear_ops._plans) == 3
    launches = kernels.take()
    assert [r["kernel"] for r in launches] == [
        "block_1x128_rows_kernel",
        "block_128x1_cols_kernel",
        "block_1x128_rows_kernel",
        "block_1x128_rows_kernel",
        "block_128x1_cols_kernel",
    ]
    # 128 rows: ceil(384/128) * ceil(128/64) rowwise programs, 1 * ceil(384/64) columnwise.
    assert launches[3]["grid"] == (6, 1, 1) and launches[4]["grid"] == (6, 1, 1)
    assert launches[3]["args"][4:] == (128, K)


# _direct_scaled_mm: torch._scaled_mm exactly as gemm.scaled_mm calls it, without its checks.


class ScaledMmRecorder:
    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, a, b, *, scale_a, scale_b, out_dtype, use_fast_accum, out=None):
        # cuBLASLt refuses an operand, scale or output it cannot read 16-byte aligned.
        for tensor in (a, b, scale_a, scale_b) if out is None else (a, b, scale_a, scale_b, out):
            assert launch.aligned_16(tensor), tensor.data_ptr()
        self.calls.append((a, b, scale_a, scale_b, out_dtype, use_fast_accum))
        result = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)
        return result if out is None else out.copy_(result)


@pytest.fixture
def scaled_mm(blockwise_probe, monkeypatch):
    recorder = ScaledMmRecorder()
    monkeypatch.setattr(torch, "_scaled_mm", recorder)
    monkeypatch.setattr(cuda_gemm, "_blockwise_unavailable", lambda device: None)
    blockwise_probe("torch._scaled_mm")
    return recorder


def _fp8(rows, cols, dtype=E4M3, seed=0):
    values = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) * 8 - 4
    return values.to(dtype)


def _rand(*shape, seed=1):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) + 0.5


def _same_call(direct: tuple, general: tuple) -> None:
    assert len(direct) == len(general) == 6
    for one, two in zip(direct[:4], general[:4]):
        assert same_tensor(one, two), (one.shape, one.stride(), two.shape, two.stride())
    assert direct[4:] == general[4:]


def _operands(kind: str, rows: int, k: int, n: int):
    if kind == "per-tensor":
        a = Fp8Operand(_fp8(rows, k), torch.tensor(0.5))
        b = Fp8Operand(_fp8(n, k, E5M2, seed=2), torch.tensor(0.25))
    elif kind == "1x128 x 128x128":
        # Fprop / dgrad: a 1x128 input or grad, b a 128x128 weight (contiguous grid).
        a = Fp8Operand(_fp8(rows, k), _rand(k // 128, rows).t())
        b = Fp8Operand(_fp8(n, k, seed=2), _rand(ceil_div(n, 128), k // 128, seed=3))
    else:
        # Wgrad: both transposed 1x128 operands, scales (R, K/128) with strides (1, R).
        a = Fp8Operand(_fp8(rows, k, E5M2), _rand(k // 128, rows).t())
        b = Fp8Operand(_fp8(n, k, seed=2), _rand(k // 128, n, seed=3).t())
    return a, b


@pytest.mark.parametrize(
    "recipe, kind, rows, k, n, fast_accum",
    [
        ("tensorwise", "per-tensor", 64, 256, 128, True),
        ("delayed", "per-tensor", 40, 48, 32, False),  # per-tensor rows need no alignment
        ("blockwise", "1x128 x 128x128", 64, 512, 256, True),  # fast_accum: ignored
        ("blockwise", "1x128 x 128x128", 32, 1024, 144, False),
        ("blockwise", "1x128 x 1x128", 64, 256, 128, False),
    ],
)
def test_direct_gemm_calls_scaled_mm_as_the_general_path(
    scaled_mm, monkeypatch, recipe, kind, rows, k, n, fast_accum
):
    a, b = _operands(kind, rows, k, n)
    if kind != "per-tensor":
        assert a.scale_inv.shape == (rows, k // 128) and a.scale_inv.stride() == (1, rows)
    general = cuda_gemm.scaled_mm(
        a.data,
        b.data,
        a_scale_inv=a.scale_inv,
        b_scale_inv=b.scale_inv,
        recipe=recipe,
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )
    assert len(scaled_mm.calls) == 1

    def no_general_path(*args, **kwargs):
        raise AssertionError("linear_ops.gemm took the general path")

    monkeypatch.setattr(linear_ops, "scaled_mm", no_general_path)
    out = linear_ops.gemm(a, b, recipe=recipe, out_dtype=torch.bfloat16, fast_accum=fast_accum)
    assert len(scaled_mm.calls) == 2
    _same_call(scaled_mm.calls[1], scaled_mm.calls[0])
    mat1, mat2, scale_a, scale_b, out_dtype, use_fast_accum = scaled_mm.calls[1]
    assert mat1 is a.data and mat2.shape == (k, n) and mat2.stride() == (1, k)
    assert out_dtype == torch.bfloat16
    assert use_fast_accum is (fast_accum if recipe != "blockwise" else False)
    if kind == "per-tensor":
        assert scale_a is a.scale_inv and scale_b is b.scale_inv
    else:
        assert scale_a.stride() == (1, rows)
        assert same_tensor(scale_b, b.scale_inv.t())
    assert out.shape == general.shape == (rows, n) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "recipe, kind, rows, k, n, padded",
    [
        ("tensorwise", "per-tensor", 64, 40, 128, ((64, 48), (48, 128))),  # K % 16
        ("delayed", "per-tensor", 64, 256, 120, ((64, 256), (256, 128))),  # N % 16
        # K % 512: the general path pads the 128x128 grid's rows to 4 blocks, not K (a torch
        # that takes such grids, as this recorder does: test_blockwise_scale_grids.py).
        ("blockwise", "1x128 x 128x128", 64, 256, 256, ((64, 256), (256, 256))),
        ("blockwise", "1x128 x 1x128", 40, 256, 128, ((48, 256), (256, 128))),  # rows % 16
    ],
)
def test_direct_gemm_declines_what_needs_padding(scaled_mm, recipe, kind, rows, k, n, padded):
    a, b = _operands(kind, rows, k, n)
    direct = linear_ops._direct_scaled_mm(
        a, b, recipe=recipe, out_dtype=torch.float32, fast_accum=False
    )
    assert direct is None and scaled_mm.calls == []
    out = linear_ops.gemm(a, b, recipe=recipe, out_dtype=torch.float32, fast_accum=False)
    (call,) = scaled_mm.calls  # the general path, which padded the operands
    assert (tuple(call[0].shape), tuple(call[1].shape)) == padded
    assert out.shape == (rows, n)


def test_direct_gemm_declines_a_non_contiguous_operand(scaled_mm):
    a, b = _operands("per-tensor", 64, 256, 128)
    strided = Fp8Operand(_fp8(256, 64).t(), a.scale_inv)
    assert (
        linear_ops._direct_scaled_mm(
            strided, b, recipe="tensorwise", out_dtype=torch.float32, fast_accum=True
        )
        is None
    )
    assert scaled_mm.calls == []


def _at_4_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The scale's values, shape and strides 4 bytes into a storage, as expert 1's scale of a
    stacked weight is (fp8_experts.ExpertWeight)."""
    shifted = torch.ones(scale.numel() + 1).as_strided(scale.shape, scale.stride(), 1)
    return shifted.copy_(scale)


@pytest.mark.parametrize(
    "recipe, kind",
    [("delayed", "per-tensor"), ("blockwise", "1x128 x 128x128"), ("blockwise", "1x128 x 1x128")],
)
def test_a_scale_cublas_cannot_read_reaches_it_as_an_aligned_copy(
    scaled_mm, monkeypatch, recipe, kind
):
    a, b = _operands(kind, 64, 512, 256)
    general_calls = []
    general = linear_ops.scaled_mm
    monkeypatch.setattr(
        linear_ops, "scaled_mm", lambda *args, **kw: general_calls.append(1) or general(*args, **kw)
    )
    options = dict(recipe=recipe, out_dtype=torch.bfloat16, fast_accum=False)
    linear_ops.gemm(a, b, **options)
    assert general_calls == []  # aligned scales: the direct path
    shifted = [Fp8Operand(op.data, _at_4_bytes(op.scale_inv)) for op in (a, b)]
    for op, original in zip(shifted, (a, b)):
        assert op.scale_inv.data_ptr() % 16 == 4 and torch.equal(op.scale_inv, original.scale_inv)
        assert op.scale_inv.stride() == original.scale_inv.stride()
    assert linear_ops._direct_scaled_mm(*shifted, **options) is None
    linear_ops.gemm(*shifted, **options)  # the general path, which copies the scales
    assert general_calls == [1]
    direct, general_call = scaled_mm.calls  # the recorder asserts every scale aligned
    for one, two in zip(general_call[:2], direct[:2]):  # the FP8 operands, as bytes
        assert torch.equal(one.view(torch.uint8), two.view(torch.uint8))
    for one, two in zip(general_call[2:4], direct[2:4]):
        assert torch.equal(one, two) and one.stride() == two.stride()
    assert general_call[4:] == direct[4:]


def test_operands_and_outputs_off_cublas_alignment_take_the_general_path(scaled_mm):
    """FP8 bytes 1 byte into their storage (a parameter packed after one of odd size) reach
    torch._scaled_mm as an aligned copy; a main-grad slot off alignment is not written in place."""
    a, b = _operands("per-tensor", 64, 256, 128)
    options = dict(recipe="tensorwise", out_dtype=torch.float32, fast_accum=False)
    bytes_1_in = torch.zeros(b.data.numel() + 1, dtype=torch.uint8)[1:]
    shifted = Fp8Operand(
        bytes_1_in.copy_(b.data.view(torch.uint8).reshape(-1)).view(E5M2).view(b.data.shape),
        b.scale_inv,
    )
    assert not launch.aligned_16(shifted.data)
    assert linear_ops._direct_scaled_mm(a, shifted, **options) is None and scaled_mm.calls == []
    linear_ops.gemm(a, shifted, **options)
    (call,) = scaled_mm.calls
    assert torch.equal(call[1].t().contiguous().view(torch.uint8), b.data.view(torch.uint8))
    slot = torch.zeros(64 * 128 + 1)[1:].view(64, 128)  # 4 bytes in
    assert linear_ops._direct_scaled_mm(a, b, out=slot, **options) is None
    assert linear_ops._direct_scaled_mm(a, b, out=torch.zeros(64, 128), **options) is not None


def test_direct_gemm_waits_until_cublas_has_taken_blockwise_scales(
    blockwise_probe, scaled_mm, monkeypatch
):
    a, b = _operands("1x128 x 128x128", 64, 512, 256)
    blockwise_probe("untried")
    assert cuda_gemm.blockwise_gemm_path() == "untried"
    options = dict(recipe="blockwise", out_dtype=torch.bfloat16, fast_accum=False)
    assert linear_ops._direct_scaled_mm(a, b, **options) is None
    assert scaled_mm.calls == []
    # The general path runs (and records that cuBLAS took the scales); then the direct one.
    linear_ops.gemm(a, b, **options)
    assert cuda_gemm.blockwise_gemm_path() == "torch._scaled_mm"
    assert linear_ops._direct_scaled_mm(a, b, **options) is not None
    assert len(scaled_mm.calls) == 2
    _same_call(scaled_mm.calls[1], scaled_mm.calls[0])
    blockwise_probe("emulated: not a CUDA tensor")
    assert linear_ops._direct_scaled_mm(a, b, **options) is None
    assert len(scaled_mm.calls) == 2


def test_a_blockwise_shape_cublas_refuses_falls_back_to_the_general_path(
    blockwise_probe, monkeypatch
):
    """cuBLASLt may refuse one blockwise shape after taking others: the direct call returns
    None and the general path records the refusal and emulates, as before the shortcut."""
    calls = []

    def refusing(a, b, **kwargs):
        calls.append(tuple(a.shape))
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    monkeypatch.setattr(cuda_gemm, "_blockwise_unavailable", lambda device: None)
    blockwise_probe("torch._scaled_mm")
    a, b = _operands("1x128 x 128x128", 64, 512, 256)
    options = dict(recipe="blockwise", out_dtype=torch.float32, fast_accum=False)
    assert linear_ops._direct_scaled_mm(a, b, **options) is None
    out = linear_ops.gemm(a, b, **options)
    assert calls == [(64, 512), (64, 512), (64, 512)]  # direct, general, then emulated
    assert cuda_gemm.blockwise_gemm_path().startswith("emulated: torch._scaled_mm refused")
    expected = cuda_gemm.emulated_mm(
        a.data,
        b.data,
        a_scale_inv=a.scale_inv,
        b_scale_inv=b.scale_inv,
        recipe="blockwise",
        out_dtype=torch.float32,
    )
    assert torch.equal(out, expected)


def test_tensorwise_ignores_a_scale_and_history_meant_for_delayed(kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    history = torch.zeros(8)
    _quantize(x, "tensorwise", scale=torch.tensor(2.0), amax_history=history)
    amax, cast = kernels.take()
    assert cast["constexprs"]["RECORD_AMAX"] is False and cast["constexprs"]["SCALE_GIVEN"] is False
    partials = amax["args"][1]
    assert cast["args"][3] is partials and cast["args"][4] is partials
    assert all(arg is not history for arg in cast["args"] if isinstance(arg, torch.Tensor))
    assert len(linear_ops._plans) == 1 and next(iter(linear_ops._plans))[9] is False


def test_under_torch_compile_no_pointer_is_read_and_no_plan_is_kept(kernels, monkeypatch):
    """Traced by torch.compile: data_ptr() cannot be traced, and a global cache written while
    tracing would be a side effect; every launch goes through kernel[grid], which is traced."""
    x = torch.randn(M, K, dtype=torch.bfloat16)
    _quantize(x, "delayed")  # an eager call first: its plan holds the compiled kernel
    kernels.take()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def no_pointer(self):
        raise AssertionError("data_ptr() read while tracing")

    monkeypatch.setattr(torch.Tensor, "data_ptr", no_pointer)
    for case in OPTIONS:
        # delayed without a history to record into (a recompute): traced like the others.
        _quantize(x, case, **({"scale": torch.tensor(2.0)} if case == "delayed" else {}))
        records = kernels.take()
        # tensorwise: max|x| is computed in the graph (producer_amax), no amax pass.
        expected = [name for name, _ in GRIDS[case] if name != "amax_partials_kernel"]
        assert [(r["path"], r["kernel"]) for r in records] == [("jit", name) for name in expected]
        if case == "tensorwise":
            amax = records[0]["args"][4]
            assert amax.dim() == 0 and amax.dtype == torch.bfloat16
            assert float(amax) == float(x.abs().max())
            assert records[0]["constexprs"]["AMAX_PARTIALS"] == 0
    # amax_in_graph off: the amax pass again.
    previous = set_debug_config(amax_in_graph=False)
    try:
        _quantize(x, "tensorwise")
    finally:
        set_debug_config(**previous)
    assert [r["kernel"] for r in kernels.take()] == [name for name, _ in GRIDS["tensorwise"]]
    assert len(linear_ops._plans) == 1  # only the eager call's plan


def test_under_torch_compile_a_recording_quantization_is_the_custom_op(kernels, monkeypatch):
    # Delayed scaling with a history: the opaque op megatron_fp8::quantize_operands_recording,
    # which declares the history it writes; nothing is traced.
    x = torch.randn(M, K, dtype=torch.bfloat16)
    history = torch.zeros(8)
    calls = []

    def recording_op(x2d, recipe, fp8_dtype, role, rowwise, transposed, power_2, scale, hist):
        calls.append((tuple(x2d.shape), recipe, role, rowwise, transposed, hist is history))
        empty = torch.empty(0, dtype=torch.uint8)
        return torch.empty(M, K, dtype=torch.uint8), empty, torch.ones(())

    monkeypatch.setattr(linear_ops, "_recording_op", recording_op)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    row, col = _quantize(x, "delayed", scale=torch.tensor(2.0), amax_history=history)
    assert calls == [((M, K), "delayed", "input", True, True, True)]
    assert row.data.dtype == E4M3 and row.data.shape == (M, K)
    assert not kernels.take()


def test_the_plan_cache_is_bounded(kernels):
    previous = set_debug_config(max_plans=3)
    try:
        for rows in (16, 32, 48):
            _quantize(torch.randn(rows, K, dtype=torch.bfloat16), "mxfp8")
        assert len(linear_ops._plans) == 3
        _quantize(torch.randn(64, K, dtype=torch.bfloat16), "mxfp8")
    finally:
        set_debug_config(**previous)
    assert [key[6] for key in linear_ops._plans] == [torch.Size([64, K])]


# The fused 1x128 kernel (TILE_CONFIG's choice when the paired one is off): both copies from
# one launch.


@pytest.fixture
def fused_kernels(tiles, kernels, monkeypatch):
    tiles("block_1x128_fused", dict(num_warps=4))
    return kernels


def test_fused_1x128_launch_layouts_and_generic_twin(fused_kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    for path in ("jit", "direct"):
        row, col = _quantize(x, "blockwise input")
        (fused,) = fused_kernels.take()
        assert (fused["path"], fused["kernel"]) == (path, "block_1x128_fused_kernel")
        assert fused["grid"] == (2 * 3, 1, 1)  # ceil(256/128) * ceil(384/128) tiles
        args = fused["args"]
        row_bytes, row_sinv_t, col_t, col_sinv = args[1], args[2], args[3], args[4]
        assert same_args(args, (x, row_bytes, row_sinv_t, col_t, col_sinv, col_t, row_sinv_t, M, K))
        constexprs = fused["constexprs"]
        assert constexprs["ROW_SCALE_T"] is True and constexprs["WRITE_T"] is True
        assert constexprs["COLUMNWISE"] is False and constexprs["RECORD_AMAX"] is False
        assert row_sinv_t.shape == (3, M) and col_sinv.shape == (2, K)
        # The operands read the same buffers as with the two kernels.
        _assert_1x128_operands(row, col, row_bytes, row_sinv_t, col_t, col_sinv)
    qbw.launch_block_1x128(
        x,
        row=row_bytes,
        row_sinv=row_sinv_t,
        col=None,
        col_sinv=col_sinv,
        col_t=col_t,
        record_bits=None,
        row_scale_t=True,
        fp8_dtype=E4M3,
        power_2_scale=False,
    )
    (generic,) = fused_kernels.take()
    assert_same_launch(generic, fused)


def test_fused_1x128_only_when_both_copies_are_wanted(fused_kernels):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    linear_ops.quantize_operands(x, rowwise=True, transposed=False, **OPTIONS["blockwise input"])
    linear_ops.quantize_operands(x, rowwise=False, transposed=True, **OPTIONS["blockwise input"])
    assert [r["kernel"] for r in fused_kernels.take()] == [
        "block_1x128_rows_kernel",
        "block_128x1_cols_kernel",
    ]
    # The API with both copies and an amax record: one fused launch, columnwise in x's shape.
    row, row_sinv = torch.empty(M, K, dtype=torch.uint8), torch.empty(M, 3)
    col, col_sinv = torch.empty(M, K, dtype=torch.uint8), torch.empty(2, K)
    bits = torch.zeros((), dtype=torch.int32)
    qbw.launch_block_1x128(
        x,
        row=row,
        row_sinv=row_sinv,
        col=col,
        col_sinv=col_sinv,
        col_t=None,
        record_bits=bits,
        row_scale_t=False,
        fp8_dtype=E4M3,
        power_2_scale=True,
    )
    (api,) = fused_kernels.take()
    assert api["kernel"] == "block_1x128_fused_kernel"
    assert same_args(api["args"], (x, row, row_sinv, col, col_sinv, col, bits, M, K))
    constexprs = api["constexprs"]
    assert (constexprs["COLUMNWISE"], constexprs["WRITE_T"]) == (True, False)
    assert (constexprs["RECORD_AMAX"], constexprs["ROW_SCALE_T"]) == (True, False)


def test_fused_1x128_needs_rows_divisible_by_4(fused_kernels):
    x = torch.randn(M - 2, K, dtype=torch.bfloat16)
    linear_ops.quantize_operands(x, rowwise=True, transposed=True, **OPTIONS["blockwise input"])
    assert [r["kernel"] for r in fused_kernels.take()] == [
        "block_1x128_rows_kernel",
        "block_128x1_cols_kernel",
    ]


# The paired 1x128 kernel (TILE_CONFIG's default): both copies from one launch, the rows and
# cols kernels' tiles of each 128x128 tile as consecutive programs.

PAIR = dict(BM=64, BK=64, TRANS_X=False, num_warps=4)


@pytest.fixture
def pair_kernels(tiles, kernels, monkeypatch):
    tiles("block_1x128_pair", dict(PAIR))
    tiles("block_1x128_fused", dict(num_warps=4))
    return kernels


def test_pair_is_tile_configs_default():
    assert qc.tile_config("block_1x128_pair") == PAIR


@pytest.mark.parametrize("rows", [M, M - 2])
def test_pair_1x128_launch_layouts_any_row_count(pair_kernels, rows):
    """Both operands from one paired launch, also where rows % 4 != 0 (the fused kernel's
    condition): 4 programs per 128x128 tile, the fused kernel's arguments."""
    x = torch.randn(rows, K, dtype=torch.bfloat16)
    for path in ("jit", "direct"):
        row, col = _quantize(x, "blockwise input")
        (pair,) = pair_kernels.take()
        assert (pair["path"], pair["kernel"]) == (path, "block_1x128_pair_kernel")
        # ceil(rows/128) * ceil(384/128) tiles, 128/64 rows + 128/64 cols programs each
        assert pair["grid"] == (2 * 3 * 4, 1, 1)
        args = pair["args"]
        row_bytes, row_sinv_t, col_t, col_sinv = args[1], args[2], args[3], args[4]
        assert same_args(
            args, (x, row_bytes, row_sinv_t, col_t, col_sinv, col_t, row_sinv_t, rows, K)
        )
        constexprs = pair["constexprs"]
        assert {name: constexprs[name] for name in ("BM", "BK", "TRANS_X")} == dict(
            BM=64, BK=64, TRANS_X=False
        )
        assert constexprs["ROW_SCALE_T"] is True and constexprs["WRITE_T"] is True
        assert constexprs["COLUMNWISE"] is False and constexprs["RECORD_AMAX"] is False
        assert row_sinv_t.shape == (3, rows) and col_sinv.shape == (2, K)
        _assert_1x128_operands(row, col, row_bytes, row_sinv_t, col_t, col_sinv, rows)


def test_pair_1x128_grid_follows_its_tile_sizes_and_only_transposes(
    tiles, pair_kernels, monkeypatch
):
    """The API: with the transposed copy (and an amax record) the paired launch, its grid from
    BM and BK; with the columnwise bytes in x's shape the fused kernel (faster there)."""
    tiles("block_1x128_pair", dict(PAIR, BM=128, BK=32))
    x = torch.randn(M, K, dtype=torch.bfloat16)
    bits = torch.zeros((), dtype=torch.int32)
    row, row_sinv = torch.empty(M, K, dtype=torch.uint8), torch.empty(M, 3)
    col, col_sinv = torch.empty(M, K, dtype=torch.uint8), torch.empty(2, K)
    col_t = torch.empty(K, M, dtype=torch.uint8)
    common = dict(
        row=row,
        row_sinv=row_sinv,
        col_sinv=col_sinv,
        record_bits=bits,
        row_scale_t=False,
        fp8_dtype=E4M3,
        power_2_scale=True,
    )
    qbw.launch_block_1x128(x, col=None, col_t=col_t, **common)
    qbw.launch_block_1x128(x, col=col, col_t=None, **common)
    transposed, in_shape = pair_kernels.take()
    assert transposed["kernel"] == "block_1x128_pair_kernel"
    assert transposed["grid"] == (2 * 3 * (1 + 4),)  # 128/128 rows + 128/32 cols programs
    assert same_args(transposed["args"], (x, row, row_sinv, col_t, col_sinv, col_t, bits, M, K))
    constexprs = transposed["constexprs"]
    assert (constexprs["COLUMNWISE"], constexprs["WRITE_T"]) == (False, True)
    assert (constexprs["RECORD_AMAX"], constexprs["ROW_SCALE_T"]) == (True, False)
    assert (constexprs["BM"], constexprs["BK"]) == (128, 32)
    assert in_shape["kernel"] == "block_1x128_fused_kernel" and in_shape["grid"] == (6,)
    assert same_args(in_shape["args"], (x, row, row_sinv, col, col_sinv, col, bits, M, K))
    assert (in_shape["constexprs"]["COLUMNWISE"], in_shape["constexprs"]["WRITE_T"]) == (
        True,
        False,
    )


def test_pair_off_falls_back_to_fused_then_two_kernels(tiles, pair_kernels, monkeypatch):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    tiles("block_1x128_pair", {})
    _quantize(x, "blockwise input")
    linear_ops.clear_plans()
    tiles("block_1x128_fused", {})
    _quantize(x, "blockwise input")
    assert [r["kernel"] for r in pair_kernels.take()] == [
        "block_1x128_fused_kernel",
        "block_1x128_rows_kernel",
        "block_128x1_cols_kernel",
    ]


def test_mxfp8_quads_kernel_unless_transposed_or_configured_off(tiles, kernels, monkeypatch):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    row, col = torch.empty(M, K, dtype=torch.uint8), torch.empty(M, K, dtype=torch.uint8)
    row_e, col_e = torch.empty(M, K // 32, dtype=torch.uint8), torch.empty(8, K, dtype=torch.uint8)
    col_t, bits = torch.empty(K, M, dtype=torch.uint8), torch.zeros((), dtype=torch.int32)
    outputs = dict(
        row=row, row_e=row_e, col=col, col_e=col_e, record_bits=bits, fp8_dtype=E4M3, dequant=False
    )
    chunks = qc.tile_config("mxfp8_quads")["CHUNKS"]
    qmx.launch_mxfp8(x, col_t=None, **outputs)
    qmx.launch_mxfp8(x, col_t=col_t, **outputs)
    tiles("mxfp8_quads", {})
    qmx.launch_mxfp8(x, col_t=None, **outputs)
    quads, transposed, off = kernels.take()
    assert quads["kernel"] == "mxfp8_quads_kernel"
    assert quads["grid"] == (8 * ceil_div(K, 32 * chunks),)
    assert same_args(quads["args"], (x, row, row_e, col, col_e, row, bits, M, K))
    assert quads["constexprs"]["RECORD_AMAX"] is True and "WRITE_T" not in quads["constexprs"]
    # K = 384: whole 128-column words of E8M0 bytes per row, packed when CHUNKS == 4.
    assert quads["constexprs"]["E_WORDS"] is (chunks == 4)
    assert transposed["kernel"] == "mxfp8_kernel" and transposed["constexprs"]["WRITE_T"]
    assert same_args(transposed["args"], (x, row, row_e, col, col_e, col_t, bits, M, K))
    assert off["kernel"] == "mxfp8_kernel" and off["constexprs"]["WRITE_T"] is False
    assert same_args(off["args"], quads["args"])


@pytest.mark.parametrize(
    ("cols", "chunks", "transposed", "rowwise", "dequant", "words"),
    [
        (384, 4, False, True, False, True),  # K % 128 == 0: one int32 per row and program
        (352, 4, False, True, False, False),  # K % 128 != 0: the last word would be partial
        (384, 2, False, True, False, False),  # quads kernel, two chunks: not a whole word
        (384, 4, False, False, False, False),  # no rowwise copy: no rowwise E8M0 bytes
        (384, 4, False, True, True, False),  # dequantized values: no E8M0 bytes at all
        (320, 2, True, True, False, True),  # mxfp8_kernel, K % 64 == 0: one int16 per row
        (352, 2, True, True, False, False),  # mxfp8_kernel, K % 64 != 0
        (384, 4, True, True, False, True),  # mxfp8_kernel, four chunks: one int32
        (384, 1, True, True, False, False),  # mxfp8_kernel, one chunk: a single byte
    ],
)
def test_mxfp8_packed_e8m0_words_only_where_whole(
    tiles, kernels, monkeypatch, cols, chunks, transposed, rowwise, dequant, words
):
    config = dict(CHUNKS=chunks, num_warps=1)
    for key in ("mxfp8", "mxfp8_quads", "mxfp8_dequantized", "mxfp8_quads_dequantized"):
        tiles(key, dict(config))
    kernel, grid, constexprs = qmx.mxfp8_spec(
        M,
        cols,
        rowwise=rowwise,
        columnwise=True,
        write_t=transposed,
        record=False,
        fp8_dtype=E4M3,
        dequant=dequant,
    )
    expected = kernels.mxfp8_kernel if transposed else kernels.mxfp8_quads_kernel
    assert kernel is expected
    assert constexprs["E_WORDS"] is words
    assert grid == (8 * ceil_div(cols, 32 * chunks),)


def test_mxfp8_words_only_into_a_contiguous_aligned_row_e(kernels):
    """launch_mxfp8 stores words only where row_e is a contiguous buffer at a 4-byte-aligned
    address; a view at an odd offset (or a strided one) gets the byte stores."""
    x = torch.randn(M, K, dtype=torch.bfloat16)
    row, col = torch.empty(M, K, dtype=torch.uint8), torch.empty(M, K, dtype=torch.uint8)
    col_e = torch.empty(8, K, dtype=torch.uint8)
    buffer = torch.empty(M * K // 32 + 2, dtype=torch.uint8)
    aligned = buffer[:-2].view(M, K // 32)
    odd = buffer[1:-1].view(M, K // 32)
    strided = torch.empty(M, K // 16, dtype=torch.uint8)[:, ::2]
    for row_e in (aligned, odd, strided):
        qmx.launch_mxfp8(
            x,
            row=row,
            row_e=row_e,
            col=col,
            col_e=col_e,
            col_t=None,
            record_bits=None,
            fp8_dtype=E4M3,
            dequant=False,
        )
    launches = kernels.take()
    assert aligned.data_ptr() % 4 == 0 and odd.data_ptr() % 4 != 0
    assert [r["constexprs"]["E_WORDS"] for r in launches] == [True, False, False]
