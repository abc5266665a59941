"""The warp-specialised sm_90 forward (``ragged.kernels.triton.attention_ws``, Gluon; the
implementation ``triton_sm90_ws``, taken where preferred) on an sm_90 GPU: flash-attn's error
rule against the float64 reference for the output, the log-sum-exp and the gradients of the
portable backward that follows it, zero-length, one-token, off-tile and long sequences, GQA,
causal and not, without a host sync. Skipped on other GPUs."""

from __future__ import annotations

import pytest
import torch

import ragged
from ragged import backends

pytestmark = pytest.mark.gpu

from gpu_attention_cases import LENGTHS as CASES  # noqa: E402
from gpu_attention_cases import _check_backward, _check_forward, _cu, _gen, _needs, _qkv  # noqa: E402

LENGTHS = {
    "self": CASES["self"],
    "cross": CASES["cross"],
    # 128-row programs: lengths at, one past and one short of a block, a long one, and none
    "blocks": ([128, 129, 127, 0, 1, 3000, 255], [128, 129, 127, 0, 1, 3000, 255]),
    "fewer_keys": ([300, 64, 5], [100, 1, 700]),
}


@pytest.fixture
def ws(monkeypatch):
    _needs("triton")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised forward runs on sm_90 only")
    calls = _spy_ws_forward(monkeypatch)
    with backends.prefer("attention", "triton_sm90_ws"):
        yield calls


def _spy_ws_forward(monkeypatch) -> list:
    """Count the warp-specialised forward's launches: q's shape per call."""
    from ragged.kernels.triton import attention_ws

    calls: list = []
    real = attention_ws.forward

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_ws, "forward", spy)
    return calls


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 1), (4, 4)], ids=["gqa", "mha"])
def test_ws_forward_accuracy(dim, dtype, causal, heads, ws):
    for name, (lq, lk) in LENGTHS.items():
        q, k, v = _qkv(lq, lk, *heads, dim, dtype, _gen("ws", dim, dtype, causal, name, heads))
        before = len(ws)
        _check_forward("auto", lq, lk, q, k, v, causal, f"ws/{name}/D={dim}/{dtype}/causal={causal}")
        assert len(ws) == before + 1, f"{name}: the warp-specialised forward did not run"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", [64, 128])
def test_ws_forward_then_portable_backward(dim, causal, ws):
    """The portable backward reads the forward's log-sum-exp: its gradients under the rule."""
    lq, lk = LENGTHS["blocks"]
    q, k, v = _qkv(lq, lk, 4, 2, dim, torch.bfloat16, _gen("ws-bwd", dim, causal))
    _check_backward(lq, lk, q, k, v, causal, f"ws-bwd/D={dim}/causal={causal}", backend="auto")
    assert ws, "the warp-specialised forward did not run"


def test_ws_forward_no_host_sync(ws):
    lq, lk = LENGTHS["blocks"]
    q, k, v = _qkv(lq, lk, 4, 4, 128, torch.bfloat16, _gen("ws-sync"))
    cu_q, cu_k = _cu(lq), _cu(lk)
    ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)  # compiles first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.shape == q.shape and len(ws) == 2


def test_ws_declines_a_window(ws):
    """A sliding window: the call runs elsewhere (the reasons: tests/test_attention_hopper.py)."""
    lq, lk = LENGTHS["self"]
    q, k, v = _qkv(lq, lk, 4, 4, 128, torch.bfloat16, _gen("ws-decline"))
    ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), window_size=(16, 0))
    assert not ws


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", [64, 128])
def test_ws_overlap_off_gives_the_same_rows(dim, causal, ws):
    """One product at a time (overlap=False) against the overlapped loop: the same sums, rescaled
    at another point (acc * alpha + P V against (acc + P V) * alpha), so equal to float32's
    rounding before the cast: within a bf16 ulp, the log-sum-exp (no rescale) to float32's."""
    from ragged.kernels.triton import attention, attention_ws

    lq, lk = LENGTHS["blocks"]
    q, k, v = _qkv(lq, lk, 4, 2, dim, torch.bfloat16, _gen("ws-overlap", dim, causal))
    cu_q, cu_k = _cu(lq), _cu(lk)
    cum = attention._block_cum(cu_q, attention_ws.block_m(dim))
    steps = max(len(lq) - 1, 0).bit_length()
    outs = []
    for overlap in (True, False):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        attention_ws.forward(q, k, v, out, lse, cu_q, cu_k, cum, steps, causal, dim**-0.5, overlap=overlap)
        outs.append((out, lse))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)


_TURNS_SCRIPT = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from gpu_attention_cases import _cu, _gen, _qkv
from ragged.kernels.triton import attention, attention_ws

