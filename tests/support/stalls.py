"""Watching for event-loop stalls from another caller's side: :class:`LoadsWatch` calls ``Loads``
every 50 ms while a block runs and records the slowest answer (the hostile tests' stall bound)."""

from __future__ import annotations

import threading
import time

from ferrum_client import Client


class LoadsWatch:
    """Calls alice's ``Loads`` every 50 ms while the block runs; ``worst`` is the slowest answer."""

    def __init__(self, client: Client, model_id: str = "") -> None:
        self.client = client
        self.model_id = model_id
        self.worst = 0.0
        self.calls = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.client.loads(self.model_id) if self.model_id else self.client.loads()
            self.worst = max(self.worst, time.perf_counter() - t0)
            self.calls += 1
            self._stop.wait(0.05)

    def __enter__(self) -> "LoadsWatch":
        self._t.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._t.join(60)
