"""The Compare page names the detector options its verdicts ran with where they are not the defaults
(`rldiag app --detector k=7` exports $RLDIAG_DETECTOR to the page's process), as every report's header does:
an option that changes every verdict is never silent. With the defaults it says nothing extra."""

from __future__ import annotations

from rldiag.app.analysis.divergence import DETECTOR_ENV
from tests.helpers.dashboard import app, unescape_md


def _captions(at) -> list[str]:
    return [unescape_md(c.value) for c in at.caption]


def test_the_compare_page_names_detector_options_that_are_not_the_defaults(dash_store, monkeypatch):
    monkeypatch.setenv(DETECTOR_ENV, "k=7 windows=11,21,41")
    at = app(dash_store.uri, monkeypatch, "compare")
    named = [c for c in _captions(at) if c.startswith("Detector options: ")]
    assert named == ["Detector options: k=7.0, windows=11,21,41 (rldiag app --detector; the defaults suit "
                     "most runs)."], _captions(at)


def test_with_the_defaults_the_page_says_nothing_extra(dash_store, monkeypatch):
    monkeypatch.delenv(DETECTOR_ENV, raising=False)
    at = app(dash_store.uri, monkeypatch, "compare")
    assert not [c for c in _captions(at) if "Detector options" in c], _captions(at)
