"""Admin and destructive endpoints need an admin credential in every mode: a server with none
refuses purges (and says how to configure one), --admin-key-file opens them to its bearer,
--api-keys admin keys keep working, and /metrics and /v1/models can require a key."""

from __future__ import annotations

import json

import httpx
import pytest
from serverutil import engine_mode_flags

PROMPT = "An anonymous caller must not be able to wipe this shared cache. " * 2
ADMIN_KEY = "adm-0123456789abcdef-secret"


def req(s, method: str, path: str, key: str | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{s.url}{path}", headers=headers, timeout=60, **kw)


def cached(s, key: str | None = None) -> int:
    r = req(
        s, "POST", "/v1/completions", key, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def admin_key_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("admin") / "admin.key"
    p.write_text(ADMIN_KEY + "\n")
    return p


def test_without_any_credential_purges_are_refused(serve):
    s = serve("--num-device-blocks", "128")
    cached(s)
    assert cached(s) > 0
    for path in ("/v1/cache?all=true", "/v1/cache"):
        r = req(s, "DELETE", path)
        assert r.status_code == 403 and "--admin-key-file" in r.json()["error"]["message"], r.text
    assert cached(s) > 0  # nothing was purged
    assert req(s, "GET", "/v1/cache").status_code == 200  # reads stay open
    s.check_idle_clean()  # the read-only integrity check stays open on a server with no keys


def test_admin_key_file_guards_purges_metrics_and_integrity(serve, admin_key_file):
    s = serve("--admin-key-file", str(admin_key_file), "--metrics-auth", "admin")
    cached(s)
    assert req(s, "DELETE", "/v1/cache?all=true").status_code == 401
    assert req(s, "DELETE", "/v1/cache?all=true", "not-the-admin-key").status_code == 403
    assert req(s, "DELETE", "/v1/cache", "not-the-admin-key").status_code == 403
    assert cached(s) > 0
    r = req(s, "DELETE", "/v1/cache?all=true", ADMIN_KEY)
    assert r.status_code == 200 and r.json()["deleted_blocks"]["device"] > 0, r.text
    assert cached(s) == 0
    assert req(s, "POST", "/admin/check_integrity").status_code == 401
    assert req(s, "GET", "/metrics").status_code == 401
    assert req(s, "GET", "/metrics", ADMIN_KEY).status_code == 200
    assert req(s, "GET", "/v1/models").status_code == 200  # --models-auth public (default)
    ok = req(s, "POST", "/admin/check_integrity", ADMIN_KEY)
    assert ok.status_code == 200 and ok.json()["ok"] is True and ok.json()["num_unfinished"] == 0


def test_api_key_modes_for_models_and_metrics(serve, admin_key_file, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "acme", "sk-b": "globex"}}))
    s = serve(
        "--api-keys",
        str(keys),
        "--admin-key-file",
        str(admin_key_file),
        "--models-auth",
        "api_key",
        "--metrics-auth",
        "api_key",
    )
    assert req(s, "GET", "/v1/models").status_code == 401
    assert req(s, "GET", "/v1/models", "sk-wrong").status_code == 401
    assert req(s, "GET", "/v1/models", "sk-a").json()["data"][0]["id"] == "tiny"
    assert req(s, "GET", "/metrics", "sk-b").status_code == 200
    assert req(s, "GET", "/metrics", ADMIN_KEY).status_code == 200
    cached(s, "sk-a")
    assert cached(s, "sk-b") == 0 and cached(s, "sk-a") > 0
    # tenants purge themselves; the admin key names a tenant (or all); no tenant key purges all
    assert req(s, "DELETE", "/v1/cache?all=true", "sk-a").status_code == 403
    assert req(s, "DELETE", "/v1/cache", ADMIN_KEY).status_code == 400
    r = req(s, "DELETE", "/v1/cache?tenant=acme", ADMIN_KEY)
    assert r.status_code == 200 and r.json()["tenant"] == "acme"
    assert cached(s, "sk-a") == 0 and cached(s, "sk-b") > 0
    assert req(s, "POST", "/admin/check_integrity", "sk-a").status_code == 403
    ok = req(s, "POST", "/admin/check_integrity", ADMIN_KEY)
    assert ok.status_code == 200 and ok.json()["ok"] is True


def test_bad_admin_key_file_is_a_clear_error(server_model_dir, tmp_path, engine_mode):
    import subprocess
    import sys

    short = tmp_path / "admin.key"
    short.write_text("short")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "serve",
            "--model",
            str(server_model_dir),
            *engine_mode_flags(engine_mode, ("--admin-key-file", str(short))),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "at least 16 characters" in p.stderr and "Traceback" not in p.stderr
