"""The gemm_fp8 bench section on the CPU: its shapes' rows and routing (DeepGEMM's contiguous
layout, unique slots per rank, padding owned by no rank) and its table rendered from results
alone, with every ratio named with its target."""
from __future__ import annotations

import numpy as np

from p3send.abi.layout import decode_range_table, encode_range_table
from p3send.bench import gemm_fp8
from p3send.oracle import fp8


def test_shapes_are_fixed_and_drawn_as_deepgemm_draws_them():
    for name, (e, mean, _) in gemm_fp8.SHAPES.items():
        rpe = gemm_fp8.rows_per_expert(name)
        assert len(rpe) == e and (rpe >= int(0.7 * mean)).all() and (rpe <= round(1.3 * mean)).all()
        assert np.array_equal(rpe, gemm_fp8.rows_per_expert(name))


def test_routing_owns_every_real_row_once_and_no_padding_row():
    rpe = gemm_fp8.rows_per_expert("decode")
    off, m_idx = fp8.contiguous_layout(rpe)
    counts, src, max_tok = gemm_fp8.routing(np.random.default_rng(3), off, rpe, 8, 8)
    assert (counts.sum(axis=1) == rpe).all()
    lo, hi = decode_range_table(encode_range_table(off, counts), len(rpe), 8)
    owned = np.zeros(int(off[-1]), np.int64)
    for e in range(len(rpe)):
        for rk in range(8):
            owned[lo[e, rk]:hi[e, rk]] += 1
            slots = src[lo[e, rk]:hi[e, rk]]
            assert ((slots[:, 0] >= 0) & (slots[:, 0] < max_tok) & (slots[:, 1] >= 0) & (slots[:, 1] < 8)).all()
    assert np.array_equal(owned, (m_idx >= 0).astype(np.int64)), "a padding row is owned, or a real row is not"
    for rk in range(8):
        rows = np.concatenate([np.arange(lo[e, rk], hi[e, rk]) for e in range(len(rpe))])
        keys = src[rows, 0] * 8 + src[rows, 1]
        assert len(np.unique(keys)) == len(keys), f"rank {rk}: two rows share a slot"


def test_table_renders_from_results_alone():
    res = {"median_us": 100.0, "pass_medians_us": [99.0, 100.0, 101.0], "min_us": 90.0, "max_us": 110.0, "n": 48,
           "TFLOPs": 10.0}
    shape = {"experts": 32, "rows": 4096, "real_rows": 965, "n": 7168, "k": 2048, "gflop_useful": 28.3,
             "weights_mb": 470.0, "fused_equals_gated_then_scatter_send": {"bm=128": True},
             "error": {"sampled_rows": 48, "max_err_over_bound": 0.06, "within_bound": True, "rel_norm": 0.0017},
             "deepgemm": "skipped: absent", "results": {"p3_gemm_fp8_send gated bm=128": res},
             "ratios": {"gemm_over_read_floor": {"value": 1.2, "passes": [1.2, 1.21, 1.19]}}}
    text = gemm_fp8.table({"gemm_fp8": {"decode": shape}})
    assert "965 real rows (4096 with padding)" in text and "deepgemm: skipped: absent" in text
    assert "gemm_over_read_floor" in text and "target <= 1.30 decode" in text
    assert gemm_fp8.table({}) == ""
    assert "skipped (needs torch" in gemm_fp8.table({"gemm_fp8": {"skipped": "needs torch"}})


def test_the_timed_variants_are_buildable_and_skippable_by_label():
    """Each variant the section times is one tools/build_gemm_fp8.py builds, and its label holds
    no comma (P3SEND_FP8_SKIP's separator: a label with one could never be skipped alone)."""
    from tests.cpu.conftest import tool_module
    build = tool_module("build_gemm_fp8")
    for name, (label, _, _) in gemm_fp8.SHAPE_VARIANTS.items():
        assert name in build.VARIANTS and "," not in label and label.startswith(f"{name}: ")


def test_a_variant_built_from_another_source_is_left_out(tmp_path, monkeypatch):
    """A variant file whose header is not the shipped PTX's (built before the source changed:
    its launch shape may differ from what the bench gives it) is not timed, and is named."""
    from p3send.cuda import loader
    shipped = (loader.ptx_dir() / "p3_gemm_fp8_send.ptx").read_text()
    (tmp_path / "p3_gemm_fp8_send.fresh.ptx").write_text(shipped)
    (tmp_path / "p3_gemm_fp8_send.stale.ptx").write_text("// an older header\n" + shipped)
    monkeypatch.setenv(gemm_fp8.VARIANTS_ENV, str(tmp_path))
    monkeypatch.setattr(gemm_fp8, "STALE", {})
    assert gemm_fp8.variant_text("fresh") == shipped
    assert gemm_fp8.variant_text("stale") is None and "p3_gemm_fp8_send.stale.ptx" in gemm_fp8.STALE
    assert gemm_fp8.variant_text("absent") is None and len(gemm_fp8.STALE) == 1
