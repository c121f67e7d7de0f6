"""`engram serve` for real: the server started on a free loopback port, driven with the `openai` client."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

import torch  # noqa: E402

KEY = "sk-engram-test"
PROMPTS = ["the cat sat on", "Line 7: the dog ran", "the king"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, env=None):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "engram.cli", "serve", *map(str, args), "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **(env or {})})
    t0 = time.time()
    while time.time() - t0 < 120:
        if p.poll() is not None:
            raise AssertionError(f"server exited {p.returncode}: {p.stdout.read()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        except urllib.error.HTTPError:  # 401: up, behind the key
            return p, port
        except OSError:
            time.sleep(0.3)
            continue
        return p, port
    p.kill()
    raise AssertionError("server did not start")


@pytest.fixture(scope="module")
def setup(tiny_run, tmp_path_factory):
    from engram.editing import Fact, edit_facts
    from engram.model import load_model

    root = tmp_path_factory.mktemp("serve")
    shutil.copytree(tiny_run, root / "run")  # the session's tiny trained run
    model, tok = load_model(root / "run")
    edit_facts(model, tok, [Fact("the cat sat on", " the king of Braeethdor")], steps=40,
               progress=False).save(root / "fact")
    p, port = start(["--checkpoint", root / "run", "--overlay", f"fact={root / 'fact'}", "--api-key", KEY,
                     "--served-model-name", "tiny",
                     "--chat-template", "plain"])
    yield root, port, p
    if p.poll() is None:
        p.terminate()
        p.wait(timeout=30)


def client(port, key=KEY):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


_LOADED = {}


def expected(root, prompt, n=12, overlay=False):
    """What `engram sample --temperature 0` (and `--overlay`) decodes, in this process."""
    from engram.adapters import generation_pad_id
    from engram.editing import Overlay, applied
    from engram.model import load_model

    if root not in _LOADED:
        _LOADED[root] = load_model(root / "run")
    model, tok = _LOADED[root]
    ids = tok.encode(prompt, add_special_tokens=False).ids
    ctx = applied(model, Overlay.load(root / "fact"), check=True) if overlay else None
    with torch.no_grad():
        if ctx:
            with ctx:
                out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                     pad_token_id=generation_pad_id(model))
        else:
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=generation_pad_id(model))
    return tok.decode(out[0, len(ids):].tolist())


def test_auth_models_and_greedy_equals_in_process_generate(setup):
    root, port, _ = setup
    with pytest.raises(openai.AuthenticationError):
        client(port, "wrong").models.list()
    assert [m.id for m in client(port).models.list().data] == ["tiny", "tiny+fact"]
    c = client(port)
    for prompt in PROMPTS:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == expected(root, prompt) and r.usage.completion_tokens == 12
    r = c.completions.create(model="tiny+fact", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == expected(root, PROMPTS[0], overlay=True) != expected(root, PROMPTS[0])


def test_stream_equals_non_stream_and_stop_and_seed(setup):
    _, port, _ = setup
    c = client(port)
    for model in ("tiny", "tiny+fact"):
        whole = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=20, temperature=0).choices[0].text
        parts = [ch.choices[0].text for ch in c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=20,
                                                                   temperature=0, stream=True)]
        assert "".join(parts) == whole and len(parts) > 2
    whole = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0).choices[0].text
    stop = whole[5:8]
    r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == whole[:whole.index(stop)] and r.choices[0].finish_reason == "stop"
    a, b = (c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=15, temperature=1.0, seed=5)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text  # a seeded sample repeats


def test_overlay_isolation_under_concurrency(setup):
    root, port, _ = setup
    want = {(m, p): expected(root, p, 10, overlay=m.endswith("+fact")) for m in ("tiny", "tiny+fact") for p in PROMPTS}
    got, errors = {}, []

    def ask(key):
        try:
            r = client(port).completions.create(model=key[0], prompt=key[1], max_tokens=10, temperature=0)
            got.setdefault(key, []).append(r.choices[0].text)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(k,)) for k in list(want) * 3]  # 18 requests at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(v == [want[k]] * 3 for k, v in got.items()) and len(got) == len(want)


def test_bad_input_is_a_4xx_json_error_and_the_server_lives_on(setup):
    _, port, _ = setup
    c = client(port)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="not loaded"):
        c.completions.create(model="tiny+nope", prompt="x", max_tokens=2)
    for kw, msg in (({"max_tokens": -3}, "max_tokens: Input should be greater than or equal to 1"),
                    ({"max_tokens": 10**9}, "exceed the context"), ({"prompt": ""}, "prompt is empty"),
                    ({"prompt": "the cat " * 400}, "context is"),
                    ({"temperature": "hot"}, "temperature: Input should be a valid number")):
        with pytest.raises(openai.BadRequestError, match=msg):
            c.completions.create(**{"model": "tiny", "prompt": "x", "max_tokens": 2, **kw})
    with pytest.raises(openai.BadRequestError, match="messages.0.content: Field required"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user"}])
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b"{not json",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["code"] == "invalid_json"
    assert c.completions.create(model="tiny", prompt="the cat", max_tokens=3, temperature=0).choices[0].text


def test_a_client_that_leaves_mid_stream_frees_the_worker(setup):
    _, port, _ = setup
    health = urllib.request.Request(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {KEY}"})
    before = json.loads(urllib.request.urlopen(health).read())["cancelled"]
    stream = client(port).completions.create(model="tiny", prompt="the", max_tokens=240, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away after the first chunk
    t0 = time.time()
    while json.loads(urllib.request.urlopen(health).read())["cancelled"] == before and time.time() - t0 < 30:
        time.sleep(0.1)
    h = json.loads(urllib.request.urlopen(health).read())
    assert h["cancelled"] == before + 1 and not h["busy"] and h["queued"] == 0


def test_chat_with_the_plain_template_streams_and_not(setup):
    """`--chat-template plain`: chat is the plain prompt's completion, streamed or not."""
    root, port, _ = setup
    c = client(port)
    msgs = [{"role": "user", "content": "the cat sat on"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    want = c.completions.create(model="tiny", prompt="user: the cat sat on\nassistant:", max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want.choices[0].text and r.choices[0].message.role == "assistant"
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True)]
    assert "".join(parts) == r.choices[0].message.content


@pytest.mark.slow
def test_engram_ask_and_crosscheck_against_engrams_own_server(setup, tmp_path, monkeypatch):
    """The tutorial's channel closed locally (two CLI processes: slow)."""
    root, port, _ = setup
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "ENGRAM_API_KEY": KEY}
    base = ["--base-url", f"http://127.0.0.1:{port}/v1", "--model", "tiny", "--retries", "0"]
    a = subprocess.run([sys.executable, "-m", "engram.cli", "ask", "the cat sat on", *base], capture_output=True,
                       text=True, env=env, timeout=120)
    assert a.returncode == 0 and a.stdout.strip(), a.stderr
    x = subprocess.run([sys.executable, "-m", "engram.cli", "crosscheck", "the cat sat on the mat", "--checkpoint",
                        str(root / "run"), *base], capture_output=True, text=True, env=env, timeout=120)
    # a 10-step model with a 256-token context cannot answer the entity prompt: the channel works, and the
    # server's refusal (or an unparseable reply) is one diagnosed line
    errors = [line for line in x.stderr.splitlines() if line.startswith("engram: error:")]
    assert x.returncode == 0 or (x.returncode == 2 and len(errors) == 1 and "Traceback" not in x.stderr), x.stderr
    assert x.returncode == 0 or "context" in errors[0] or "entity JSON" in errors[0]


def test_a_model_without_a_chat_template_refuses_chat():
    from engram.serving import Engine, ServeError

    engine = Engine.__new__(Engine)  # (only the template matters here)
    engine.chat_template = None
    with pytest.raises(ServeError, match="no chat template") as e:
        engine.render_chat([{"role": "user", "content": "hi"}])
    assert e.value.status == 400


def test_sigterm_finishes_the_request_in_flight_and_exits_0(setup):
    """(Last: it stops the module's server.)"""
    _, port, p = setup
    box = {}

    def ask():
        box["r"] = client(port).completions.create(model="tiny", prompt="the", max_tokens=200, temperature=0)

    t = threading.Thread(target=ask)
    t.start()
    health = urllib.request.Request(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {KEY}"})
    t0 = time.time()
    while not json.loads(urllib.request.urlopen(health).read())["busy"] and time.time() - t0 < 30:
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    t.join(timeout=60)
    assert p.wait(timeout=60) == 0
    assert box["r"].choices[0].finish_reason == "length" and box["r"].usage.completion_tokens == 200
