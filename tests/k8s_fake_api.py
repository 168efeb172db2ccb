"""A local HTTP stand-in for the Kubernetes API's pod list and watch, serving recorded responses.

``GET /api/v1/namespaces/<ns>/pods?labelSelector=...`` answers with ``pod_list``;
``...&watch=true&resourceVersion=...`` answers with a chunked stream of newline-delimited watch
events that the test pushes with :meth:`FakeKubeAPI.push` (:data:`END` ends the stream, as the
API server does when the watch's timeoutSeconds pass). Every request is recorded.
"""

from __future__ import annotations

import copy
import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

FIXTURES = Path(__file__).parent / "fixtures" / "k8s"
END = object()


def load_podlist() -> dict[str, Any]:
    return json.loads((FIXTURES / "podlist.json").read_text())


def load_watch_events() -> list[dict[str, Any]]:
    lines = (FIXTURES / "watch-events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``Status`` object as the API server returns it for errors."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubeAPI:
    def __init__(self, namespace: str, pod_list: dict[str, Any]) -> None:
        self.namespace = namespace
        self.pod_list = pod_list
        self.events: queue.Queue[Any] = queue.Queue()
        self.requests: list[tuple[str, dict[str, str]]] = []  # ("list"|"watch", query)
        self.fail_next: list[tuple[str, int, dict[str, Any]]] = []  # (kind, http status, body)
        self.closing = threading.Event()
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _json(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                kind = "watch" if query.get("watch") == "true" else "list"
                with api.lock:
                    api.requests.append((kind, query))
                    fail = next((f for f in api.fail_next if f[0] == kind), None)
                    if fail is not None:
                        api.fail_next.remove(fail)
                if url.path != f"/api/v1/namespaces/{api.namespace}/pods":
                    self._json(404, status(404, "NotFound", f"no route {url.path}"))
                    return
                if fail is not None:
                    self._json(fail[1], fail[2])
                    return
                if kind == "list":
                    with api.lock:
                        body = copy.deepcopy(api.pod_list)
                    self._json(200, body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                while not api.closing.is_set():
                    try:
                        item = api.events.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if item is END:
                        break
                    line = json.dumps(item, separators=(",", ":")).encode() + b"\n"
                    try:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    except OSError:  # the client went away (stop())
                        return
                    if item.get("type") == "ERROR":
                        break  # the API server ends a watch after an ERROR event
                try:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:
                    pass
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.host = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeKubeAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def push(self, *events: Any) -> None:
        for e in events:
            self.events.put(e)

    def set_pods(self, items: list[dict[str, Any]], resource_version: str) -> None:
        with self.lock:
            self.pod_list = {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": resource_version},
                "items": copy.deepcopy(items),
            }

    def count(self, kind: str) -> int:
        with self.lock:
            return sum(1 for k, _ in self.requests if k == kind)

    def last(self, kind: str) -> dict[str, str]:
        with self.lock:
            return [q for k, q in self.requests if k == kind][-1]

    def core_api(self) -> Any:
        """The official client's CoreV1Api pointed at this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.host
        return client.CoreV1Api(client.ApiClient(cfg))
