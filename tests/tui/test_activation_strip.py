"""The activation table's one-line |output| distribution: known counts give known glyphs."""

from __future__ import annotations

from tdbg.protocol.messages.histograms import N_BINS, NONFINITE_BIN, ZERO_BIN, bin_labels
from tdbg.tui.widgets.activation_table import DIST_HEADER, distribution_strip


def counts(**by_label: int) -> tuple[int, ...]:
    out = [0] * N_BINS
    for label, n in by_label.items():
        out[bin_labels().index(label.replace("_", "-").replace("p", "."))] = n
    return tuple(out)


def test_one_glyph_per_decade_in_fixed_places() -> None:
    # 1e-1 and 3e-1 are one decade; 1e0 the next; the strip is as wide as its header.
    strip = distribution_strip(counts(**{"1e_1": 300, "3e_1": 500, "1e0": 200}))
    assert len(strip) == len(DIST_HEADER) == 15
    assert strip == "·" * 9 + "█▂" + "·" * 4


def test_zeros_and_non_finite_have_their_own_ends() -> None:
    hist = [0] * N_BINS
    hist[ZERO_BIN], hist[NONFINITE_BIN] = 90, 10
    assert distribution_strip(tuple(hist)) == "█" + "·" * 13 + "▁"


def test_a_single_element_still_shows_and_nothing_counted_is_blank() -> None:
    strip = distribution_strip(counts(**{">=1e3": 1, "1e_8": 10_000}))
    assert strip[2] == "█" and strip[13] == "▁"
    assert distribution_strip(None) == "" and distribution_strip((0,) * N_BINS) == ""
