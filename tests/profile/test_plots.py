"""The figures of :mod:`jaxmem._src.plots`: what a reader sees in them (titles, every legend
entry, value labels), read back from the matplotlib figures."""

import matplotlib

matplotlib.use("Agg")

import numpy as np

from jaxmem._src import plots


def _legend_texts(fig):
    (ax,) = fig.axes
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_timeline_names_every_band_underscored_modules_included():
    """matplotlib's automatic legend drops labels starting with ``_``; the timeline's bands are
    source lines, and optax's loss lives in ``_classification.py``."""
    labels = ["_classification.py:400 (softmax_cross_entropy)", "model.py:12 (mlp)", "other"]
    layers = np.array([[1.0, 3.0, 1.0], [2.0, 2.0, 0.0], [0.5, 0.5, 0.5]]) * 2**20
    fig = plots.live_timeline(layers, labels, 1, int(5.5 * 2**20), "live memory", "test")
    assert _legend_texts(fig) == labels


def test_grouped_bars_label_each_value_and_keep_the_legend_off_the_data():
    table = {"stock": [3 * 2**20, 2**20], "_lean": [2**20, None]}
    fig = plots.grouped_bytes_bars(["temp", "argument"], table, "memory", "test")
    (ax,) = fig.axes
    assert _legend_texts(fig) == ["stock", "_lean"]
    texts = {t.get_text() for t in ax.texts}
    assert {"3.00 MiB", "1.00 MiB"} <= texts, texts
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # right of the axes
