"""app/plots/colors.py: a palette whose colours a reader tells apart, candidates never grey."""

from __future__ import annotations

import itertools

import numpy as np

from rldiag.app.plots.colors import PALETTE, REFERENCE_GREYS, run_colors


def _lab(color: str) -> np.ndarray:
    """sRGB hex -> CIELAB (D65)."""
    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
    lin = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
                    [0.0193339, 0.1191920, 0.9503041]]) @ lin / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def delta_e2000(lab1, lab2) -> float:
    """CIEDE2000 colour difference (Sharma, Wu and Dalal 2005)."""
    (L1, a1, b1), (L2, a2, b2) = lab1, lab2
    c = (np.hypot(a1, b1) + np.hypot(a2, b2)) / 2
    g = 0.5 * (1 - np.sqrt(c ** 7 / (c ** 7 + 25.0 ** 7)))
    a1p, a2p = a1 * (1 + g), a2 * (1 + g)
    c1, c2 = np.hypot(a1p, b1), np.hypot(a2p, b2)
    h1, h2 = np.degrees(np.arctan2(b1, a1p)) % 360, np.degrees(np.arctan2(b2, a2p)) % 360
    dh = 0.0 if c1 * c2 == 0 else (h2 - h1 - 360 if h2 - h1 > 180 else h2 - h1 + 360 if h2 - h1 < -180 else h2 - h1)
    d_hue = 2 * np.sqrt(c1 * c2) * np.sin(np.radians(dh / 2))
    lp, cp = (L1 + L2) / 2, (c1 + c2) / 2
    if c1 * c2 == 0:
        hp = h1 + h2
    elif abs(h1 - h2) <= 180:
        hp = (h1 + h2) / 2
    else:
        hp = (h1 + h2 + 360) / 2 if h1 + h2 < 360 else (h1 + h2 - 360) / 2
    t = (1 - 0.17 * np.cos(np.radians(hp - 30)) + 0.24 * np.cos(np.radians(2 * hp))
         + 0.32 * np.cos(np.radians(3 * hp + 6)) - 0.20 * np.cos(np.radians(4 * hp - 63)))
    rt = -np.sin(np.radians(60 * np.exp(-(((hp - 275) / 25) ** 2)))) * 2 * np.sqrt(cp ** 7 / (cp ** 7 + 25.0 ** 7))
    sl = 1 + 0.015 * (lp - 50) ** 2 / np.sqrt(20 + (lp - 50) ** 2)
    sc, sh = 1 + 0.045 * cp, 1 + 0.015 * cp * t
    return float(np.sqrt(((L2 - L1) / sl) ** 2 + ((c2 - c1) / sc) ** 2 + (d_hue / sh) ** 2
                         + rt * ((c2 - c1) / sc) * (d_hue / sh)))


def test_delta_e2000_matches_sharmas_published_pairs():
    # Sharma, Wu and Dalal's test data: pairs 1, 7, 17 and 25
    for lab1, lab2, expected in [((50, 2.6772, -79.7751), (50, 0, -82.7485), 2.0425),
                                 ((50, 0, 0), (50, -1, 2), 2.3669),
                                 ((50, 2.5, 0), (73, 25, -18), 27.1492),
                                 ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644)]:
        assert abs(delta_e2000(np.array(lab1, float), np.array(lab2, float)) - expected) < 1e-4


def test_twelve_candidate_colours_apart_from_each_other_the_greys_and_the_page():
    labs = {c: _lab(c) for c in PALETTE + REFERENCE_GREYS + ("#FFFFFF",)}
    assert len(PALETTE) == 12 and len(set(PALETTE)) == 12
    pairs = {(a, b): delta_e2000(labs[a], labs[b]) for a, b in itertools.combinations(PALETTE, 2)}
    assert min(pairs.values()) >= 20, min(pairs, key=pairs.get)  # the old olive and yellow: 10
    for c in PALETTE:
        assert min(delta_e2000(labs[c], labs[g]) for g in REFERENCE_GREYS) >= 20, c  # never a reference's grey
        assert delta_e2000(labs[c], labs["#FFFFFF"]) >= 25, c  # a line that shows on the white page
        assert np.hypot(*labs[c][1:]) >= 30, c  # a colour, not a grey (chroma)


def test_up_to_twelve_picked_candidates_all_take_different_colours():
    order = [f"run{i:02d}" for i in range(30)]
    # places 0, 12 and 24 share a palette slot: picked together, the later ones take free colours
    picked = ["run00", "run12", "run24", "run05", "run13"]
    colors = run_colors(["ref", *picked], ["ref"], order=order)
    assert colors["ref"] == REFERENCE_GREYS[0] and colors["run00"] == PALETTE[0]
    assert len({colors[r] for r in picked}) == len(picked) and not set(colors.values()) & set(PALETTE) - set(
        colors.values())
    # 12 candidates outside the order (hashed): 12 colours, none grey
    hashed = run_colors([f"x{i}" for i in range(12)])
    assert len(set(hashed.values())) == 12 and not set(hashed.values()) & set(REFERENCE_GREYS)


def test_more_candidates_than_colours_differ_in_line_style():
    from rldiag.app.data.trace import Trace
    from rldiag.app.plots.figures import metric_figure

    runs = {f"c{i:02d}": Trace(f"c{i:02d}", "loss", "loss", np.arange(3), np.ones(3), np.zeros(3, np.int64))
            for i in range(15)}
    runs["ref"] = Trace("ref", "loss", "loss", np.arange(3), np.ones(3), np.zeros(3, np.int64))
    fig = metric_figure("loss", runs, reference_ids=["ref"], colors=run_colors(list(runs), ["ref"], order=list(runs)))
    styles = [(t.line.color, t.line.dash or "solid") for t in fig.data if t.name.startswith("c")]
    assert len(set(styles)) == 15 and len({c for c, _ in styles}) == 12  # 12 colours, the 3 after them dotted
    assert [d for _, d in styles].count("dot") == 3
    assert next(t for t in fig.data if t.name == "ref").line.dash is None  # the reference: solid black
