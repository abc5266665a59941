"""ARCHITECTURE.md's recipe "Add an operand to an op", followed on a copy of the package with a toy
attention feature: a logit soft-cap (``score = cap * tanh(score / cap)`` before the softmax, as
Gemma 2 uses).

The recipe touches the op's record (``ragged/records/attention.py``: one field with a default)
and the implementations that read it (here the pure-torch reference in ``ragged/ops/attention.py``,
which reads the field and names it among the operands it takes) and nothing else: the
``torch.library`` schema, the fake, the autograd rule, the eager path and the layer core take the
field through the record, and every implementation that does not read it declines a call that
sets it, with a reason ``ragged.explain`` shows. The test checks each of these in a fresh
interpreter that imports the copy (without ``site``: an editable install cannot shadow it), and
that the copy differs from the package in those two files only.
"""

from __future__ import annotations

import filecmp
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Step 1: the field, with a default (0: no cap), so that no caller that leaves it out changes.
RECORD_FIELD = (
    "    bias_buckets: Tensor | None = None\n",
    "    bias_buckets: Tensor | None = None\n    softcap: float = 0.0\n",
)

# Step 2: the reference reads it (a loop over sequences in float64 where it is set) and names it
# among the operands it takes.
REFERENCE_READS = (
    "def _reference_forward(args: AttentionArgs) -> AttentionOutput:\n",
    """def _softcapped(args: AttentionArgs) -> AttentionOutput:
    q, k, v = args.q, args.k, args.v
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32)
    cu_q, cu_k = args.cu_q.tolist(), args.cu_k.tolist()
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].double().transpose(0, 1)
        ks = k[cu_k[b] : cu_k[b + 1]].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[cu_k[b] : cu_k[b + 1]].double().repeat_interleave(group, 1).transpose(0, 1)
        s = args.softcap * torch.tanh(qs @ ks.transpose(1, 2) * args.scale / args.softcap)
        if args.causal:
            lq, lk = qs.shape[1], ks.shape[1]
            s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1), float("-inf"))
        out[cu_q[b] : cu_q[b + 1]] = (s.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
        lse[cu_q[b] : cu_q[b + 1]] = s.logsumexp(-1).transpose(0, 1).float()
    return AttentionOutput(out, lse)


def _reference_forward(args: AttentionArgs) -> AttentionOutput:
    if args.softcap:
        return _softcapped(args)
""",
)
REFERENCE_DECLARES = (
    'operands=frozenset({"dropout_p", "seed", "window_left", "window_right", "bias_table", "bias_buckets"}),\n    )\n)',
    'operands=frozenset(\n            {"dropout_p", "seed", "window_left", "window_right", "bias_table", '
    '"bias_buckets", "softcap"}\n        ),\n    )\n)',
)

CHECKS = """
import pytest
import torch

from ragged import backends
from ragged.ops.attention import ATTENTION, AttentionArgs, spec_of

torch.manual_seed(0)
lengths = [5, 0, 9, 1]
cu = torch.tensor([0, 5, 5, 14, 15], dtype=torch.int32)
q, k, v = (torch.randn(15, 4, 16, dtype=torch.float64) for _ in range(3))
k, v = k[:, :2].contiguous(), v[:, :2].contiguous()  # GQA: 4 query heads over 2 key/value heads
args = AttentionArgs(q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=9, max_k=9, causal=True, scale=0.5, softcap=2.0)

# the op takes the new operand, eagerly and through its torch.library schema and fake
out = ATTENTION(args, "torch").out
uncapped = ATTENTION(args._replace(softcap=0.0), "torch").out
assert not torch.allclose(out, uncapped)
for b in range(4):
    lo, hi = cu[b].item(), cu[b + 1].item()
    if hi == lo:
        continue
    s = torch.einsum("qhd,khd->hqk", q[lo:hi], k[lo:hi].repeat_interleave(2, 1)) * 0.5
    s = (2.0 * torch.tanh(s / 2.0)).masked_fill(torch.ones(hi - lo, hi - lo, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[lo:hi].repeat_interleave(2, 1))
    torch.testing.assert_close(out[lo:hi], want)
traced = torch.ops.ragged.attention.default(*args, "torch")
torch.testing.assert_close(traced[0], out)
torch.library.opcheck(
    torch.ops.ragged.attention.default, (*args, "torch"), test_utils=("test_schema", "test_faketensor")
)

# every implementation that does not read it declines a call that sets it, and says why
spec = spec_of(args, needs_grad=False)
assert spec.operands_used == frozenset({"softcap"})
why = ragged.explain("attention", q, k, v, cu, cu, 9, 9, True, 0.0, False)
assert all(reasons == [] or "softcap" not in " ".join(reasons) for reasons in why.values())
entry = backends.op_entry("attention")
for name, impl in entry.impls.items():
    reasons = impl.reasons(spec)
    if name == "torch":
        assert reasons == [], reasons
    else:
        assert f"{impl.backend} attention does not take softcap" in reasons, (name, reasons)
assert backends.select_spec("attention", "auto", spec).name == "torch"
with pytest.raises(ValueError, match="does not take softcap"):
    backends.select_spec("attention", "triton", spec)
print("ok")
"""


def _differing(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [str(pathlib.Path(a.name) / n) for n in cmp.diff_files + cmp.left_only + cmp.right_only]
    for sub in cmp.common_dirs:
        out += [str(pathlib.Path(a.name) / p) for p in _differing(a / sub, b / sub)]
    return out


def _patch(path: pathlib.Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{path}: the recipe's anchor {old!r} is not there once"
    path.write_text(text.replace(old, new))


def test_add_an_operand_to_attention(tmp_path):
    package = tmp_path / "ragged"
    shutil.copytree(ROOT / "ragged", package, ignore=shutil.ignore_patterns("__pycache__"))
    _patch(package / "records" / "attention.py", *RECORD_FIELD)
    _patch(package / "ops" / "attention.py", *REFERENCE_READS)
    _patch(package / "ops" / "attention.py", *REFERENCE_DECLARES)
    changed = sorted(str(pathlib.Path(*pathlib.Path(p).parts[1:])) for p in _differing(ROOT / "ragged", package))
    assert changed == ["ops/attention.py", "records/attention.py"], changed

    script = tmp_path / "checks.py"
    script.write_text(
        f"import ragged\nassert ragged.__file__ == {str(package / '__init__.py')!r}, ragged.__file__\n"
        + textwrap.dedent(CHECKS)
    )
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(tmp_path), *(p for p in sys.path if p and "__editable__" not in p)]),
    )
    done = subprocess.run(
        [sys.executable, "-S", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stdout.strip().endswith("ok")
