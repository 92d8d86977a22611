"""bench.team_load at a small size: several training processes into one PostgreSQL-backed `mlflow server`
with 2 workers, the server SIGKILLed and restarted in the middle; nothing lost, nothing duplicated.

(Without PostgreSQL's binaries this fails with the fix, `sudo make sysdeps`, as tests/deploy does.)
"""

from __future__ import annotations

import pytest

from tests.helpers.bench_code import run_load
from tests.helpers.postgres import PostgresMissing


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.postgres
def test_writers_into_one_postgres_backed_server_killed_once_lose_and_duplicate_nothing():
    # 3 writers x 10 metrics x 10 steps/s x 6 s = 1800 points, the server down for 2 s plus its restart
    try:
        r = run_load(writers=3, metrics=10, rate=10, seconds=6, down_s=2, close_timeout=300)
    except PostgresMissing as e:
        pytest.fail(str(e), pytrace=False)
    assert r["expected"] == 3 * 10 * 60
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["stored_distinct"] == 1800
    for w in r["writers"]:
        assert w["undelivered"] == 0 and w["delivered"] == 600
        assert w["send_failures"] > 0  # each writer met the outage (it logged through it)


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.postgres
def test_points_still_in_the_journals_after_the_close_timeout_count_as_not_yet_delivered_not_lost():
    # 2 writers x 10 metrics x 10 steps/s x 6 s = 1200 points. The server is killed at ~3 s and stays
    # down 8 s (plus its restart), so when the writers close at ~6 s with a 1 s timeout the points
    # since the kill are only in their journals: the bench must count them as not yet delivered,
    # and stored + not yet delivered must be every point, none lost.
    try:
        r = run_load(writers=2, metrics=10, rate=10, seconds=6, down_s=8, close_timeout=1)
    except PostgresMissing as e:
        pytest.fail(str(e), pytrace=False)
    assert r["expected"] == 2 * 10 * 60
    assert r["lost"] == 0 and r["duplicated"] == 0
    assert r["not_yet_delivered"] > 0
    assert r["stored_distinct"] + r["not_yet_delivered"] == 1200
    for w in r["writers"]:  # each writer's own close message counted them too (points, no tags here)
        assert w["undelivered"] >= w["not_yet_delivered"] > 0
