"""The Streamlit server process of `rldiag app`: `python -m rldiag.app.dashboard.serve run APP [options]`
is `streamlit run APP [options]`, with the first page load's fixed costs paid while the server starts.

Without it, the first visitor waits for imports (MLflow's SQL store alone: about 2 s on 2 cores) and
for the store's client to be built. Here a background thread imports the dashboard's pages (Streamlit,
pandas, plotly) and MLflow's store classes, then opens the store `rldiag app` was given: modules are
shared by every script run in this process. A failure there changes nothing: the page reports it.

Then the objects those imports made (about 300k: modules, classes, MLflow's SQLAlchemy metadata) are
moved out of the garbage collector's sight (`gc.freeze`). Streamlit runs a full collection after every
script run (`runner.postScriptGC`), holding the interpreter lock while it walks every object: 0.25 s
of each page load on an idle 2-core machine, up to 0.9 s on a busy one, during which the server sends
nothing. Frozen, that collection walks only what the page loads made since.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading

log = logging.getLogger("rldiag.app")


def warm() -> None:
    """Import what every page load needs and build the store's client."""
    try:
        import rldiag.app.dashboard.shell  # noqa: F401 - every page, streamlit, plotly, pandas
        from rldiag.app.dashboard import RLDIAG_TRACKING_URI
        from rldiag.app.data.readonly_sql import store_class
        from rldiag.app.data.store import open_store

        store_class()
        uri = RLDIAG_TRACKING_URI.get()
        if uri:
            open_store(uri).client  # noqa: B018 - builds MLflow's client and its store (and their imports)
    except Exception as e:  # noqa: BLE001 - warming is an optimisation; the page shows any real problem
        log.debug("rldiag: warming the dashboard failed (%s: %s)", type(e).__name__, e)
    freeze_heap()


def freeze_heap() -> None:
    """Collect what is garbage now, then exclude every object left (the imports' modules and classes:
    they live as long as the process) from later collections (see the module docstring)."""
    gc.collect()
    gc.freeze()


def _skip_direct_execution_check() -> None:
    """Streamlit checks, on the first element a process draws, whether it runs in a REPL or outside
    `streamlit run`, to print a warning: `inspect.stack()` over every module, 0.8 s of the first page
    load here. This process is `streamlit run`, so the check is marked done (a private flag: if a
    Streamlit release drops it, the check just runs)."""
    import streamlit.delta_generator as dg

    if hasattr(dg, "_use_warning_has_been_displayed"):
        dg._use_warning_has_been_displayed = True


def main(argv: list[str] | None = None) -> int:
    _skip_direct_execution_check()
    threading.Thread(target=warm, name="rldiag-warm", daemon=True).start()
    from streamlit.web import cli

    sys.argv = ["streamlit", *(sys.argv[1:] if argv is None else argv)]
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
