"""What the ragged.nn transformer tests share (test_nn_transformer.py, test_nn_convert_modules.py,
test_nn_mha.py, test_nn_transformer_gpu.py): tolerances, the lengths cases, seeded torch.nn
encoders with randomised weights, padded inputs and masks, and running both sides."""

from __future__ import annotations

import warnings

import torch
from torch import nn

TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}
D, HEADS, FF = 16, 4, 32

LENGTHS = {
    "mixed": [5, 0, 9, 1],
    "ones": [1, 1, 1],
    "equal": [6, 6, 6],
    "one_long": [2, 17, 1, 3],
}


def _randomise(module: nn.Module, seed: int, scale: float = 0.3) -> None:
    """Distinct, non-trivial weights (torch.nn's encoder starts with identical layers and zero biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(scale * noise)


def _torch_encoder(
    *,
    batch_first=True,
    norm_first=False,
    activation="relu",
    bias=True,
    norm=False,
    layers=2,
    dropout=0.0,
    dtype=torch.float32,
    seed=0,
) -> nn.TransformerEncoder:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when its nested fast path cannot apply
        layer = nn.TransformerEncoderLayer(
            D,
            HEADS,
            FF,
            dropout=dropout,
            activation=activation,
            batch_first=batch_first,
            norm_first=norm_first,
            bias=bias,
            dtype=dtype,
        )
        final = nn.LayerNorm(D, bias=bias, dtype=dtype) if norm else None
        enc = nn.TransformerEncoder(layer, layers, norm=final)
    _randomise(enc, seed)
    return enc


def _padded(lengths, seed=0, width=None, dtype=torch.float32):
    """``x [B, M, D]`` with large garbage at padding, and the bool key padding mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths, default=0) if width is None else width
    x = torch.randn((len(lengths), width, D), generator=g, dtype=torch.float64).to(dtype)
    pad = torch.arange(width).unsqueeze(0) >= torch.tensor(lengths, dtype=torch.int64).reshape(-1, 1)
    x = x.masked_fill(pad.unsqueeze(-1), 100.0)
    return x, pad


def _causal_mask(m, dtype=torch.float32):
    """torch's causal mask: float (-inf above the diagonal), or bool (True above it)."""
    mask = nn.Transformer.generate_square_subsequent_mask(m)
    return mask == float("-inf") if dtype == torch.bool else mask.to(dtype)


def _run_torch(enc, x, pad, causal, batch_first):
    m = x.shape[1]
    src = x if batch_first else x.transpose(0, 1)
    kwargs = {"mask": _causal_mask(m, torch.bool).to(x.device), "is_causal": True} if causal else {}
    out = enc(src, src_key_padding_mask=pad, **kwargs)
    return out if batch_first else out.transpose(0, 1)


def _run_ragged(enc, x, pad, causal, batch_first, how="flag"):
    src = x if batch_first else x.transpose(0, 1)
    if not causal:
        kwargs = {}
    elif how == "flag":
        kwargs = {"is_causal": True}
    else:  # detected from the mask
        kwargs = {"mask": _causal_mask(x.shape[1]).to(x.device)}
    out = enc(src, src_key_padding_mask=pad, **kwargs)
    return out if batch_first else out.transpose(0, 1)


def _check(out, expected, lengths, tol=TOL):
    """Real positions match; ragged's padding is exactly zero."""
    assert out.shape == expected.shape
    for b, n in enumerate(lengths):
        if n:
            torch.testing.assert_close(out[b, :n], expected[b, :n], **tol, msg=lambda m, b=b: f"sequence {b}: {m}")
        assert torch.all(out[b, n:] == 0), f"sequence {b}: padding is not zero"


# --------------------------------------------------------------------------------------


class _TanhReLU(nn.ReLU):
    """A ReLU subclass whose forward is something else: the layer must call it."""

    def forward(self, x):
        return torch.tanh(x)


def _hooked_gelu() -> nn.GELU:
    """A GELU module with a forward hook (torch.nn calls the activation as a module, so it runs)."""
    act = nn.GELU()
    act.register_forward_hook(lambda module, args, out: out * 0.5)
    return act


ACTIVATION_MODULES = {"relu_subclass": _TanhReLU, "hooked_gelu": _hooked_gelu}
