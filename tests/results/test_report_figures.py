"""The report figures' rules, each on inputs whose answer is known: the grid's columns, the y range of accuracy and
size panels, which curves coincide, each run's colour, line style and marker, and text kept as text in the SVG."""

from __future__ import annotations

import re

import pytest

from pflbed.results.report_figures import (
    Panel,
    Series,
    _grid_columns,
    _points,
    _value,
    _with_titles,
    _y_range,
    curves_svg,
    histogram_svg,
    run_series,
)


@pytest.mark.parametrize(("panels", "columns"), [(1, 1), (3, 3), (4, 4), (5, 3), (6, 3), (7, 4), (8, 4), (9, 3),
                                                 (12, 4)])  # fmt: skip
def test_the_grid_has_4_columns_or_3_where_that_leaves_fewer_empty_cells(panels, columns):
    assert _grid_columns(panels) == columns


class _Axis:
    """The y limits matplotlib chose (`lim`), and those `_y_range` sets."""

    def __init__(self, lim: tuple[float, float]) -> None:
        self.lim = lim

    def get_ylim(self) -> tuple[float, float]:
        return self.lim

    def set_ylim(self, lo: float, hi: float) -> None:
        self.lim = (lo, hi)


@pytest.mark.parametrize(("unit", "lim", "want"), [
    ("%", (10.0, 90.0), (10.0, 90.0)),  # within 0-100 and taller than 5 points: as chosen
    ("%", (40.0, 42.0), (38.5, 43.5)),  # a flat curve: 5 points tall around its middle
    ("%", (40.0, 45.5), (40.0, 45.5)),
    ("%", (0.5, 5.5), (0.5, 5.5)),  # above 5 %: not pulled down to 0
    ("%", (-0.04, 0.04), (0, 5)),  # at 0 %: from 0 up to 5
    ("%", (-5.0, 120.0), (0, 100)),  # never outside 0-100
    ("MB", (14.7, 15.1), (0, pytest.approx(16.61))),  # sizes from 0, with a tenth above the largest
    ("MB", (-0.05, 0.0), (0, 1e-9)),
    ("", (0.2, 0.3), (0.2, 0.3)),  # another unit: as chosen
])  # fmt: skip
def test_the_y_range_of_accuracies_and_of_sizes(unit, lim, want):
    ax = _Axis(lim)
    _y_range(ax, unit)
    assert ax.lim == want


def test_curves_coincide_when_their_points_agree_to_nine_decimals():
    def points(values: list[float]) -> tuple:
        return _points(Series("r", "#000", [1, 2], values))

    assert points([0.1 + 0.2, 0.5]) == points([0.3, 0.5 + 3e-10]) == ((1, 2), (0.3, 0.5))
    assert points([0.3, 0.5]) != points([0.3, 0.5 + 3e-9])
    assert _points(Series("r", "#000", [1, 3], [0.3, 0.5])) != points([0.3, 0.5])  # other rounds


def test_each_run_has_its_own_colour_line_style_and_marker_in_every_panel():
    assert run_series(5, "r", [1], [2.0]) == Series("r", "#8c564b", [1], [2.0], "--", "P")
    assert run_series(9, "q", [], []) == Series("q", "#17becf", [], [], "--", "s")
    assert run_series(10, "q", [], []).colour == "#1f77b4"  # the colours come round again after ten


def test_the_curves_keep_their_words_as_text_in_an_svg_element_that_is_the_same_bytes_each_time():
    def drawn() -> str:
        series = [run_series(0, "fedavg", [1, 2], [40.0, 50.0])]
        return curves_svg([Panel("pfl_acc", "P-FL accuracy", "%", "%", series)])

    svg = drawn()
    assert ">P-FL accuracy</text>" in svg and ">fedavg</text>" in svg  # searchable, not glyph outlines
    assert svg.startswith("<svg ") and "<metadata" not in svg and "rdf" not in svg  # to inline: no prolog, no RDF
    assert re.match(r"<svg [^>]*>\n <defs>", svg)  # the metadata gone, nothing in its place
    assert "<title>fedavg · round 2 · P-FL accuracy: 50.00 %</title>" in svg  # each point's tooltip
    assert drawn() == svg


def test_each_marker_of_a_line_gets_its_tooltip_and_a_line_whose_markers_do_not_match_is_left_alone():
    svg = ('<g id="a"><g><use x="1"/><use x="2"/></g></g>'  # at the very start
           '<g id="b"><g><use x="3"/></g></g><g id="c"><g><use x="4"/></g></g>')  # fmt: skip
    tips = {"gone": ["?"], "a": ["run · round 1: 1 %", "<b> & c"], "b": ["one", "two"], "c": ["last"]}
    assert _with_titles(svg, tips) == (
        '<g id="a"><g><g><title>run · round 1: 1 %</title><use x="1"/></g><g><title>&lt;b&gt; &amp; c</title>'
        '<use x="2"/></g></g></g><g id="b"><g><use x="3"/></g></g><g id="c"><g><g><title>last</title><use x="4"/>'
        '</g></g></g>')  # fmt: skip


@pytest.mark.parametrize(("v", "text"), [(0.123456, "0.1235"), (-0.5, "-0.5"), (1.0, "1.00"), (1.5, "1.50"),
                                         (87.254, "87.25")])  # fmt: skip
def test_a_tooltip_s_value_has_four_significant_digits_below_1_and_two_decimals_from_1(v, text):
    assert _value(v) == text


def test_the_histogram_is_6_5_by_2_8_inches_with_its_words_as_text():
    svg = histogram_svg([("fedavg", "#1f77b4", [50.0, 60.0]), ("none", "#ff7f0e", [])])
    assert svg.startswith("<svg") and 'width="468pt" height="201.6pt"' in svg  # at 72 pt per inch
    assert ">fedavg</text>" in svg and ">none</text>" not in svg  # a run without clients' figures: not drawn
