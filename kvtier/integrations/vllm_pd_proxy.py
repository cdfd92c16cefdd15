"""A prefill/decode proxy for two vLLM servers that share kvtier's tiers.

    python -m kvtier.integrations.vllm_pd_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 [--host 127.0.0.1] [--port 8000]

The prefill server runs kvtier's connector with kv_role "kv_producer" (it stores, never loads),
the decode server with "kv_consumer" (it loads, never stores); both name the same shared tier (a
disk_cache_dir both can read, or a remote_cache_url). For each POST /v1/completions or
/v1/chat/completions the proxy

  1. sends the request to the prefill server with max_tokens=1 (max_completion_tokens=1 for
     chat) and stream off: it computes the prompt's KV and stores its full blocks below (a
     producer's step ends only once its stores are written, so the KV is there when it answers);
  2. sends the original request to the decode server, which restores the stored blocks from the
     shared tier, computes the prompt's tail and decodes, and relays its answer (streamed or not)
     to the client unchanged.

The handoff is through kvtier's keys (the chain of the prompt's token ids and the request's
cache_salt), so no kv_transfer_params pass between the servers. GET requests (/v1/models,
/health) go to the decode server. The standard library only: it runs in any Python.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

logger = logging.getLogger("kvtier.pd_proxy")

PREFILL_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def prefill_request(path: str, body: dict) -> dict:
    """The request the prefill server gets: the same prompt, one token, no stream."""
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if path.endswith("/chat/completions"):
        out["max_completion_tokens"] = 1
    return out


def _connection(base: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(base)
    if parts.scheme not in ("http", ""):
        raise ValueError(f"only http:// servers are supported, got {base!r}")
    host = parts.hostname or "127.0.0.1"
    return http.client.HTTPConnection(host, parts.port or 80, timeout=timeout_s), parts.path.rstrip("/")


class _Proxy(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _forward(self, base: str, method: str, body: bytes | None, stream_back: bool) -> int:
        """Send this request to `base`; relay the answer to the client when `stream_back`."""
        conn, prefix = _connection(base, self.server.timeout_s)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        try:
            conn.request(method, prefix + self.path, body=body, headers=headers)
            resp = conn.getresponse()
            if not stream_back:
                data = resp.read()
                if resp.status >= 400:
                    logger.warning("prefill server answered %d: %s", resp.status, data[:500])
                return resp.status
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := resp.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            return resp.status
        finally:
            conn.close()

    def _error(self, status: int, message: str) -> None:
        data = json.dumps({"error": {"message": message, "type": "proxy_error"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        try:
            self._forward(self.server.decode, "GET", None, stream_back=True)
        except OSError as e:
            self._error(502, f"decode server: {e}")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?", 1)[0]
        if path in PREFILL_PATHS:
            try:
                request = json.loads(body or b"{}")
            except json.JSONDecodeError as e:
                self._error(400, f"request body is not JSON: {e}")
                return
            try:
                status = self._forward(
                    self.server.prefill, "POST", json.dumps(prefill_request(path, request)).encode(), False
                )
            except OSError as e:
                self._error(502, f"prefill server: {e}")
                return
            if status >= 400:
                self._error(502, f"prefill server answered {status}")
                return
            self.server.prefills += 1
        try:
            self._forward(self.server.decode, "POST", body, stream_back=True)
        except OSError as e:
            self._error(502, f"decode server: {e}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], prefill: str, decode: str, timeout_s: float) -> None:
        super().__init__(addr, _Proxy)
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.timeout_s = timeout_s
        self.prefills = 0


def make_server(prefill: str, decode: str, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 600.0) -> _Server:
    """The proxy, bound (port 0: a free one, `server.server_address[1]`); call serve_forever."""
    return _Server((host, port), prefill, decode, timeout_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer vLLM server")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer vLLM server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per upstream request")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = make_server(args.prefill, args.decode, args.host, args.port, args.timeout_s)
    logger.info(
        "proxy on http://%s:%d: prefill %s, decode %s", args.host, server.server_address[1], args.prefill, args.decode
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
