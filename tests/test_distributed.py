"""Data-parallel training on CPU with gloo, two processes: after one step, DDP's and FSDP2's
gradients (FSDP2's gathered from their shards) equal those of one process on the union of the
ranks' batches, for a ragged.nn encoder, a converted HuggingFace BERT classifier and a Llama with
``attn_implementation="ragged"``; FSDP2 with a bfloat16 parameter policy stays within bfloat16's
error of them."""

from __future__ import annotations

import functools

import distributed_cases as cases
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def _compare(got, want, rtol, atol, what):
    assert set(got) == set(want)
    for name, ref in want.items():
        assert ref is not None, f"{name}: no gradient in the single-process run"
        g = got[name]
        assert g is not None, f"{what}: {name} has no gradient"
        assert np.isfinite(g).all(), f"{what}: {name} has non-finite gradients"
        assert np.abs(ref).max() > 0, f"{name}: zero gradient in the reference (the check could not fail)"
        np.testing.assert_allclose(g, ref, rtol=rtol, atol=atol, err_msg=f"{what}: {name}")


# Each case starts two processes; the HuggingFace models' worlds take the longest: `-m slow`, which
# CI runs right after the README's command. The ragged.nn encoder keeps DDP and FSDP2 in the default run.
SLOW = pytest.mark.slow


@functools.cache
def _world(kind, mode):
    """``cases.run_world``, once per (kind, mode) in this process: the tests only read its results."""
    return cases.run_world(kind, mode)


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        pytest.param(mode, kind, marks=() if kind == "encoder" else SLOW)
        for mode in ("ddp", "fsdp")
        for kind in cases.KINDS
    ],
)
def test_gradients_equal_one_process_on_the_union(kind, mode):
    if kind != "encoder":
        pytest.importorskip("transformers")
    want = cases.union_grads(kind)
    got, _ = _world(kind, mode)
    _compare(got, want, 1e-5, 1e-5 * max(np.abs(w).max() for w in want.values()), f"{mode} {kind}")


@SLOW
def test_fsdp_bf16_parameter_policy_trains_within_bf16_error():
    pytest.importorskip("transformers")
    want = cases.union_grads("bert")
    got, _ = cases.run_world("bert", "fsdp-bf16")
    scale = max(np.abs(w).max() for w in want.values())
    for name, ref in want.items():
        err = np.abs(got[name] - ref).max()
        assert err <= 0.05 * scale, f"{name}: bf16 parameter policy error {err:.3g} (scale {scale:.3g})"
    # and bf16 really ran: not bitwise the float32 result
    assert any(not np.array_equal(got[n], want[n]) for n in want)


@SLOW
def test_ddp_with_layer_graphs_equals_one_process_on_the_union():
    """DDP over a converted BERT whose layers replay their graphs (emulated on the CPU): each
    layer's autograd node hands its Parameters' gradients to autograd, so DDP's hooks reduce
    them; after warm-up steps the gradients equal one process's on the union of the batches."""
    pytest.importorskip("transformers")
    want = cases.union_grads("bert")
    got, _ = _world("bert", "ddp-layer-graphs")
    _compare(got, want, 1e-5, 1e-5 * max(np.abs(w).max() for w in want.values()), "ddp with layer graphs")


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        pytest.param(mode, kind, marks=() if kind == "encoder" else SLOW)
        for mode in cases.GRAPHED_MODES
        for kind in cases.GRAPHED_KINDS
    ],
)
def test_ddp_over_graphed_equals_one_process_on_the_union(kind, mode):
    """DDP over ragged.nn.graphed (its graphs emulated off the GPU): the backward replays in
    segments whose gradients reach DDP's hooks; the fillers' rows add nothing to the reduced
    gradients; with ``no_sync`` the accumulated gradients are reduced once, as DDP does for the
    eager module."""
    if kind != "encoder":
        pytest.importorskip("transformers")
    want = cases.union_grads(kind, mode=mode)
    got, _ = _world(kind, mode)
    _compare(got, want, 1e-5, 1e-5 * max(np.abs(w).max() for w in want.values()), f"{mode} {kind}")


def test_sampler_replicas_default_to_the_process_group():
    _, plans = _world("encoder", "ddp")
    assert [p[:2] for p in plans] == [(2, 0), (2, 1)]
    assert len(plans[0][2]) == len(plans[1][2]) > 0  # the same number of steps on every rank
    seen = sorted(i for p in plans for batch in p[2] for i in batch)
    assert seen == list(range(len(cases.SAMPLER_LENGTHS)))  # every index once over the ranks
