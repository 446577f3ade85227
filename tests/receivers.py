"""A real HTTP receiver for notifications (a webhook endpoint on loopback)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson


class Receiver:
    """Records every POST (path, headers, raw body, JSON); can answer 503 while 'down'."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.down = False
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if receiver.down:
                    self.send_response(503)
                    self.end_headers()
                    return
                receiver.requests.append({"path": self.path, "headers": dict(self.headers),
                                          "body": body, "json": orjson.loads(body)})
                self.send_response(200)
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
