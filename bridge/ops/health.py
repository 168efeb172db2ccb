"""HTTP endpoints of a running bridge: Prometheus ``/metrics``, ``/healthz`` and ``/readyz``.

The server knows nothing about the bridge: it is given the metrics registry and two callables
that answer ``(ok, details)``; ``details`` is sent as the JSON body (200 when ok, else 503).
It runs in a daemon thread (stdlib ``ThreadingHTTPServer``), so a slow probe never delays the
bridge's event loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Probe = Callable[[], tuple[bool, dict[str, Any]]]

ENDPOINTS = ("/metrics", "/healthz", "/readyz")


class HealthServer:
    """``HealthServer(registry, alive, ready).start(port, host)``; ``close()`` stops it."""

    def __init__(self, registry: CollectorRegistry, alive: Probe, ready: Probe) -> None:
        self.registry = registry
        self.alive = alive
        self.ready = ready
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (useful after ``start(0)``)."""
        assert self._server is not None, "not started"
        return int(self._server.server_address[1])

    def start(self, port: int, host: str = "0.0.0.0") -> HealthServer:
        """Bind ``host:port`` (0 = any free port) and serve in a daemon thread."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                owner._handle(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("http %s: " + format, self.client_address[0], *args)

        try:
            server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise RuntimeError(
                f"cannot serve metrics and health on {host}:{port}: {exc.strerror}; choose "
                "another --metrics-port (0 turns the endpoint off)"
            ) from exc
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="kvbridge-http", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0].rstrip("/") or "/"
        if path == "/metrics":
            _send(req, 200, CONTENT_TYPE_LATEST, generate_latest(self.registry))
        elif path in ("/healthz", "/readyz"):
            probe = self.alive if path == "/healthz" else self.ready
            try:
                ok, details = probe()
            except Exception as exc:  # a probe must answer, not kill the request thread
                log.exception("%s probe failed", path)
                ok, details = False, {"error": f"probe failed: {exc}"}
            body = json.dumps({"ok": ok, **details}, default=str).encode()
            _send(req, 200 if ok else 503, "application/json", body)
        else:
            body = json.dumps({"error": f"no such endpoint {path}", "endpoints": ENDPOINTS})
            _send(req, 404, "application/json", body.encode())


def _send(req: BaseHTTPRequestHandler, status: int, ctype: str, body: bytes) -> None:
    req.send_response(status)
    req.send_header("Content-Type", ctype)
    req.send_header("Content-Length", str(len(body)))
    req.send_header("Cache-Control", "no-store")
    req.end_headers()
    req.wfile.write(body)
