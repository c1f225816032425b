"""An OTLP/HTTP receiver for the tests: a real HTTP server on a free port of this process that keeps each
POST (path, content type, body) and answers 200, and the decoding of a metrics export with
OpenTelemetry's own protobuf message (``ExportMetricsServiceRequest``, from the exporter's packages)."""

from __future__ import annotations

import http.server
import queue
import threading
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest


class OtlpReceiver:
    def __init__(self) -> None:
        self.posts: queue.Queue[tuple[str, str, bytes]] = queue.Queue()
        posts = self.posts

        class Receiver(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # (the name http.server calls)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.put((self.path, self.headers.get("Content-Type", ""), body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def decode(body: bytes) -> dict[str, Any]:
    """Metric name -> its OTLP ``Metric`` message, from one export request's body."""
    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    return {
        m.name: m
        for resource in request.resource_metrics
        for scope in resource.scope_metrics
        for m in scope.metrics
    }


def attributes(point: Any) -> dict[str, str]:
    return {a.key: a.value.string_value for a in point.attributes}


def value(point: Any) -> float:
    """A number data point's value, whichever of its int and double it carries."""
    return float(point.as_double if point.WhichOneof("value") == "as_double" else point.as_int)
