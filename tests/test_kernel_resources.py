"""The sm_90 attention kernels compiled for sm_90 without a GPU (``python -m
bench.kernel_resources --chosen``, in a process without ``TRITON_INTERPRET``, which would turn
the kernels into interpreted functions): at the shapes the launchers pick, they move their tiles
with TMA, multiply with wgmma, do not spill and fit an H100's shared memory. A change that loses
any of these fails here, before it costs time on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
# Compiling the chosen shapes for sm_90 takes minutes of CPU: `-m slow`, which CI runs right after
# the README's command.
pytestmark = pytest.mark.slow

_SHARED_LIMIT = 232448  # bytes of shared memory an H100 / H200 block may use


@pytest.fixture(scope="module")
def records():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--chosen"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if (
        run.returncode
        and "No such file or directory" in run.stderr
        and ("ptxas" in run.stderr or "cuobjdump" in run.stderr)
    ):
        pytest.skip("this Triton build has no NVIDIA tools (ptxas, cuobjdump)")
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_every_chosen_shape_compiled(records):
    kinds = {(r["kernel"], r["head_dim"], r["causal"], r["variant"]) for r in records}
    plain = {(k, d, c, "plain") for k in ("forward", "dkdv", "dq") for d in (64, 128) for c in (False, True)}
    want = plain | {
        (k, 128, c, v) for k in ("forward", "dkdv", "dq") for c, v in ((False, "window"), (True, "dropout"))
    }
    want |= {("dkdv_fused_tma", d, c, "plain") for d in (64, 128) for c in (False, True)}
    if _has_gluon_hopper():  # the warp-specialised forward (Gluon)
        want |= {("forward_ws", d, c, v) for d in (64, 128) for c in (False, True) for v in ("plain", "pingpong")}
        want |= {("forward_ws", 128, c, "stages2") for c in (False, True)}
        want |= {("forward_ws", 64, c, "wg3") for c in (False, True)}
    assert kinds == want


def _has_gluon_hopper() -> bool:
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except ImportError:
        return False
    return True


def test_warp_specialised_forward_moves_registers_and_overlaps(records):
    """Gluon's forward: TMA loads, wgmma, registers handed to the consumers (setmaxnreg), no
    spills, within shared memory."""
    got = [r for r in records if r["kernel"] == "forward_ws"]
    if not _has_gluon_hopper():
        pytest.skip("this Triton has no Gluon for Hopper")
    for r in got:
        tag = f"forward_ws D={r['head_dim']} causal={r['causal']} {r['variant']}"
        assert r["UTMALDG"] > 0 and r["HGMMA"] > 0 and r["HMMA"] == 0, tag
        assert r["USETMAXREG"] > 0, f"{tag}: no register reallocation between the partitions"
        if r["variant"] == "plain":  # the launch default; the off-by-default settings may spill
            # (ping-pong under a causal mask at D=128: 8 bytes a thread with Triton 3.9, none with 3.6)
            assert r["stack"] == 0 and r["LDL"] == 0, f"{tag}: spills"
        assert r["shared"] <= _SHARED_LIMIT, f"{tag}: {r['shared']} bytes of shared memory"
        # S_j issued while P_{j-1} V_{j-1} is in flight: the compiled loop keeps two groups going
        assert r["WGMMA_OVERLAP"] > 0, f"{tag}: every wgmma group is waited for before the next"


def test_fused_backward_adds_dq_by_tma_bulk_reduce(records):
    """The fused backward's key-block kernel with ``FUSED_DQ=2``: each dQ tile leaves by a TMA
    bulk reduce-add (UTMAREDG), no element atomics, products by wgmma, within shared memory."""
    got = [r for r in records if r["kernel"] == "dkdv_fused_tma"]
    assert got
    for r in got:
        tag = f"dkdv_fused_tma D={r['head_dim']} causal={r['causal']} {r['shape']}"
        assert r["UTMAREDG"] > 0 and r["REDG"] == 0, f"{tag}: dQ not added by TMA"
        assert r["HGMMA"] > 0 and r["HMMA"] == 0, f"{tag}: not wgmma"
        assert r["shared"] <= _SHARED_LIMIT, f"{tag}: {r['shared']} bytes of shared memory"


def test_overlap_count_reads_the_waits():
    from bench.kernel_resources import wgmma_overlap

    serial = "WARPGROUP.ARRIVE\nHGMMA a\nWARPGROUP.DEPBAR.LE gsb0, 0x0\nWARPGROUP.ARRIVE\nHGMMA b\n"
    overlapped = "WARPGROUP.ARRIVE\nHGMMA a\nWARPGROUP.ARRIVE\nHGMMA b\nWARPGROUP.DEPBAR.LE gsb0, 0x1\n"
    assert wgmma_overlap(serial) == 0 and wgmma_overlap(overlapped) == 1


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_chosen_shapes_use_tma_and_wgmma_without_spills(records, kernel):
    for r in (r for r in records if r["kernel"] == kernel):
        tag = f"{kernel} D={r['head_dim']} causal={r['causal']} {r['variant']} {r['shape']}"
        assert r["UTMALDG"] > 0, f"{tag}: no TMA loads"
        assert r["HGMMA"] > 0 and r["HMMA"] == 0, f"{tag}: not wgmma"
        assert r["stack"] == 0 and r["LDL"] == 0, f"{tag}: spills {r['stack']} bytes a thread"
        assert r["shared"] <= _SHARED_LIMIT, f"{tag}: {r['shared']} bytes of shared memory"
        assert r["UTMASTG"] > 0, f"{tag}: no TMA store"
