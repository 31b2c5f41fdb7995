"""GPU: the fused Fp8Linear path (megatron.core.fp8.cuda.linear_ops) feeds the GEMMs exactly
the bytes and scales of the reference quantizer, and the layer equals the reference path."""

import pytest
import torch

from megatron.core.fp8 import Fp8Config, Fp8Linear, fp8_autocast, quantize, quantized_model_init
from megatron.core.fp8.cuda import linear_ops
from megatron.core.fp8.cuda import quantize_per_tensor as qpt
from megatron.core.fp8.cuda.quantize_mxfp8 import mxfp8_dequantize
from megatron.core.fp8.reference import dequantize_reference

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("role", ["input", "weight", "grad"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(256, 384), (200, 330), (1100, 640)])
def test_operands_equal_reference_bytes(recipe, role, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    x[:, :40] *= 50.0  # blocks with different scales
    fp8_dtype = E5M2 if role == "grad" else E4M3
    scale = torch.tensor(7.0, device="cuda") if recipe == "delayed" else None
    pow2 = recipe in ("blockwise", "mxfp8")
    history = torch.zeros(4, device="cuda")
    row, col = linear_ops.quantize_operands(
        x,
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=True,
        transposed=True,
        power_2_scale=pow2,
        scale=scale,
        amax_history=history,
    )
    ref = quantize(
        x,
        recipe=recipe,
        fp8_dtype=fp8_dtype,
        role=role,
        rowwise=True,
        columnwise=True,
        scale=scale,
        backend="reference",
    )
    if recipe == "mxfp8":
        want_row = ref.dequantize(torch.bfloat16)
        want_col = dequantize_reference(
            ref.columnwise_data,
            ref.columnwise_scale_inv,
            recipe="mxfp8",
            fp8_dtype=fp8_dtype,
            role=role,
            columnwise=True,
            out_dtype=torch.bfloat16,
        )
        assert torch.equal(_bits(row.data), _bits(want_row))
        if role == "grad":  # read at once: dequantized values
            assert torch.equal(_bits(col.data.t()), _bits(want_col))
            return
        # An input's or weight's copy is kept for backward: bytes and E8M0 scales, which the
        # GEMM dequantizes to the same values.
        assert col.data.dtype == fp8_dtype and torch.equal(_u8(col.data.t()), ref.columnwise_data)
        assert torch.equal(_u8(col.scale_inv), _u8(ref.columnwise_scale_inv))
        values = linear_ops._mx_values(col, torch.bfloat16)
        assert torch.equal(_bits(values.t()), _bits(want_col))
        return
    assert torch.equal(_u8(row.data), ref.rowwise_data)
    assert torch.equal(_bits(row.scale_inv), _bits(ref.rowwise_scale_inv))
    want_t = ref.columnwise_data.t()
    assert torch.equal(_u8(col.data), want_t)
    per_tensor = recipe in ("tensorwise", "delayed")
    two_d = recipe == "blockwise" and role == "weight"
    want_col_sinv = ref.columnwise_scale_inv if per_tensor else ref.columnwise_scale_inv.t()
    assert torch.equal(_bits(col.scale_inv), _bits(want_col_sinv))
    if recipe == "blockwise" and not two_d:
        assert row.scale_inv.stride() == (1, shape[0])  # cuBLAS's outer-dim-major 1x128 grid
    if recipe == "delayed":
        assert history[0].item() == x.float().abs().max().item()
        assert history[1:].abs().sum().item() == 0.0


# amax_partials_kernel's two load paths: (256, 2048) and (2048, 4096) are covered exactly by
# its programs' 16384-element blocks (EVEN: no masks; 32 programs of 1 block, 256 programs
# of 2), (300, 1000) is not (masked loads, a partial last block, idle programs).
AMAX_SHAPES = {(256, 2048): True, (2048, 4096): True, (300, 1000): False}


@pytest.mark.parametrize("content", ["nan", "all_nan_block", "inf"])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("shape", list(AMAX_SHAPES), ids=lambda s: f"{s[0]}x{s[1]}")
def test_tensorwise_amax_pass_equals_reference(shape, dtype, content):
    assert qpt.amax_partials_spec(shape[0] * shape[1])[2]["EVEN"] is AMAX_SHAPES[shape]
    torch.manual_seed(1)
    x = torch.randn(*shape, device="cuda", dtype=dtype) * 5
    flat = x.view(-1)
    if content == "nan":  # NaNs are skipped; the largest magnitude sits late in the tensor
        flat[::997] = float("nan")
        flat[-3] = -900.0
    elif content == "all_nan_block":  # one program's whole first block is NaN
        flat[:16384] = float("nan")
        flat[20000] = 300.0
    else:  # an infinite amax: the rules' scale for a non-finite amax
        flat[123] = float("inf")
    row, col = linear_ops.quantize_operands(
        x,
        recipe="tensorwise",
        fp8_dtype=E4M3,
        role="input",
        rowwise=True,
        transposed=True,
        power_2_scale=False,
    )
    ref = quantize(
        x,
        recipe="tensorwise",
        fp8_dtype=E4M3,
        role="input",
        rowwise=True,
        columnwise=True,
        backend="reference",
    )
    assert torch.equal(_bits(row.scale_inv), _bits(ref.rowwise_scale_inv))
    assert torch.equal(_u8(row.data), ref.rowwise_data)
    assert torch.equal(_u8(col.data), ref.columnwise_data.t())


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mxfp8_dequantize_kernel_equals_reference(fp8_dtype, columnwise):
    x = torch.randn(160, 224, device="cuda") * torch.logspace(-30, 30, 224, device="cuda")
    ref = quantize(
        x,
        recipe="mxfp8",
        fp8_dtype=fp8_dtype,
        role="weight",
        rowwise=not columnwise,
        columnwise=columnwise,
        backend="reference",
    )
    data = ref.columnwise_data if columnwise else ref.rowwise_data
    e8m0 = ref.columnwise_scale_inv if columnwise else ref.rowwise_scale_inv
    for out_dtype in (torch.float32, torch.bfloat16):
        got = mxfp8_dequantize(
            data, e8m0, fp8_dtype=fp8_dtype, columnwise=columnwise, out_dtype=out_dtype
        )
        want = dequantize_reference(
            data,
            e8m0,
            recipe="mxfp8",
            fp8_dtype=fp8_dtype,
            role="weight",
            columnwise=columnwise,
            out_dtype=out_dtype,
        )
        assert torch.equal(_bits(got), _bits(want))


def _step(recipe, *, fused, fp8_weight, monkeypatch, steps=2):
    monkeypatch.setattr(linear_ops, "available", lambda x: fused)
    torch.manual_seed(0)
    config = Fp8Config(recipe=recipe, amax_history_len=4)
    if fp8_weight:
        with quantized_model_init(recipe=recipe):
            layer = Fp8Linear(256, 384, fp8_config=config, dtype=torch.bfloat16, device="cuda")
    else:
        layer = Fp8Linear(256, 384, fp8_config=config, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 64, 384, device="cuda", dtype=torch.bfloat16)
    for _ in range(steps):
        x.grad, layer.weight.grad = None, None
        with fp8_autocast(layer):
            y = layer(x)
        y.backward(dy)
    state = None
    if recipe == "delayed":
        state = {
            role: (m.scale.clone(), m.amax_history.clone())
            for role, m in layer.delayed_scaling.metas.items()
        }
    return (y.detach(), x.grad.clone(), layer.weight.grad.clone()), state


@pytest.mark.parametrize("fp8_weight", [False, True], ids=["bf16_weight", "fp8_weight"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_layer_equals_reference_path(recipe, fp8_weight, monkeypatch):
    """Same operands, same cuBLAS calls: bitwise equal for the hardware recipes. Emulated
    MXFP8 multiplies in bf16 (fp32 accumulation) instead of fp32: output rounding only."""
    fused, fused_state = _step(recipe, fused=True, fp8_weight=fp8_weight, monkeypatch=monkeypatch)
    ref, ref_state = _step(recipe, fused=False, fp8_weight=fp8_weight, monkeypatch=monkeypatch)
    for got, want in zip(fused, ref, strict=True):
        if recipe == "mxfp8":
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
        else:
            assert torch.equal(got, want)
    if recipe == "delayed":
        for role in fused_state:
            assert torch.equal(fused_state[role][0], ref_state[role][0]), role
            assert torch.equal(fused_state[role][1], ref_state[role][1]), role


def test_mxfp8_forward_keeps_one_byte_per_input_element():
    # Emulated MXFP8 with FP8 weights: what a forward leaves alive for backward, besides its
    # output, is wgrad's copy of the input as 32x1 bytes and E8M0 scales (1 + 1/32 bytes per
    # element), not dequantized bf16 values (2 bytes).
    with quantized_model_init(recipe="mxfp8"):
        layer = Fp8Linear(
            1024, 1024, fp8_config=Fp8Config(recipe="mxfp8"), dtype=torch.bfloat16, device="cuda"
        )
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast(layer):
        layer(x).sum().backward()  # plans and kernels made; the caching allocator warm
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = layer(x)
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    # Small allocations (e.g. an amax word) may come and go: bound it between the bytes and
    # scales and well under the 2 bytes per element of values.
    assert x.numel() + x.numel() // 32 <= kept < 1.25 * x.numel(), kept
    y.sum().backward()


@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_fused_delayed_update_equals_reference(algo, margin):
    """The one-kernel flush: new scales and rolled histories bitwise equal to the reference,
    including zero histories (scale kept), Inf amaxes and tiny amaxes (scale -> FLT_MAX)."""
    from megatron.core.fp8.cuda.quantize_per_tensor import delayed_update
    from megatron.core.fp8.reference import delayed_scale_update, roll_amax_history

    histories = torch.rand(6, 1024, device="cuda") * 100
    histories[1] = 0.0
    histories[2, 0] = float("inf")
    histories[3] = 1e-40
    histories[4, 0] = 0.0
    scales = torch.arange(1.0, 7.0, device="cuda")
    for fp8_dtype in (E4M3, E5M2):
        settings = dict(fp8_dtype=fp8_dtype, margin=margin, amax_compute_algo=algo)
        got_scales, got_rolled = delayed_update(histories, scales, **settings)
        want_scales = delayed_scale_update(histories, scales, **settings)
        assert torch.equal(got_scales.view(torch.int32), want_scales.view(torch.int32))
        assert torch.equal(got_rolled, roll_amax_history(histories))


@pytest.mark.parametrize("recipe", RECIPES)
def test_cached_direct_launch_equals_triton_launch(recipe):
    """Launches after the first skip Triton's binder (megatron.core.fp8.cuda.launch): same
    bytes as Triton's own launch path, for an aligned input and a misaligned view (another
    specialization, so another compiled kernel)."""
    from megatron.core.fp8.cuda import launch

    torch.manual_seed(1)
    flat = torch.randn(300 * 520 + 1, device="cuda", dtype=torch.bfloat16) * 4
    inputs = {"aligned": flat[:-1].view(300, 520), "misaligned": flat[1:].view(300, 520)}
    assert inputs["misaligned"].data_ptr() % 16 != 0
    scale = torch.tensor(5.0, device="cuda") if recipe == "delayed" else None

    def run(x):
        row, col = linear_ops.quantize_operands(
            x,
            recipe=recipe,
            fp8_dtype=E4M3,
            role="input",
            rowwise=True,
            transposed=True,
            power_2_scale=recipe != "delayed",
            scale=scale,
        )
        return [
            _bits(t) if t.dtype.is_floating_point and t.element_size() > 1 else _u8(t)
            for op in (row, col)
            for t in (op.data, op.scale_inv)
            if t is not None
        ]

    for name, x in inputs.items():
        first = run(x)
        direct_before = launch._direct["launches"]
        second = run(x)  # every kernel of this key was launched before: direct launches
        assert launch._direct["enabled"], launch.direct_launch_status()
        assert launch._direct["launches"] > direct_before, name
        launch.set_direct_launch(False)
        try:
            through_triton = run(x)
        finally:
            launch.set_direct_launch(True)
        for a, b, c in zip(first, second, through_triton, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c), name


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_step_replays_from_a_cuda_graph_bitwise(recipe):
    """Fp8Linear forward + backward captures in a CUDA graph (no host sync, no host-side
    allocation outside the graph pool) and a replay gives the eager step's output and grads
    bit for bit. Delayed scaling is left out: its flush replaces scale tensors from Python,
    which a replay would not repeat."""
    torch.manual_seed(2)
    layer = Fp8Linear(
        256,
        384,
        bias=True,
        fp8_config=Fp8Config(recipe=recipe),
        dtype=torch.bfloat16,
        device="cuda",
    )
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 384, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = layer.weight.grad = layer.bias.grad = None
        with fp8_autocast(layer):
            y = layer(x)
        y.backward(dy)
        return y

    y_eager = step().detach().clone()
    eager = [t.detach().clone() for t in (x.grad, layer.weight.grad, layer.bias.grad)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = step()
    grads = (x.grad, layer.weight.grad, layer.bias.grad)
    for t in (y_graph, *grads):
        t.detach().fill_(float("nan"))  # a replay must write every element again
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(y_graph.detach()), _bits(y_eager))
    for got, want in zip(grads, eager, strict=True):
        assert torch.equal(_bits(got), _bits(want))