# Block edges, one long sequence; cross lengths; 300 short ones (0 to 300 tokens). A persistent grid
# (a program per multiprocessor, 132 on an H200) takes 1-2, 2 and about 10 rounds of these tiles
# (4 heads), some programs a round more than others.
lengths = [128, 129, 127, 0, 1, 3000, 255, 191, 193]
short = [(37 * i) % 301 for i in range(300)]
batches = (
    (lengths, lengths),
    ([5, 700, 0, 64, 1, 129] * 6, [300, 1, 7, 0, 128, 2000] * 6),
    (short, short[::-1]),
)
# (name, ping-pong, K/V stages at D=128, consumers at D=64, persistent)
settings = (
    ("plain", False, 3, 2, False),
    ("pingpong", True, 3, 2, False),
    ("stages2", False, 2, 2, False),
    ("wg3", False, 3, 3, False),
    ("persistent", False, 3, 2, True),
    ("persistent-wg3", False, 3, 3, True),
)
for dim in (64, 128):
    for causal in (False, True):
        for lq, lk in batches:
            cu_q, cu_k = _cu(lq), _cu(lk)
            steps = max(len(lq) - 1, 0).bit_length()
            q, k, v = _qkv(lq, lk, 4, 2, dim, torch.bfloat16, _gen("ws-turns", dim, causal, len(lq)))
            rows = {}
            for name, pingpong, stages, consumers, persistent in settings:
                attention_ws.STAGES_D128, attention_ws.CONSUMERS_D64 = stages, consumers
                cum = attention._block_cum(cu_q, attention_ws.block_m(dim))
                out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
                attention_ws.forward(
                    q, k, v, out, lse, cu_q, cu_k, cum, steps, causal, dim**-0.5, pingpong=pingpong,
                    persistent=persistent,
                )
                torch.cuda.synchronize()
                rows[name] = (out, lse)
            for name, *_ in settings[1:]:
                # a persistent grid changes which program takes a tile, not the tile's sums
                ref = "wg3" if name == "persistent-wg3" else "plain"
                got, want = rows[name], rows[ref]
                tag = f"D={dim} causal={causal} lengths={lq[:6]}: {name} rows differ from {ref}'s"
                if name == "wg3" and dim == 64:  # 64-key blocks: the same sums, rescaled elsewhere
                    torch.testing.assert_close(got[0], want[0], atol=1e-2, rtol=8e-3, msg=tag)
                    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5, msg=tag)
                else:
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), tag
print("ok")
"""


def test_ws_settings_give_the_same_rows(ws):
    """The consumers in ping-pong, two K/V stages at D=128 instead of three, and three consumers
    at D=64 (192-row programs) change when products are issued, not what they add: the rows are
    bit-identical to the plain overlap's (which the tests above hold to the float64 reference);
    three consumers take 64-key blocks, so their rows are rescaled at other points: within a bf16
    ulp, as the overlap test above. A persistent grid (a program per multiprocessor looping over
    the tiles, with two or three consumers) gives each setting's rows bit for bit, on batches that
    leave its programs different numbers of tiles. In a child process with a time limit: a turn protocol that
    deadlocks fails here instead of hanging the suite."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run = subprocess.run(
            [sys.executable, "-c", _TURNS_SCRIPT, here], capture_output=True, text=True, timeout=600, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the ping-pong forward did not finish in 600 s: the consumers' turns deadlock")
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_auto_takes_the_ws_forward_at_head_dim_128_for_long_batches(causal, monkeypatch):
    """``auto`` (no preference): the warp-specialised forward for a head-dim-128 batch whose
    longest query reaches ``ws_min_len``, the portable backward after it (gradients under the
    rule); not for a batch one token short of it, nor at head dim 64."""
    _needs("triton")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised forward runs on sm_90 only")
    from ragged.kernels import triton as triton_backend

    monkeypatch.delenv("RAGGED_ATTENTION_HOPPER", raising=False)
    monkeypatch.delenv("RAGGED_PREFER", raising=False)
    calls = _spy_ws_forward(monkeypatch)
    least = triton_backend.ws_min_len(128, causal)
    assert least is not None and triton_backend.ws_min_len(64, causal) is None
    lq = [least, 3, 1, 129, 0, 700]
    q, k, v = _qkv(lq, lq, 4, 2, 128, torch.bfloat16, _gen("ws-auto", causal))
    _check_forward("auto", lq, lq, q, k, v, causal, f"ws-auto/long/causal={causal}")
    assert calls == [q.shape], "auto did not take the warp-specialised forward"
    _check_backward(lq, lq, q, k, v, causal, f"ws-auto/long-bwd/causal={causal}", backend="auto")
    calls.clear()
    for dim, lengths in ((128, [least - 1, 5, 300]), (64, lq)):
        q, k, v = _qkv(lengths, lengths, 4, 2, dim, torch.bfloat16, _gen("ws-auto-not", dim, causal))
        _check_forward("auto", lengths, lengths, q, k, v, causal, f"ws-auto/not/D={dim}/causal={causal}")
        assert calls == [], f"D={dim}, longest {max(lengths)}: auto took the warp-specialised forward"
