"""How far is each FP8 recipe's routed-experts layer from the exact product? Relative error
(Frobenius) of y, dx and dW of an Fp8StackedLinear against fp64, at model M-small's fc1 shape
(768 -> 512) with ragged segments, grouped (where the recipe takes it) and per segment, on
the second step (delayed then
uses a real scale). Answers whether one recipe loses precision in the experts' layer.

    python dev/expert_fp8_error.py            # CPU (emulated FP8), about a minute
"""

from __future__ import annotations

import torch

from megatron.core.fp8 import Fp8Config
from megatron.core.transformer.moe.fp8_experts import Fp8StackedLinear
from megatron.core.transformer.moe.grouped_fp8 import grouped_path_applies

EXPERTS, IN, OUT = 8, 768, 512
COUNTS = [300, 433, 128, 515, 77, 256, 200, 139]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def main() -> None:
    torch.manual_seed(0)
    rows = sum(COUNTS)
    x = torch.randn(rows, IN) * (1 + 3 * torch.rand(rows, 1))
    dy = torch.randn(rows, OUT) * 1e-3 * (1 + 10 * torch.rand(rows, 1))
    w = torch.randn(EXPERTS, OUT, IN) * 0.02
    xs, dys = x.double().split(COUNTS), dy.double().split(COUNTS)
    want_y = torch.cat([a @ w[e].double().t() for e, a in enumerate(xs)])
    want_dx = torch.cat([g @ w[e].double() for e, g in enumerate(dys)])
    want_dw = torch.stack([g.t() @ a for a, g in zip(xs, dys)])
    for recipe in ("tensorwise", "blockwise", "delayed", "mxfp8"):
        config = Fp8Config(recipe=recipe, fp8_format="hybrid")
        grouped_too = grouped_path_applies(config, w)  # mxfp8: where OUT is a multiple of 32
        for grouped in (True, False) if grouped_too else (False,):
            layer = Fp8StackedLinear(EXPERTS, IN, OUT, fp8_config=config, dtype=torch.float32)
            with torch.no_grad():
                layer.weight.copy_(w)
            layer.grouped = grouped
            for _ in range(2):
                layer.weight.grad = None
                tokens = x.clone().requires_grad_()
                y = layer(tokens, COUNTS, [[count] for count in COUNTS])
                y.backward(dy)
            errors = (
                _relative(y.detach(), want_y),
                _relative(tokens.grad, want_dx),
                _relative(layer.weight.grad, want_dw),
            )
            path = "grouped" if grouped else "per segment"
            print(f"{recipe:10s} {path:11s} y %.2e  dx %.2e  dW %.2e" % errors)


if __name__ == "__main__":
    main()
