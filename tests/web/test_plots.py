"""The SVG plots and the histograms behind them: well-formed SVG, heights in proportion, every
text escaped."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np

from tarshards.web.data import field_kind, histogram
from tarshards.web.plots import bar_chart, histogram_chart, human_bytes, scatter

SVG = "{http://www.w3.org/2000/svg}"


def _bars(svg: str) -> list[float]:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    return [float(r.get("height")) for r in root.iter(f"{SVG}rect")]


def test_bar_heights_are_in_proportion_and_labels_escaped():
    svg = bar_chart(["a", "<script>x</script>", "c"], [1, 4, 2], "<b>title</b>")
    assert "<script>" not in svg and "<b>" not in svg and "&lt;script&gt;" in svg
    h = _bars(svg)
    assert len(h) == 3 and abs(h[1] / h[0] - 4) < 1e-2 and abs(h[2] / h[0] - 2) < 1e-2


def test_histograms():
    sizes = np.array([1, 1, 2, 5, 5, 5], dtype=np.int64)  # small integer range: a bin per value
    hist = histogram(sizes)
    assert hist["counts"] == [2, 1, 0, 0, 3] and hist["integers"]
    assert len(_bars(histogram_chart(hist, "sizes", unit="bytes"))) == 5
    wide = histogram(np.array([10, 100, 1000, 100_000]))  # a factor > 100: log bins
    assert wide["log"] and sum(wide["counts"]) == 4 and wide["edges"][0] == 10
    floats = histogram(np.linspace(0.0, 1.0, 101))
    assert not floats["log"] and sum(floats["counts"]) == 101 and len(floats["counts"]) == 30
    assert histogram(np.array([7, 7, 7]))["counts"] == [3]
    assert histogram(np.array([], dtype=np.int64))["counts"] == [0]


def test_scatter_and_units():
    svg = scatter([(10, 20), (10, 20), (30, 5)], "sizes", xlabel="w", ylabel="h")
    root = ET.fromstring(svg)
    assert len(list(root.iter(f"{SVG}circle"))) == 2  # one per distinct point
    assert human_bytes(999) == "999 B" and human_bytes(1500) == "1.5 kB"
    assert human_bytes(12_300_000) == "12.3 MB"


def test_field_kinds():
    names = ("jpg", "seg.png", "json", "txt", "cls", "npy", "flac", "left.MP4", "opus", "mkv")
    assert [field_kind(n) for n in names] == [
        "image",
        "image",
        "json",
        "text",
        "text",
        "binary",
        "audio",
        "video",
        "audio",
        "video",
    ]
