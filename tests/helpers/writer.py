"""Helpers for tests of rldiag's metric writer."""

from __future__ import annotations

import threading

from rldiag.collectors.writer import MetricWriter


class RamWatch:
    """The writer's memory backlog (entries of batches held in RAM), sampled every 5 ms while a test runs;
    `stop()` returns the peak."""

    def __init__(self, w: MetricWriter):
        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, args=(w,), daemon=True)
        self._t.start()

    def _run(self, w: MetricWriter) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, w._ram_points)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak
