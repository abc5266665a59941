"""The Triton backward passes that take a dropout back in the same pass (what the one-node
training step of ragged.nn uses): ``add_layer_norm_dropout_backward`` and ``bias_act_backward``
with a keep mask.

Oracles: float64 (the layer norm gradient written out by ``reference_add_layer_norm_backward``,
then ``* keep / (1 - p)`` and the column sum), and, bit for bit, the unfused composition (the
plain Triton backward, then ``torch.ops.aten.native_dropout_backward``): the fused pass rounds
exactly where that composition does. CPU: the Triton interpreter at small sizes; GPU: larger.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from conftest import TRITON_ON_CPU

from ragged.ops.fused import reference_add_layer_norm_backward, reference_bias_act_backward
from ragged.records.fused import AddLayerNormArgs, AddLayerNormBackwardInputs, BiasActArgs, BiasActBackwardInputs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _devices():
    cpu = pytest.param("cpu", marks=pytest.mark.skipif(not TRITON_ON_CPU, reason="needs TRITON_INTERPRET=1"))
    return [cpu, pytest.param("cuda", marks=pytest.mark.gpu)]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype)


def _mask(shape, p, device, gen):
    return (torch.rand(shape, generator=gen, dtype=torch.float64) >= p).to(device)


def _sizes(device):
    # CPU: interpreted blocks are small (F = 300 already spans several column blocks of
    # bias_act, and takes the chunked layer norm: the unfused fallback); GPU: BERT widths
    if device == "cpu":
        return [(0, 64), (1, 1), (7, 100), (33, 64), (9, 300)]
    return [(0, 768), (1, 1), (7, 100), (4099, 768), (513, 3072), (65, 9000)]


def _close(out, ref, dtype, what):
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    err = (out.double().cpu() - ref.double().cpu()).abs().max().item() if ref.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def _same(out, want, device, what):
    """Bit for bit; but the Triton interpreter truncates fp32 -> bf16 where the GPU (and
    torch) round to nearest: there within two bf16 ulps (two roundings in a row)."""
    if device == "cpu" and out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, want, rtol=2**-6, atol=0, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(out, want), what


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", ["post", "pre", "nomask", "plain"])
def test_layer_norm_dropout_backward(device, dtype, variant):
    from ragged.kernels.triton import fused as kf

    p = 0.3
    for n, f in _sizes(device):
        gen = _gen("ln", device, str(dtype), variant, n, f)
        a = _randn((n, f), dtype, device, gen)
        # post: LN(drop(z) + x) (b given); pre: LN of the stored sum, ds given; nomask: no dropout
        b = _randn((n, f), dtype, device, gen) if variant in ("post", "nomask") else None
        ds = _randn((n, f), dtype, device, gen) if variant == "pre" else None
        w = (1 + 0.1 * _randn((f,), dtype, device, gen)) if variant != "plain" else None
        bias = _randn((f,), dtype, device, gen) if variant != "plain" else None
        dy = _randn((n, f), dtype, device, gen)
        keep = _mask((n, f), p, device, gen) if variant in ("post", "pre", "plain") else None
        # the statistics and the stored sum from the kernels' own forward, as in use
        args = AddLayerNormArgs(a, b, w, bias, 1e-5, return_sum=True)
        _, s, mean, rstd = kf.add_layer_norm_forward(args)
        colsum = dtype if variant != "plain" else None
        inputs = AddLayerNormBackwardInputs(dy, ds, mean, rstd)
        dsum, dz, dw, db, dc = kf.add_layer_norm_dropout_backward(args, inputs, mask=keep, p=p, colsum_dtype=colsum)
        # float64 oracle
        ref_sum, ref_dw, ref_db = reference_add_layer_norm_backward(
            dy.double(),
            None if ds is None else ds.double(),
            s.double(),
            None if w is None else w.double(),
            None if bias is None else bias.double(),
            mean.double(),
            rstd.double(),
        )
        ref_dz = ref_sum if keep is None else ref_sum * keep.double() / (1 - p)
        what = f"{variant} {dtype} [{n}, {f}]"
        _close(dsum, ref_sum, dtype, f"{what} ds_total")
        _close(dz, ref_dz, dtype, f"{what} dz")
        if w is not None:
            assert dw.dtype == w.dtype and db.dtype == bias.dtype
            _close(dw, ref_dw, dtype, f"{what} dweight")
            _close(db, ref_db, dtype, f"{what} dbias")
        if colsum is None:
            assert dc is None
        else:
            assert dc.dtype == colsum and dc.shape == (f,)
            _close(dc, ref_dz.sum(0), dtype, f"{what} dz column sum")
        # bit for bit: the unfused composition from the same ds_total
        plain_sum, _, plain_dw, plain_db = kf.add_layer_norm_backward(args, inputs)
        assert torch.equal(dsum, plain_sum), what
        want = plain_sum if keep is None else torch.ops.aten.native_dropout_backward(plain_sum, keep, 1 / (1 - p))
        _same(dz, want, device, f"{what}: dz is not the dropout backward of ds_total")
        if w is not None:  # fp32 sums of the same values (the kernel variants may order them differently)
            _close(dw, plain_dw, dtype, f"{what} dweight against the plain kernel")
            _close(db, plain_db, dtype, f"{what} dbias against the plain kernel")


@pytest.mark.parametrize("device", _devices())
def test_layer_norm_dropout_backward_strided_mask_and_inputs(device):
    """Row strides of the inputs and of the mask (views into wider buffers) are honoured."""
    from ragged.kernels.triton import fused as kf

    gen = _gen("ln strided", device)
    n, f, p = 21, 48, 0.5
    wide = _randn((n, 2 * f), torch.float32, device, gen)
    a, dy = wide[:, :f], _randn((n, 3 * f), torch.float32, device, gen)[:, f : 2 * f]
    keep = _mask((n, 2 * f), p, device, gen)[:, f:]
    w, bias = _randn((f,), torch.float32, device, gen), _randn((f,), torch.float32, device, gen)
    mean = a.double().mean(1).float()
    rstd = (a.double().var(1, unbiased=False) + 1e-5).rsqrt().float()
    dsum, dz, dw, db, dc = kf.add_layer_norm_dropout_backward(
        AddLayerNormArgs(a, None, w, bias, 1e-5),
        AddLayerNormBackwardInputs(dy, None, mean, rstd),
        mask=keep,
        p=p,
        colsum_dtype=torch.float32,
    )
    ref_sum, ref_dw, ref_db = reference_add_layer_norm_backward(
        dy.double(), None, a.double(), w.double(), bias.double(), mean.double(), rstd.double()
    )
    ref_dz = ref_sum * keep.double() / (1 - p)
    for got, ref, what in (
        (dsum, ref_sum, "ds"),
        (dz, ref_dz, "dz"),
        (dw, ref_dw, "dw"),
        (db, ref_db, "db"),
        (dc, ref_dz.sum(0), "colsum"),
    ):
        _close(got, ref, torch.float32, what)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ["gelu", "relu", "gelu_tanh"])
def test_bias_act_dropout_backward(device, dtype, activation):
    from ragged.kernels.triton import fused as kf

    p = 0.25
    for n, f in _sizes(device):
        gen = _gen("ba", device, str(dtype), activation, n, f)
        x = _randn((n, f), dtype, device, gen)
        bias = _randn((f,), dtype, device, gen)
        g = _randn((n, f), dtype, device, gen)
        keep = _mask((n, f), p, device, gen)
        args = BiasActArgs(x, bias, activation)
        dx, db = kf.bias_act_backward(args, BiasActBackwardInputs(g), mask=keep, p=p)
        g_in = torch.ops.aten.native_dropout_backward(g, keep, 1 / (1 - p))
        plain_dx, plain_db = kf.bias_act_backward(args, BiasActBackwardInputs(g_in))
        what = f"{activation} {dtype} [{n}, {f}]"
        _same(dx, plain_dx, device, f"{what}: not the composition with native_dropout_backward")
        _close(db, plain_db, dtype, f"{what} dbias against the plain kernel")
        ref_dx, ref_db = reference_bias_act_backward(
            g.double() * keep.double() / (1 - p), x.double(), bias.double(), activation
        )
        _close(dx, ref_dx, dtype, f"{what} dx")
        _close(db, ref_db, dtype, f"{what} dbias")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_partial_sums_into_a_shared_buffer(device, dtype):
    """``part=``: the LayerNorm and bias + activation backwards leave their per-group column
    sums in the caller's buffer, at the given column, in the order (dweight, dbias, dz sum),
    only the wanted ones, every group row written (zeros for groups with no rows); summed over
    the rows they are the sums the functions return on their own. The columns around them
    (NaN) are not touched; gradients are the same bit for bit."""
    from ragged.kernels.triton import fused as kf

    p = 0.3
    groups = kf.partial_groups(torch.device(device))
    for n, f in [(0, 64), (1, 1), (7, 100), (33, 64)] + ([(4099, 768)] if device == "cuda" else []):
        assert kf.layer_norm_backward_fuses(f, dtype)
        gen = _gen("part", device, str(dtype), n, f)
        a, b, dy = (_randn((n, f), dtype, device, gen) for _ in range(3))
        w, bias = 1 + 0.1 * _randn((f,), dtype, device, gen), _randn((f,), dtype, device, gen)
        keep = _mask((n, f), p, device, gen)
        args = AddLayerNormArgs(a, b, w, bias, 1e-5)
        _, _, mean, rstd = kf.add_layer_norm_forward(args)
        for need_w, need_b, colsum in ((True, True, dtype), (False, True, dtype), (True, False, None)):
            k = need_w + need_b + (colsum is not None)
            col = 3
            part = torch.full((groups, col + k * f + 5), float("nan"), dtype=torch.float32, device=device)
            inputs = AddLayerNormBackwardInputs(dy, None, mean, rstd, need_weight=need_w, need_bias=need_b)
            got = kf.add_layer_norm_dropout_backward(
                args, inputs, mask=keep, p=p, colsum_dtype=colsum, part=part, part_col=col
            )
            want = kf.add_layer_norm_dropout_backward(args, inputs, mask=keep, p=p, colsum_dtype=colsum)
            what = f"{dtype} [{n}, {f}] w={need_w} b={need_b} colsum={colsum is not None}"
            assert got[2:] == (None, None, None), what
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), what
            assert part[:, :col].isnan().all() and part[:, col + k * f :].isnan().all(), f"{what}: wrote outside"
            sums = part[:, col : col + k * f].sum(0).split(f)
            for s, ref in zip(sums, [t for t in want[2:] if t is not None]):
                _close(s.to(dtype), ref, dtype, f"{what}: a partial sum")
        # bias + activation, with and without the dropout
        h, g = _randn((n, 2 * f), dtype, device, gen), _randn((n, 2 * f), dtype, device, gen)
        b1 = _randn((2 * f,), dtype, device, gen)
        for mask in (None, _mask((n, 2 * f), p, device, gen)):
            part = torch.full((groups, 2 * f + 9), float("nan"), dtype=torch.float32, device=device)
            args, inputs = BiasActArgs(h, b1, "gelu"), BiasActBackwardInputs(g)
            dx, none = kf.bias_act_backward(args, inputs, mask=mask, p=p, part=part, part_col=7)
            want_dx, want_db = kf.bias_act_backward(args, inputs, mask=mask, p=p)
            assert none is None and torch.equal(dx, want_dx)
            assert part[:, :7].isnan().all() and part[:, 7 + 2 * f :].isnan().all()
            _close(part[:, 7 : 7 + 2 * f].sum(0).to(dtype), want_db, dtype, f"bias_act [{n}, {2 * f}] dbias")


@pytest.mark.parametrize("device", _devices())
def test_partial_sums_buffer_checked(device):
    from ragged.kernels.triton import fused as kf

    x = torch.zeros(4, 8, device=device)
    bias = torch.zeros(8, device=device)
    args, inputs = BiasActArgs(x, bias, "relu"), BiasActBackwardInputs(x)
    for bad in (
        torch.zeros(4, 8, dtype=torch.float64, device=device),
        torch.zeros(4, 7, device=device),
        torch.zeros(8, 4, device=device).t(),
    ):
        with pytest.raises(ValueError, match=r"bias_act_backward\(\): expected part"):
            kf.bias_act_backward(args, inputs, part=bad)
    with pytest.raises(ValueError, match=r"part_col=2"):
        kf.bias_act_backward(args, inputs, part=torch.zeros(4, 9, device=device), part_col=2)
