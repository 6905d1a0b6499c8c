"""A record that a peer keeps alive on the DHT: stored every ``period`` seconds with an expiration ``ttl`` ahead (a
daemon thread), withdrawn (a ``None`` value) on ``stop()``, so that it vanishes at once when the peer leaves cleanly
and within ``ttl`` when it dies."""

from __future__ import annotations

import logging
import threading
from typing import Any

from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)


class Beacon:
    def __init__(self, dht: Any, key: str, subkey: Any, value: Any, *, period: float, ttl: float, name: str) -> None:
        if not 0 < period < ttl:
            raise ValueError(f"a beacon stores its record more often than it expires: 0 < period ({period}) < ttl "
                             f"({ttl}) expected")
        self._dht, self._key, self._subkey, self._value = dht, key, subkey, value
        self._period, self._ttl, self._name = period, ttl, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"swarm_opt.{name}", daemon=True)

    def start(self) -> Beacon:
        self._thread.start()
        return self

    def publish(self, value: Any) -> bool:
        """Change the record's value and store it now, in the caller's thread; whether the DHT accepted it."""
        self._value = value
        return self.store_now()

    def store_now(self) -> bool:
        """Store the record once, in the caller's thread; whether the DHT accepted it."""
        try:
            return bool(self._dht.store(self._key, self._value, get_dht_time() + self._ttl, subkey=self._subkey))
        except Exception as e:  # noqa: BLE001 (the next period retries; a failed store only delays readers)
            logger.debug("Publishing the %s record failed: %r", self._name, e)
            return False

    def _run(self) -> None:
        while True:
            self.store_now()
            if self._stop.wait(self._period):
                break

    def stop(self, *, withdraw: bool = True) -> None:
        """Stop refreshing and, with ``withdraw``, replace the record by ``None`` so that readers forget it now."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5.0)  # at most one store in flight
        if withdraw:
            try:
                self._dht.store(self._key, None, get_dht_time() + self._ttl, subkey=self._subkey)
            except Exception as e:  # noqa: BLE001 (the record then expires within ttl)
                logger.debug("Withdrawing the %s record failed: %r", self._name, e)
