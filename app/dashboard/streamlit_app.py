"""rldiag's dashboard: `rldiag app`, or `streamlit run app/dashboard/streamlit_app.py` with rldiag installed.

The entry script Streamlit runs; the frame and the pages are in `rldiag.app.dashboard.shell`.
"""

from rldiag.app.dashboard.shell import main

main()
