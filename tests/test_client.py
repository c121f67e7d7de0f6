"""`engram ask` / `crosscheck` against a real HTTP stub of an OpenAI-compatible server on loopback."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.integration  # (trains models or starts servers: tests/conftest.py)

pytest.importorskip("openai")

from conftest import run_cli  # noqa: E402

from engram.cli.client import align, normalize_base_url, parse_entities  # noqa: E402

KEY = "sk-test-SECRET-123"


class Stub(BaseHTTPRequestHandler):
    mode = "ok"  # ok | 401 | 404model | 429 | 500 | nochoices | badjson | slow
    calls: list = []

    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.endswith("/v1/models"):
            return self._send(200, {"object": "list", "data": [{"id": "good-model", "object": "model", "created": 0,
                                                                 "owned_by": "x"}]})
        self._send(404, {"error": {"message": "no route"}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        req = json.loads(self.rfile.read(n))
        Stub.calls.append((self.path, self.headers.get("Authorization"), req))
        if not self.path.endswith("/v1/chat/completions"):
            return self._send(404, {"error": {"message": f"no route {self.path}"}})
        mode = Stub.mode
        if mode == "401" or self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": {"message": f"Incorrect API key provided: {KEY}"}})
        if req.get("model") != "good-model":
            return self._send(404, {"error": {"message": f"The model `{req.get('model')}` does not exist",
                                              "code": "model_not_found"}})
        if mode == "429":
            return self._send(429, {"error": {"message": "slow down"}})
        if mode == "500":
            return self._send(500, {"error": {"message": "boom"}})
        if mode == "nochoices":
            return self._send(200, {"error": {"message": "upstream quota exhausted"}, "object": "chat.completion"})
        if mode == "slow":
            import time

            time.sleep(3)
        content = "OK"
        system = req["messages"][0]["content"]
        if "named entities" in system:
            if mode == "badjson" and len(req["messages"]) == 2:
                content = "Sure! The entities are Alexander the Great and Bucephalus."
            else:
                content = '```json\n{"entities": ["Alexander the Great", "Bucephalus"], "phrases": []}\n```'
        self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "good-model",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content}}]})


class StubServer(ThreadingHTTPServer):
    """The stub's server: a client that hangs up on a slow reply is expected (mode "slow"), not an error to print;
    and its handler threads are joined on close. Printed from a handler thread still running after this module,
    the traceback landed in a later test's captured stderr (test_corruption failed on it)."""
    daemon_threads = False
    block_on_close = True

    def handle_error(self, request, client_address):
        pass


@pytest.fixture(scope="module")
def server():
    srv = StubServer(("127.0.0.1", 0), Stub)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()  # waits for the handler threads (a slow reply still being written)


