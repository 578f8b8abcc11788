"""Layer names shortened from the middle, the name filter, log bars and the heatmap's scale."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tdbg.model.names import matching, shorten
from tdbg.tui.widgets.glyphs import log_bar, spark
from tdbg.tui.widgets.gradient_heatmap import fit_scale, sci

GPT2 = "transformer.h.1.attn.c_proj.weight"


def test_a_name_that_fits_is_unchanged() -> None:
    assert shorten("blocks.0.attn.weight", 20) == "blocks.0.attn.weight"
    assert shorten("", 5) == ""


@pytest.mark.parametrize("width", range(0, 40))
def test_a_shortened_name_fits_its_width(width: int) -> None:
    for name in (GPT2, "model.layers.12.self_attn.q_proj.weight", "x" * 50, "a.b", "netG fc"):
        short = shorten(name, width)
        assert len(short) <= width
        if len(name) > width >= 1:
            assert "…" in short


def test_the_tail_is_kept_and_the_middle_goes() -> None:
    assert shorten(GPT2, 27) == "tran…h.1.attn.c_proj.weight"
    assert shorten(GPT2, 30) == "transfo…h.1.attn.c_proj.weight"
    # The layer's index outlives the components around it.
    assert shorten(GPT2, 20) == "tran…1…c_proj.weight"
    assert shorten(GPT2, 12) == "tra…1…weight"
    long = "encoder.transformer.layers.3.self_attention.output_projection.weight"
    assert shorten(long, 17) == "encoder…3…weight"
    assert shorten(long, 30) == "enc…3…output_projection.weight"
    # One long component keeps its two ends.
    assert shorten("averyveryverylongcomponentwithoutdots_weight", 12) == "ave…s_weight"


def test_no_part_of_a_number_is_shown() -> None:
    # "blocks.1…" of blocks.10 would read as layer 1, "…0.attn" as layer 0.
    for width in range(6, 21):
        short = shorten("blocks.10.attn.weight", width)
        assert "1…" not in short and "…0" not in short, short
    assert shorten("blocks.10.attn.weight", 20) == "block…10.attn.weight"
    assert shorten("blocks.10.attn.weight", 16) == "…10.attn.weight"


def test_matching_is_every_term_case_insensitive() -> None:
    names = ["blocks.0.attn.weight", "blocks.1.attn.weight", "blocks.1.mlp.weight", "netD FC"]
    assert matching(names, "") == [0, 1, 2, 3]
    assert matching(names, "  ") == [0, 1, 2, 3]
    assert matching(names, "ATTN") == [0, 1]
    assert matching(names, "attn 1.") == [1]
    assert matching(names, "netd fc") == [3]
    assert matching(names, "conv") == []


def test_log_bar_has_a_floor_for_any_finite_nonzero_norm() -> None:
    lo, span = -9.0, 9.0  # 1e-9 ... 1
    assert log_bar(1e-9, lo, span, 8) == "█" + " " * 7  # the smallest layer: one cell
    assert log_bar(1e-12, lo, span, 8).startswith("█")  # below the range: still a cell
    assert log_bar(1.0, lo, span, 8) == "█" * 8
    assert log_bar(0.0, lo, span, 8) == " " * 8  # only an exact zero is empty
    assert log_bar(math.nan, lo, span, 8) == "×" * 8
    assert log_bar(math.inf, lo, span, 8) == "×" * 8
    middle = log_bar(1e-4, lo, span, 8).rstrip()
    assert 1 < len(middle) < 8


def test_spark_on_shared_bounds_compares_rows() -> None:
    small, large = [1e-3, 1e-3, 1e-3], [1e2, 1e2, 1e2]
    # Each on its own scale: two flat rows that look alike.
    assert spark(small, 3, log=True) == spark(large, 3, log=True)
    # On one scale the larger row stands taller.
    bounds = (-3.0, 2.0)
    assert spark(small, 3, log=True, bounds=bounds) == "▁▁▁"
    assert spark(large, 3, log=True, bounds=bounds) == "███"


def test_heatmap_scale_fits_the_data_not_one_outlier() -> None:
    rng = np.random.default_rng(0)
    logs = rng.normal(-1.0, 0.4, size=(12, 50))
    logs[3] = -9.0  # one vanished layer
    lo, hi = fit_scale(logs)
    assert -3.0 < lo < -1.0 and -1.0 < hi < 1.0  # the typical layers span the colours
    assert hi - lo >= 1.0


def test_heatmap_scale_is_at_least_a_decade() -> None:
    lo, hi = fit_scale(np.full((4, 4), -2.0))
    assert (lo, hi) == (-2.5, -1.5)
    lo, hi = fit_scale(np.full((2, 2), np.nan))
    assert hi - lo == 1.0


def test_sci_is_short() -> None:
    assert sci(-3.0) == "1e-3"
    assert sci(2.0) == "1e2"
    assert sci(math.log10(4e-3)) == "4e-3"


def test_spark_marks_nan_apart_from_zero_and_from_no_value() -> None:
    # A zero norm on a log scale is the floor, not the NaN mark; a value that is not there (a
    # layer not come yet, an optimizer added later) is a blank.
    nan = math.nan
    assert spark([0.0, 1e-3, 1.0, nan], 4, log=True) == "▁▁█!"
    assert spark([0.0, 0.0], 2, log=True) == "▁▁"
    assert spark([nan, nan, 1.0, 2.0], 4, gaps=[True, False, False, False]) == " !▁█"
    assert spark([nan, nan], 2, gaps=[True, True]) == "  "
