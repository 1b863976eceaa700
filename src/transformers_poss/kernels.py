"""CPU kernels for drafting: products with 8-bit copies of the drafter's weights (`Int8Linear`).

A draft depth multiplies a handful of rows (its frontier) by every weight of a specialist and the draft head, so it
streams weights: 8-bit copies halve the bytes read (a quarter of fp32's). A drafter loaded with
`int8_draft_weights=True` drafts with `Int8Linear` modules in place of its `nn.Linear`s (`use_int8_linears`); the
weights themselves, training and the saved state are untouched.

The kernel (`torch._weight_int8pack_mm`) is fast for 16-bit inputs only, so products run in bf16 (fp16 for fp16
drafters) and return in the input's dtype: for an fp32 drafter that is bf16 arithmetic on 8-bit weights, which costs
acceptance only (the target verifies every token).
"""

from __future__ import annotations

import torch
from torch import nn


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype 8-bit products of a `dtype` drafter run in: fp16 for fp16, else bf16."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit copy of a weight `[out, in]`: int8 values `[out, in]` and one scale per row `[out]` (in
    `product_dtype` of the weight's), `weight ~= values * scales[:, None]` (symmetric, the row's largest magnitude maps
    to 127)."""
    full = weight.detach().float()
    scales = full.abs().amax(dim=1).clamp(min=1e-12) / 127
    values = torch.round(full / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return values, scales.to(product_dtype(weight.dtype))


def int8_product(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x @ (values * scales[:, None]).T`, `[..., in] -> [..., out]`, computed in `scales`' 16-bit dtype and returned
    in `x`'s (CPU; `in` a multiple of 16)."""
    flat = x.reshape(-1, x.shape[-1]).to(scales.dtype).contiguous()
    out = torch._weight_int8pack_mm(flat, values, scales).reshape(*x.shape[:-1], values.shape[0])
    return out.to(x.dtype)


# Above this many input rows the 8-bit kernel is slower than the dense product of the input's dtype (it does not block
# larger products as a GEMM does): 16-bit inputs 4 rows; fp32 inputs, whose dense product reads twice the bytes, 32.
INT8_MAX_ROWS = {torch.float32: 32}
INT8_MAX_ROWS_16BIT = 4


def runs_int8(x: torch.Tensor, in_features: int) -> bool:
    """Whether `int8_product` should take inputs `x [..., in_features]`: on the CPU, no gradient, `in_features` a
    multiple of 16 (the kernel's 16-bit path reads the weight in blocks of 16), and at most `INT8_MAX_ROWS` rows (a
    draft depth's frontier)."""
    rows = INT8_MAX_ROWS.get(x.dtype, INT8_MAX_ROWS_16BIT)
    return (x.device.type == "cpu" and in_features % 16 == 0 and x.numel() <= rows * in_features
            and not torch.is_grad_enabled())


class Int8Linear(nn.Module):
    """An `nn.Linear`'s stand-in while a drafter drafts on 8-bit weights (`use_int8_linears`): the same `weight` and
    `bias` parameters (the same state dict), multiplied through an 8-bit copy of the weight where `runs_int8` allows,
    made on first use and again whenever the weight changes; exactly otherwise (with gradients, many rows)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._int8_copy = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., in] -> [..., out]`."""
        if not runs_int8(x, self.in_features):
            return nn.functional.linear(x, self.weight, self.bias)
        out = int8_product(x, *self.int8_copy())
        return out if self.bias is None else out + self.bias

    def int8_copy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`pack_int8(self.weight)`, cached while the weight is unchanged."""
        key = (self.weight.data_ptr(), self.weight._version, self.weight.dtype)
        if self._int8_copy is None or self._int8_copy[0] != key:
            self._int8_copy = (key, *pack_int8(self.weight))
        return self._int8_copy[1], self._int8_copy[2]

    def to_linear(self) -> nn.Linear:
        """The plain `nn.Linear` over the same parameters."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_int8_linears(module: nn.Module, enabled: bool) -> None:
    """Replace every `nn.Linear` under `module` by an `Int8Linear` over the same parameters (`enabled`), or every
    `Int8Linear` by its `nn.Linear` again; parameters, state dict and training are unchanged."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if enabled and type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
            elif not enabled and isinstance(child, Int8Linear):
                setattr(parent, name, child.to_linear())
