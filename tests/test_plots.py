"""The figures the CLI writes, drawn from small synthetic inputs: readable sizes, labels, colour bars,
and a perplexity plot whose curves are not flattened by the first tokens' spike (issue 14, item 6)."""

import json
import math

import matplotlib.image
import pytest
import torch

from sparseattn.evaluation import plots


def write_run(root, method, nll, seconds_per_token):
    """A finished perplexity run directory as :func:`sparseattn.evaluation.ppl.run_ppl` leaves it."""
    root.mkdir(parents=True)
    records = [{"position": 100 + i, "nll": v, "elapsed": seconds_per_token * (i + 1)} for i, v in enumerate(nll)]
    (root / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ppl = math.exp(sum(nll) / len(nll))
    (root / "summary.json").write_text(json.dumps({"method": method, "ppl": ppl, "tokens_per_second": 1 / seconds_per_token}))
    return root


@pytest.fixture
def two_runs(tmp_path):
    # Both start with the same spike (NLL 12, ppl ~160000, as at the first token of a text), then settle
    # at ppl ~ e^2.0 and ~ e^2.1: 10% apart, which a linear axis up to the spike cannot show.
    dense = [12.0] + [2.0 + 0.05 * math.sin(i) for i in range(199)]
    sparse = [12.0] + [2.1 + 0.05 * math.sin(i) for i in range(199)]
    return [write_run(tmp_path / "dense", "dense", dense, 0.01), write_run(tmp_path / "radar", "radar", sparse, 0.008)]


def png_shape(path):
    return matplotlib.image.imread(path).shape


def test_the_ppl_curves_are_cumulative_on_a_log_axis_that_holds_them_without_the_spike(two_runs, tmp_path):
    fig = plots.draw_ppl(two_runs, "two runs")
    top = fig.axes[0]
    assert top.get_yscale() == "log"
    label = top.get_ylabel()
    assert "cumulative perplexity" in label and "log scale" in label
    dense, radar = (line.get_ydata() for line in top.get_lines())
    nll = [json.loads(line)["nll"] for line in (two_runs[0] / "tokens.jsonl").read_text().splitlines()]
    assert list(dense) == pytest.approx(plots.cumulative_ppl(nll))  # the paper's running (cumulative) perplexity
    low, high = top.get_ylim()
    assert high < dense[0] / 100  # the first-token spike runs off the top ...
    settled = [*dense[50:], *radar[50:]]
    assert low <= min(settled) and max(settled) <= high  # ... the settled curves fill the axis
    # The two curves end ~10% apart: on this axis that is a visible share of the height, not a pixel.
    share = math.log(radar[-1] / dense[-1]) / math.log(high / low)
    assert share > 0.2
    out = plots.ppl_figure(two_runs, tmp_path / "ppl.png")
    assert png_shape(out)[:2] == (840, 960)


def test_the_needle_heatmap_of_one_length_is_readable_and_has_a_labelled_colour_bar(tmp_path):
    grid = [[100.0, 50.0, float("nan")]]
    fig = plots.draw_heatmap(grid, ["4096"], ["10%", "50%", "90%"], "passkey, dense", "needle depth", "prompt tokens")
    heat, bar = fig.axes  # the map and its colour bar
    assert heat.get_xlabel() == "needle depth" and heat.get_ylabel() == "prompt tokens"
    assert bar.get_ylabel() == "accuracy (%)"
    assert [t.get_text() for t in heat.texts] == ["100", "50"]  # NaN cells stay blank
    out = plots.heatmap(grid, ["4096"], ["10%", "50%", "90%"], tmp_path / "heatmap.png", "passkey, dense",
                        "needle depth", "prompt tokens")
    height, width = png_shape(out)[:2]
    assert height >= 480 and width >= 640


def test_the_heatmap_grows_with_its_grid(tmp_path):
    lengths = [str(1024 * 2**i) for i in range(8)]
    depths = [f"{d}%" for d in range(0, 101, 10)]
    out = plots.heatmap([[50.0] * len(depths)] * len(lengths), lengths, depths, tmp_path / "big.png", "t", "x", "y")
    height, width = png_shape(out)[:2]
    assert height > 480 and width > 768


def synthetic_pictures(steps=6, heads=3, tokens=40, segments=5):
    pictures = []
    for i in range(steps):
        probs = torch.softmax(torch.randn(heads, tokens + i), -1)
        exact = torch.softmax(torch.randn(heads, segments), -1)
        estimated = torch.softmax(torch.randn(heads, segments), -1)
        pictures.append((probs, exact, estimated))
    return pictures


def test_the_attention_pictures_have_labelled_axes_and_colour_bars(tmp_path):
    pictures = synthetic_pictures()
    fig = plots.draw_attention_pictures(pictures, [0, 2], "radar, layer 0")
    panels = [ax for ax in fig.axes if ax.get_images()]
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(panels) == 3 * 2 and len(fig.axes) == len(panels) + len(bars)
    for ax in panels:
        assert ax.get_xlabel() in ("key token position", "segment index") and ax.get_ylabel() == "decode step"
    # One bar for the token row, one shared by the two segment rows.
    assert sorted(ax.get_ylabel() for ax in bars) == ["attention probability", "share of the step's attention"]
    # Exact and estimated segment attention share one colour scale, so their colours compare.
    exact, estimated = (next(ax for ax in panels if ax.get_title() == f"head 0: {name}")
                        for name in ("exact segment attention", "estimated segment attention"))
    assert exact.get_images()[0].get_clim() == estimated.get_images()[0].get_clim()
    out = plots.attention_pictures(pictures, [0, 2], tmp_path / "attention.png", "radar, layer 0")
    height, width = png_shape(out)[:2]
    assert height >= 900 and width >= 900


def test_attention_pictures_without_heads_say_so(tmp_path):
    with pytest.raises(ValueError, match="no heads to draw"):
        plots.draw_attention_pictures(synthetic_pictures(), [], "t")
