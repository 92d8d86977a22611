"""`rldiag app`'s server warms up (rldiag.app.dashboard.serve.warm): the imports and the store's client,
then the objects they made are frozen out of the garbage collector's full collections; garbage made
afterwards is still collected. In a fresh interpreter: freezing this one would change every later test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, json, sys, weakref
    from rldiag.app.dashboard import serve

    before = gc.get_freeze_count()
    serve.warm()
    frozen = gc.get_freeze_count()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made after warming: garbage once dropped
    gone = weakref.ref(a)
    del a, b
    gc.collect(2)
    print(json.dumps({"before": before, "frozen": frozen, "store_module": "mlflow.store.tracking.sqlalchemy_store"
                      in sys.modules, "cycle_collected": gone() is None}))
""")


def test_warm_imports_opens_the_store_and_freezes_what_it_made(store_uri, tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "RLDIAG_TRACKING_URI": store_uri})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == 0 and got["frozen"] > 100_000  # the imports' modules, classes and functions
    assert got["store_module"] and got["cycle_collected"]
