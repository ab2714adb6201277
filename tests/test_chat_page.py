"""The chat page at / in a real headless Chromium (driven over the DevTools protocol on a pipe, stdlib only): an
answer streamed into the page equals the API's, the next turn sends the whole conversation, Stop ends the
generation on the server. Skipped only where no Chromium is installed."""

import json
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest
import torch

from pinfer_llm.runtime.serving.endpoints import chat_page
from tests.tiny_server import start_server, write_chat_model

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def test_the_page_needs_nothing_from_elsewhere():
    page = chat_page()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "an external resource: no offline use"
    assert "@import" not in page and "/v1/chat/completions" in page


class Browser:
    """Chromium with --remote-debugging-pipe: DevTools messages are JSON, each ended by a NUL, on fds 3 (in) and
    4 (out) of the browser."""

    def __init__(self, profile):
        to_r, self.to_w = os.pipe()
        self.from_r, from_w = os.pipe()

        def fds():
            os.dup2(to_r, 3)
            os.dup2(from_w, 4)

        self.proc = subprocess.Popen([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
                                     preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self.buf, self.n = b"", 0

    def call(self, method, session=None, **params):
        self.n += 1
        msg = {"id": self.n, "method": method, "params": params} | ({"sessionId": session} if session else {})
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self.buf:
                chunk = os.read(self.from_r, 1 << 16)
                if not chunk:
                    raise RuntimeError("the browser closed its pipe")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.n:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url) -> str:
        """A tab on url, once its page has loaded (asked again while the load replaces the blank page's context)."""
        target = self.call("Target.createTarget", url=url)["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.js(session, "location.href !== 'about:blank' && document.readyState === 'complete'"):
                    return session
            except RuntimeError as e:
                if "context" not in str(e) or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def js(self, session, expr):
        r = self.call("Runtime.evaluate", session, expression=expr, awaitPromise=True, returnByValue=True,
                      timeout=30000)
        if "exceptionDetails" in r:
            raise AssertionError(r["exceptionDetails"])
        return r["result"].get("value")

    def close(self):
        self.proc.kill()
        self.proc.wait(10)
        os.close(self.to_w)
        os.close(self.from_r)


WAIT = """new Promise((ok, fail) => { const t0 = Date.now(); const tick = () => {
  if (%s) ok(true); else if (Date.now() - t0 > 20000) fail(new Error('timed out: %s')); else setTimeout(tick, 20); };
  tick(); })"""


def wait(b, s, cond):
    return b.js(s, WAIT % (cond, cond.replace("'", "")))


def say(b, s, text):
    b.js(s, f"document.getElementById('input').value = {json.dumps(text)};"
            f"document.getElementById('form').requestSubmit()")


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium)")
def test_chat_page_in_a_real_browser(tmp_path):
    threads = torch.get_num_threads()
    write_chat_model(tmp_path / "m.gguf")
    srv, slow = start_server(tmp_path / "m.gguf")
    b = Browser(tmp_path / "profile")
    try:
        s = b.open(srv.url + "/")
        b.js(s, "document.getElementById('temp').value = '0'; document.getElementById('max').value = '8'")

        def api(messages, n=8):
            r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": n,
                                                                   "temperature": 0}, timeout=30)
            return r.json()["choices"][0]["message"]["content"]

        b.js(s, "window.sent = []; const f = window.fetch;"  # what the page sends, as the server receives it
                "window.fetch = (u, o) => { window.sent.push(JSON.parse(o.body)); return f(u, o); }")
        say(b, s, "hello")
        wait(b, s, "document.body.dataset.turns === '2'")
        first = b.js(s, "document.querySelector('.assistant').textContent")
        assert first == api([{"role": "user", "content": "hello"}]) and first
        say(b, s, "and then?")  # the page sends the whole conversation
        wait(b, s, "document.body.dataset.turns === '4'")
        second = b.js(s, "document.querySelectorAll('.assistant')[1].textContent")
        turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                 {"role": "user", "content": "and then?"}]
        assert b.js(s, "window.sent[1].messages") == turns and b.js(s, "window.sent[1].stream") is True
        assert second == api(turns)
        assert "tok/s" in b.js(s, "document.getElementById('status').textContent")

        slow.delay = 0.05
        b.js(s, "document.getElementById('max').value = '200'")
        say(b, s, "a long one")
        wait(b, s, "document.querySelectorAll('.assistant')[2].textContent.length > 2")
        b.js(s, "document.getElementById('stop').click()")
        wait(b, s, "document.body.dataset.turns === '6'")
        assert b.js(s, "document.body.dataset.finish") == "stopped"
        deadline = time.monotonic() + 5
        while httpx.get(srv.url + "/health").json()["generating"]:  # the server stops at the next token
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert slow.runs[-1] < 100, slow.runs
    finally:
        slow.delay = 0.0
        b.close()
        srv.close()
        torch.set_num_threads(threads)
