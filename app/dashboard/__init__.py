"""The Streamlit dashboard (`rldiag app`): runs overview, metric comparison, NaN events, config diff.

`streamlit_app.py` is the entry (sidebar and page routing), one module per page, `data.py` the cached
loaders. This package's import is light (no streamlit): `launch.py` imports it for `rldiag app --help`.
"""

from __future__ import annotations

from rldiag.collectors.settings import EnvVar

# How `rldiag app` hands its options to the Streamlit process (one place, as collectors/settings.py).
RLDIAG_TRACKING_URI = EnvVar("RLDIAG_TRACKING_URI", None,
                             "The dashboard's tracking store; unset: MLFLOW_TRACKING_URI, else ./mlruns.db.")
RLDIAG_EXPERIMENT = EnvVar("RLDIAG_EXPERIMENT", None, "The experiment the dashboard opens with.")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # server addresses on which a typed URI may be allowed
RLDIAG_ALLOW_URI_INPUT = EnvVar("RLDIAG_ALLOW_URI_INPUT", "0",
                                "1: the sidebar takes a typed tracking URI (`rldiag app --allow-uri-input`; "
                                "honoured only while the server listens on localhost).")
RLDIAG_REFRESH_S = EnvVar("RLDIAG_REFRESH_S", "10", "Seconds between live refreshes while a picked run is RUNNING.")

__all__ = ["LOCAL_HOSTS", "RLDIAG_ALLOW_URI_INPUT", "RLDIAG_EXPERIMENT", "RLDIAG_REFRESH_S", "RLDIAG_TRACKING_URI"]