def run(args, env_extra=None, cwd=None, mode="ok"):
    Stub.mode = mode
    env = {k: v for k, v in os.environ.items()
           if k not in ("ENGRAM_API_KEY", "OPENAI_API_KEY", "TAOTOKEN_API_KEY", "ENGRAM_BASE_URL", "ENGRAM_MODEL")
           and "proxy" not in k.lower()}
    env.update({"ENGRAM_MODEL": "good-model", "NO_PROXY": "127.0.0.1,localhost"})
    env.update(env_extra or {})
    r = run_cli(*args, env=env, cwd=cwd, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    assert KEY not in r.stdout + r.stderr
    return r


def test_ask_ok_and_key_whitespace_stripped(server, tmp_path):
    r = run(["ask", "hi", "--base-url", server + "/v1"], {"ENGRAM_API_KEY": f"  {KEY}\n"})
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr
    assert Stub.calls[-1][1] == f"Bearer {KEY}"


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 9 s
def test_key_from_dotenv_and_openai_fallback(server, tmp_path):
    (tmp_path / ".env").write_text(f"ENGRAM_API_KEY={KEY}\nENGRAM_BASE_URL={server}/v1\n")
    assert run(["ask", "hi"], cwd=tmp_path).returncode == 0
    r = run(["ask", "hi", "--base-url", server + "/v1"], {"OPENAI_API_KEY": KEY}, cwd=tmp_path.parent)
    assert r.returncode == 0


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 9 s
def test_tutorial_key_variable_is_read_last(server, tmp_path):
    """The tutorial tells readers to set TAOTOKEN_API_KEY; ENGRAM_API_KEY and OPENAI_API_KEY come first."""
    r = run(["ask", "hi", "--base-url", server + "/v1"], {"TAOTOKEN_API_KEY": KEY}, cwd=tmp_path)
    assert r.returncode == 0 and Stub.calls[-1][1] == f"Bearer {KEY}", r.stderr
    r = run(["ask", "hi", "--base-url", server + "/v1"], {"TAOTOKEN_API_KEY": "sk-other", "OPENAI_API_KEY": KEY},
            cwd=tmp_path)
    assert r.returncode == 0 and Stub.calls[-1][1] == f"Bearer {KEY}", r.stderr


def test_no_key(server, tmp_path):
    r = run(["ask", "hi", "--base-url", server + "/v1"], cwd=tmp_path)
    assert r.returncode == 2 and "no API key: set ENGRAM_API_KEY" in r.stderr


def test_401(server):
    r = run(["ask", "hi", "--base-url", server + "/v1"], {"ENGRAM_API_KEY": "sk-wrong"})
    assert r.returncode == 2 and "rejected the API key (HTTP 401)" in r.stderr


@pytest.mark.parametrize("suffix", ["/v1/chat/completions", pytest.param("/v1/v1", marks=pytest.mark.slow),
                                    pytest.param("/v1/", marks=pytest.mark.slow)])  # (5 s each: -m slow)
def test_base_url_normalized(server, suffix):
    r = run(["ask", "hi", "--base-url", server + suffix], {"ENGRAM_API_KEY": KEY})
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr
    assert Stub.calls[-1][0] == "/v1/chat/completions"
    if suffix != "/v1/":
        assert "normalized" in r.stderr


def test_normalize_base_url_unit():
    assert normalize_base_url("https://h/v1/chat/completions")[0] == "https://h/v1"
    assert normalize_base_url("https://h/v1")[1] is None


def test_unknown_model_lists_server_models(server):
    r = run(["ask", "hi", "--base-url", server + "/v1", "--model", "no-such-model"], {"ENGRAM_API_KEY": KEY})
    assert r.returncode == 2 and "'no-such-model' is not served" in r.stderr and "good-model" in r.stderr


def test_response_without_choices_shows_body(server):
    r = run(["ask", "hi", "--base-url", server + "/v1"], {"ENGRAM_API_KEY": KEY}, mode="nochoices")
    assert r.returncode == 2 and "no `choices`" in r.stderr and "upstream quota exhausted" in r.stderr


@pytest.mark.parametrize("mode, msg", [pytest.param("429", "rate limited", marks=pytest.mark.slow),  # (6 s: -m slow)
                                       ("500", "server error")])
def test_retries_then_clear_error(server, mode, msg):
    before = len(Stub.calls)
    r = run(["ask", "hi", "--base-url", server + "/v1", "--retries", "2"], {"ENGRAM_API_KEY": KEY}, mode=mode)
    assert r.returncode == 2 and msg in r.stderr and "after 2 retries" in r.stderr
    assert len(Stub.calls) - before == 3  # first try + 2 retries


def test_timeout(server):
    r = run(["ask", "hi", "--base-url", server + "/v1", "--timeout", "0.5", "--retries", "0"], {"ENGRAM_API_KEY": KEY},
            mode="slow")
    assert r.returncode == 2 and "timeout" in r.stderr


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 9 s
def test_connection_failure_names_proxy(server, free_port):
    dead = f"http://127.0.0.1:{free_port()}"
    env = {"ENGRAM_API_KEY": KEY, "HTTPS_PROXY": dead, "HTTP_PROXY": dead, "NO_PROXY": ""}
    r = run(["ask", "hi", "--base-url", server + "/v1", "--retries", "0"], env)
    assert r.returncode == 2 and "while HTTPS_PROXY=" in r.stderr and dead in r.stderr
    r = run(["ask", "hi", "--base-url", dead + "/v1", "--retries", "0"], {"ENGRAM_API_KEY": KEY})
    assert r.returncode == 2 and "could not connect" in r.stderr and "PROXY" not in r.stderr


def test_parse_and_align():
    assert parse_entities('```json\n{"entities": ["A B"], "phrases": ["c d"]}\n```') == ["A B", "c d"]
    assert parse_entities("not json") is None and parse_entities('{"entities": [1]}') is None
    text = "Only Alexander the Great rode"
    offs = [(0, 4), (4, 14), (14, 18), (18, 24), (24, 29)]
    inside, ends = align(text, offs, ["Alexander the Great"])
    assert inside == [False, True, True, True, False] and ends == [False, False, False, True, False]


@pytest.mark.slow  # out of the default run (23 s); crosscheck --base/--adapter runs in test_cli_grammar
@pytest.mark.parametrize("mode", ["ok", "badjson"])
def test_crosscheck_table_and_json(server, tiny_run, mode):
    args = ["crosscheck", "Only Alexander the Great could tame Bucephalus", "--checkpoint", str(tiny_run),
            "--base-url", server + "/v1"]
    r = run(args + ["--json"], {"ENGRAM_API_KEY": KEY}, mode=mode)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["entities"] == ["Alexander the Great", "Bucephalus"]
    assert any(t["ends"] for t in res["tokens"]) and all("1" in t["gates"] for t in res["tokens"])
    if mode == "badjson":  # first reply was prose: one stricter retry
        assert "not valid JSON" in Stub.calls[-1][2]["messages"][-1]["content"]
    r = run(args, {"ENGRAM_API_KEY": KEY}, mode="ok")
    assert r.returncode == 0 and "precision" in r.stdout and "gate L1" in r.stdout
