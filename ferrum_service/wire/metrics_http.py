"""The ``/metrics`` HTTP endpoint, always in Prometheus' text format (0.0.4).

prometheus_client answers a scraper that asks for OpenMetrics (Prometheus does, by default) with
sample names whose ``:`` it rewrote to ``_`` under ``# TYPE`` lines that keep it, so a real
Prometheus never stored ``vllm:num_requests_waiting`` and the other model-server names llm-d and
the dashboards query. The text format keeps the names as they are, so the endpoint serves it
whatever the scraper's ``Accept`` header asks for (``tests/test_monitoring_prometheus.py`` scrapes
it with a real Prometheus).
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

TEXT_FORMAT = "text/plain; version=0.0.4"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        """No access log line per scrape."""


def serve_metrics(registry: CollectorRegistry, port: int, host: str) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """Serve ``registry`` on ``host:port`` from a daemon thread; (server, thread) to stop it with."""
    app = make_wsgi_app(registry)

    def text_only(environ, start_response):
        return app({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)

    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    httpd = make_server(host, port, text_only, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread


__all__ = ["serve_metrics"]
