"""Client load through a proxy while a test changes something underneath (the fleet, kvroute)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.polling import wait_for


class Load:
    """Client threads through ``url`` until stopped, each sending ``request(client, worker, i, sent)``
    (its i-th, from 0) in turn. ``results``: (status, the backend that answered or the error, the
    client's clock when it sent the request)."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url = url
        self.results: list[tuple[int, str, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(threads)]

    def request(self, c: httpx.Client, worker: int, i: int, sent: float) -> httpx.Response:
        raise NotImplementedError

    def _run(self, worker: int) -> None:
        with httpx.Client(base_url=self.url, timeout=15) as c:
            i = 0
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    r = self.request(c, worker, i, sent)
                    self.results.append((r.status_code, r.json().get("backend", r.text), sent))
                except (httpx.HTTPError, ValueError) as e:
                    self.results.append((0, repr(e), sent))
                i += 1

    def settle(self, requests: int = 20) -> None:
        """Let at least ``requests`` more requests complete."""
        n = len(self.results)
        wait_for(lambda: len(self.results) >= n + requests, 20, f"{requests} more requests")

    def failed(self) -> list[tuple[int, str, float]]:
        return [r for r in self.results if r[0] != 200]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
