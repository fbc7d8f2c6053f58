"""A heartbeat watchdog: the loop stamps progress; no stamp for `limit_s` seconds ends the process."""
import threading
import time
from typing import Callable


class Watchdog:
    """Catches what collective timeouts cannot see: a stuck data loader, a rank stuck in Python.

    `beat()` is called at every micro-batch and step boundary. A daemon thread checks the last
    stamp; after `limit_s` without one it calls `on_expire(seconds_since_last_beat)`, which must end
    the process (the training thread is stuck by definition, so it cannot be unwound).
    """

    def __init__(self, limit_s: float, on_expire: Callable[[float], None]):
        self.limit_s, self.on_expire = limit_s, on_expire
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="zero3d-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        interval = min(1.0, self.limit_s / 10)
        while not self._stopped.wait(interval):
            idle = time.monotonic() - self._last
            if idle > self.limit_s:
                self.on_expire(idle)
                return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
