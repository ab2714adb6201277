"""A bounded load test of pi-serve: concurrent streaming clients, then a multi-turn chat with and without the
prefix cache.

    python benchmarks/serve_load.py                           # smollm2, 2 threads, 16 clients, 5 turns
    python benchmarks/serve_load.py --model m.gguf --threads 2 --clients 16 --max-tokens 32 --turns 5 --json

1. `pi-serve MODEL --queue CLIENTS` starts as a subprocess on a free loopback port; one request warms it up.
2. CLIENTS streaming chat requests at once, one prompt each, greedy. Each must finish without error and say what
   Model.generate says to the same prompt (pi-run --chat --temp 0), computed afterwards in this process. Reported:
   time to first token (queueing included), wall time, total tokens/s.
3. A TURNS-turn conversation (each turn re-sends the whole conversation), once with the prefix cache and once with
   cache_prompt false: per turn, prompt and reused tokens, time to first token, decode tokens/s, and whether the
   answer equals Model.generate's on that history. Without the cache it must; with it, the earlier answers' keys
   and values came from decode steps, which round differently from a prefill's GEMM, so a quantised model may
   answer slightly differently (as with llama.cpp's cache_prompt).
The server's VmRSS is sampled from /proc every 0.2 s throughout; it should stay flat after the warm-up.
Every request has a timeout and the run stops by itself; it talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import bisect
import http.client
import json
import os
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install

TOPICS = ["the sea", "mountains", "a cat", "coffee", "trains", "autumn", "a library", "the moon", "bread", "rain",
          "a garden", "music", "winter", "bicycles", "the desert", "a lighthouse", "bees", "clocks", "snow", "rivers"]
TURNS = ["Tell me about the moon.", "How far away is it?", "Who walked on it first?", "What did they bring back?",
         "Summarise our conversation in one sentence."]
TIMEOUT = httpx.Timeout(600.0, connect=10.0)


class RssSampler:
    """VmRSS of a process, sampled from /proc every `every` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every, self.samples, self._stop = pid, every, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                text = Path(f"/proc/{self.pid}/status").read_text()
                self.samples.append((time.monotonic(), int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024))
            except (OSError, AttributeError):
                return
            self._stop.wait(self.every)

    def mark(self) -> int:
        return len(self.samples)

    def stop(self):
        self._stop.set()
        self._thread.join(2)


def start_server(model: str, threads: int, queue: int, extra: tuple[str, ...] = (),
                 src: str | Path = ROOT / "src") -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "pinfer_llm.cli.serve", model, "--port", "0", "-t", str(threads),
                          "--queue", str(queue), *extra], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True,
                         env=os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(src)})
    # pi-serve may warn before it listens (other processes keeping cores busy, a stale plan): skip those lines, a
    # bounded number of them, until the one that says where it listens
    seen = []
    for _ in range(20):
        line = p.stderr.readline()
        seen.append(line)
        m = re.search(r"on (http://\S+)/v1 ", line)
        if m or not line:
            break
    if not m:
        p.kill()
        raise SystemExit(f"pi-serve did not start: {''.join(seen)}{p.stderr.read()}")
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()  # drain its log
    url = m.group(1)
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/health", timeout=2).raise_for_status()
            return p, url
        except httpx.HTTPError:
            if time.monotonic() > deadline or p.poll() is not None:
                p.kill()
                raise SystemExit("pi-serve did not answer /health") from None
            time.sleep(0.1)


def take_event(out: dict, event: bytes, chat: bool, t0: float, now) -> bool:
    """One server-sent event into out (a stream's result: text, time to first token, usage, finish reason, its end or
    its error); now() is the event's time, asked only of one that carries text (kept in out["last"]). False once the
    stream has ended."""
    if not event.startswith(b"data: "):
        return True
    payload = event[6:]
    if payload == b"[DONE]":
        out["done"] = True
        return False
    ev = json.loads(payload)
    if "error" in ev:
        out["error"] = ev["error"]["message"]
        return False
    if ev.get("usage"):
        out["usage"] = ev["usage"]
    for ch in ev["choices"]:
        piece = ch["delta"].get("content") if chat else ch.get("text")
        if piece:
            out["last"] = now()
            out["ttft"] = out["ttft"] if out["ttft"] is not None else out["last"] - t0
            out["text"] += piece
        out["finish"] = ch["finish_reason"] or out["finish"]
    return True


def stream_chat(url: str, messages: list[dict] | str, max_tokens: int, cache: bool = True) -> dict:
    """One streaming chat request (a str: a completion of that prompt): text, time to first token, decode time,
    usage, error.

    The load generator shares the server's cores, so its cost per event is part of what it measures: through
    httpx's stream and iter_lines 4 clients took 0.28 s of CPU for 512 events, 30% of a 0.9 s run on 2 cores (the
    planted model), against 0.04 s this way (http.client, SSE events split on blank lines)."""
    chat = not isinstance(messages, str)
    body = {"messages" if chat else "prompt": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache}
    u = urllib.parse.urlsplit(url)
    t0 = time.monotonic()
    out = {"text": "", "ttft": None, "error": None, "usage": None, "finish": None, "done": False, "last": t0}
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT.read)
    try:
        conn.request("POST", u.path + ("/v1/chat/completions" if chat else "/v1/completions"),
                     body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read().decode(errors='replace')[:200]}"
            return out
        pending = b""
        while not (out["done"] or out["error"]):
            got = r.read1(65536)
            if not got:
                break
            *events, pending = (pending + got).split(b"\n\n")
            for event in events:
                if not take_event(out, event, chat, t0, time.monotonic):
                    break
    except (OSError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    out["wall"] = time.monotonic() - t0
    out["decode_s"] = out["last"] - t0 - (out["ttft"] or 0)
    return out


def load_phase(url: str, clients: int, max_tokens: int) -> tuple[list[dict], list[dict], float]:
    prompts = [[{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]}."}]
               for i in range(clients)]
    results: list[dict] = [{} for _ in range(clients)]
    start = threading.Barrier(clients)

    def client(i):
        start.wait()
        results[i] = stream_chat(url, prompts[i], max_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return prompts, results, time.monotonic() - t0


def conversation(url: str, turns: list[str], max_tokens: int, cache: bool) -> list[dict]:
    msgs, out = [], []
    for user in turns:
        msgs.append({"role": "user", "content": user})
        r = stream_chat(url, msgs, max_tokens, cache)
        if r["error"]:
            raise SystemExit(f"turn failed: {r['error']}")
        u = r["usage"]
        n = u["completion_tokens"]
        out.append({"prompt_tokens": u["prompt_tokens"], "reused": u["prompt_tokens_details"]["cached_tokens"],
                    "ttft_s": round(r["ttft"], 3), "tokens": n,
                    "decode_tps": round((n - 1) / r["decode_s"], 1) if n > 1 and r["decode_s"] > 0 else None,
                    "text": r["text"]})
        msgs.append({"role": "assistant", "content": r["text"]})
    return out


def histories(turns: list[str], answers: list[dict]) -> list[list[dict]]:
    """The messages each turn of a conversation was asked with."""
    msgs, out = [], []
    for user, a in zip(turns, answers, strict=True):
        msgs.append({"role": "user", "content": user})
        out.append(list(msgs))
        msgs.append({"role": "assistant", "content": a["text"]})
    return out


def references(model: str, threads: int, conversations: list[list[dict]], max_tokens: int) -> list[str]:
    """What Model.generate (as pi-run --chat --temp 0 -n N) answers to each conversation, from a fresh prefill."""
    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.generation.chat import encode_chat

    m = load_model(model, threads=threads)
    out = []
    for msgs in conversations:
        toks = list(m.generate(encode_chat(m.tokenizer, msgs), max_tokens=max_tokens, temperature=0.0))
        out.append(m.tokenizer.decode(toks, skip_special=True))
    return out


# --- --targets: issue #28's figures, side by side in one run ------------------------------------------------------

LLAMA_SERVER = ROOT.parent / "ref" / "llama.cpp" / "build" / "bin" / "llama-server"  # benchmarks/build_llamacpp.sh


def start_llama_server(binary: Path, model: str, threads: int, parallel: int, ctx: int) -> tuple[subprocess.Popen, str]:
    """llama.cpp's own server on the same file: -np slots of ctx tokens each (its -c is shared by the slots)."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    p = subprocess.Popen([str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                          "-tb", str(threads), "-np", str(parallel), "-c", str(ctx * parallel), "--no-webui",
                          # its AMX repacking (Q4_0/Q4_1/Q8_0 on Sapphire Rapids) dies with SIGSEGV in
                          # ggml_backend_amx_mul_mat on our KVM machines at the first multi-row batch; Q4_1 has no
                          # other repacked form, so this leaves its kernels as llama-bench measures them
                          *(["--no-repack"] if "amx_tile" in Path("/proc/cpuinfo").read_text() else [])],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or p.poll() is not None:
            p.kill()
            raise SystemExit(f"llama-server did not start ({binary})")
        time.sleep(0.2)


def request_bytes(url: str, prompt: list[dict] | str, max_tokens: int, cache: bool = True) -> bytes:
    """stream_chat's request as raw HTTP/1.1 bytes, with Connection: close (the end of the answer is the socket's)."""
    chat = not isinstance(prompt, str)
    body = json.dumps({"messages" if chat else "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": cache}).encode()
    u = urllib.parse.urlsplit(url)
    path = u.path + ("/v1/chat/completions" if chat else "/v1/completions")
    return (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def dechunk(data: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    """A chunked HTTP body -> (the body, [(body offset, raw offset)] of each chunk's first byte)."""
    body, marks, i = bytearray(), [], 0
    while True:
        eol = data.find(b"\r\n", i)
        if eol < 0:
            break
        size = int(data[i:eol].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        marks.append((len(body), eol + 2))
        body += data[eol + 2:eol + 2 + size]
        i = eol + 2 + size + 2
    return bytes(body), marks


def parse_stream(raw: bytes, recvs: list[tuple[float, int]], t0: float, chat: bool) -> dict:
    """stream_chat's result from a whole answer as received: raw, the bytes; recvs, (time, raw bytes so far) after
    each read. Each event's time is that of the read which completed it."""
    out = {"text": "", "ttft": None, "error": None, "usage": None, "finish": None, "done": False, "last": t0}
    head, _, data = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n")[0]
    hdr = head.lower()
    chunked = b"transfer-encoding: chunked" in hdr
    if chunked:
        body, marks = dechunk(data)
    else:
        body, marks = data, [(0, 0)]
    base = len(head) + 4
    ends = [n for _, n in recvs]

    def when(body_end: int) -> float:  # the time of the read that held the body's byte body_end - 1
        k = bisect.bisect_right(marks, (body_end - 1, 1 << 62)) - 1
        rawpos = base + marks[k][1] + (body_end - 1 - marks[k][0])
        return recvs[min(bisect.bisect_right(ends, rawpos), len(recvs) - 1)][0]

    if b" 200 " not in status + b" ":
        out["error"] = f"{status.decode(errors='replace')}: {body.decode(errors='replace')[:200]}"
        return out | {"wall": recvs[-1][0] - t0 if recvs else 0.0, "decode_s": 0.0}
    pos = 0
    for event in body.split(b"\n\n"):
        pos += len(event) + 2
        if not take_event(out, event, chat, t0, lambda end=pos - 2: when(end)):
            break
    out["wall"] = (recvs[-1][0] if recvs else t0) - t0
    out["decode_s"] = out["last"] - t0 - (out["ttft"] or 0)
    return out


def streams_at_once(url: str, prompts: list, max_tokens: int) -> list[dict]:
    """stream_chat for every prompt at once, from one thread: the sockets polled together, each read only appended
    and timed, the events parsed after the last answer ends. The load generator shares the server's 2 cores, so
    what it spends per event is taken from the server: a thread per client with http.client spent 75-90 us of CPU
    per streamed token at 4 clients (wake-ups, the GIL's hand-offs, parsing as it went), this 35 us (at one client,
    where every event wakes the process, 76-100 us against 87-130)."""
    u = urllib.parse.urlsplit(url)
    sel = selectors.DefaultSelector()
    raws: list[bytearray] = [bytearray() for _ in prompts]
    recvs: list[list[tuple[float, int]]] = [[] for _ in prompts]
    socks = []
    for p in prompts:
        s = socket.create_connection((u.hostname, u.port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append((s, request_bytes(url, p, max_tokens)))
    t0 = time.monotonic()
    for i, (s, req) in enumerate(socks):
        s.sendall(req)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    open_ = len(socks)
    deadline = t0 + TIMEOUT.read
    try:
        while open_:
            ready = sel.select(timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise SystemExit("a client timed out")
            now = time.monotonic()
            for key, _ in ready:
                i = key.data
                try:
                    got = key.fileobj.recv(262144)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    got = b""
                if got:
                    raws[i] += got
                    recvs[i].append((now, len(raws[i])))
                else:
                    sel.unregister(key.fileobj)
                    open_ -= 1
    finally:
        for s, _ in socks:
            s.close()
        sel.close()
    return [parse_stream(bytes(raws[i]), recvs[i], t0, not isinstance(prompts[i], str)) for i in range(len(prompts))]


def clients_at_once(url: str, prompts: list, max_tokens: int) -> dict:
    """len(prompts) streaming clients started together (streams_at_once): aggregate tok/s (tokens / wall), each
    one's time to first token (sorted), their texts."""
    t0 = time.monotonic()
    res = streams_at_once(url, prompts, max_tokens)
    wall = time.monotonic() - t0
    bad = [r.get("error") or "incomplete" for r in res if r.get("error") or not r.get("done")]
    if bad:
        raise SystemExit(f"a client failed: {bad[0]}")
    tokens = sum(r["usage"]["completion_tokens"] for r in res)
    return {"tokens": tokens, "wall_s": wall, "tps": tokens / wall, "ttft_s": sorted(r["ttft"] for r in res),
            "texts": [r["text"] for r in res]}


def round_prompts(n: int, r: int, chat: bool = True) -> list:
    """Round r's n prompts, new topics each round (no round reuses another's prompt from a slot): chat requests
    asking for a long story, or (chat False) completions of "Once upon a time, <topic>"."""
    topics = [TOPICS[(n * r + i) % len(TOPICS)] for i in range(n)]
    if not chat:
        return [f"Once upon a time, {t}" for t in topics]
    return [[{"role": "user", "content": f"Write a long story about {t}."}] for t in topics]


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """Ctrl-C to each server, then wait for each (killed after 30 s)."""
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def warm_up(url: str, n: int, max_tokens: int, chat: bool = True) -> None:
    """One uncounted round, one client and then n: a server's first round ran ~20% slower than its later ones
    (planted model, one client 200-281 tok/s against ~350 from round 2 on: the mapped weights' page tables, the KV
    caches' first touch), which made a 3-round median depend on where the slow round fell."""
    ps = [f"Warm up {i}: tell me about {TOPICS[-1 - i % len(TOPICS)]}." for i in range(n)]
    ps = [[{"role": "user", "content": p}] for p in ps] if chat else ps
    clients_at_once(url, ps[:1], max_tokens)
    clients_at_once(url, ps, max_tokens)


def metrics(url: str, *names: str) -> list[list[float]]:
    """The values of the samples whose lines start with each name, from one read of /metrics."""
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return [[float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)] for name in names]


def metric(url: str, name: str) -> list[float]:
    return metrics(url, name)[0]


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def targets(args) -> dict:
    """Paired rounds, the order alternating: pi-serve with one client alone and with 4 at once, llama-server -np 4
    the same; then a planted ReLU model with predictors, one client and 4; then RSS after 10 and 1000 requests."""
    from pinfer_llm.runtime.engine import resolve_model_path

    model = str(resolve_model_path(args.model))
    n, ctx = args.parallel, 1024
    servers = {"pinfer": start_server(model, args.threads, 8, ("--parallel", str(n), "-c", str(ctx)))}
    llama = Path(args.llama_server)
    if llama.exists():
        servers["llama"] = start_llama_server(llama, model, args.threads, n, ctx)
    rounds, asked = [], []
    try:
        for url in (u for _, u in servers.values()):
            warm_up(url, n, args.max_tokens)
        for r in range(args.rounds):
            ps = round_prompts(n, r)
            asked += ps
            rnd = {}
            for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                url = servers[name][1]
                rnd[name + "_one"] = clients_at_once(url, ps[:1], args.max_tokens)
                rnd[name + "_all"] = clients_at_once(url, ps, args.max_tokens)
            rounds.append(rnd)
    finally:
        stop_servers([p for p, _ in servers.values()])
    refs = references(model, args.threads, asked, args.max_tokens)  # pi-run --chat --temp 0 on each prompt
    got = [t for rnd in rounds for t in rnd["pinfer_all"]["texts"]]
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    out = {"model": args.model, "threads": args.threads, "parallel": n, "max_tokens": args.max_tokens,
           "rounds": args.rounds,
           "pinfer_one_tps": med([rd["pinfer_one"]["tps"] for rd in rounds]),
           "pinfer_all_tps": med([rd["pinfer_all"]["tps"] for rd in rounds]),
           "pinfer_all_over_one": med([rd["pinfer_all"]["tps"] / rd["pinfer_one"]["tps"] for rd in rounds]),
           "pinfer_last_ttft_s": med([rd["pinfer_all"]["ttft_s"][-1] for rd in rounds]),
           "answers_equal_pi_run": sum(a == b for a, b in zip(got, refs, strict=True)), "answers": len(refs)}
    if "llama" in servers:
        out |= {"llama_one_tps": med([rd["llama_one"]["tps"] for rd in rounds]),
                "llama_all_tps": med([rd["llama_all"]["tps"] for rd in rounds]),
                "llama_all_over_one": med([rd["llama_all"]["tps"] / rd["llama_one"]["tps"] for rd in rounds]),
                "llama_last_ttft_s": med([rd["llama_all"]["ttft_s"][-1] for rd in rounds]),
                "pinfer_over_llama_all": med([rd["pinfer_all"]["tps"] / rd["llama_all"]["tps"] for rd in rounds]),
                "ttft_last_pinfer_over_llama": med([rd["pinfer_all"]["ttft_s"][-1] / rd["llama_all"]["ttft_s"][-1]
                                                    for rd in rounds])}
    else:
        out["llama"] = f"not run: no llama-server at {llama} (benchmarks/build_llamacpp.sh builds one)"
    out["planted_relu"] = planted(args)
    out["rss"] = rss_growth(model, args.threads, n)
    return out


def planted(args) -> dict:
    """A planted ReLU model with predictors (sparsity_demo's), pi-serve --sparse: one client vs 4, completions."""
    from benchmarks import sparsity_demo as sd

    path = sd.planted_model(args.threads)
    p, url = start_server(str(path), args.threads, 8, ("--parallel", str(args.parallel), "-c", "1024", "--sparse"))
    try:
        warm_up(url, args.parallel, args.max_tokens, chat=False)
        ratios, one, all_ = [], [], []
        read = {"one": [0, 0], "all": [0, 0]}  # (passes, neurons read) summed over the layers, per kind of run
        for r in range(args.rounds):
            ps = round_prompts(args.parallel, r, chat=False)
            for kind, prompts in (("one", ps[:1]), ("all", ps)):
                counters = ("pinfer_ffn_passes_total{", "pinfer_ffn_neurons_read_total{")
                before = [sum(v) for v in metrics(url, *counters)]
                res = clients_at_once(url, prompts, args.max_tokens)
                for i, v in enumerate(metrics(url, *counters)):
                    read[kind][i] += sum(v) - before[i]
                (one if kind == "one" else all_).append(res["tps"])
            ratios.append(all_[-1] / one[-1])
        active = metric(url, "pinfer_ffn_active_fraction{")
        n_ff = sd.parse_shape(sd.SHAPE)["n_ff"]
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(30)
    share = {k: round(r / (n * n_ff), 4) if n else None for k, (n, r) in read.items()}
    return {"model": path.name, "one_tps": round(statistics.median(one), 1),
            "all_tps": round(statistics.median(all_), 1), "all_over_one": round(statistics.median(ratios), 3),
            "neurons_computed_share": round(statistics.mean(active), 4) if active else None,
            # per forward pass: one client's passes read its own neurons; the batch's, the union of its rows'
            "neurons_read_per_pass_one": share["one"], "neurons_read_per_pass_all": share["all"]}


def rss_growth(model: str, threads: int, n: int) -> dict:
    """pi-serve's VmRSS after 10 and after 1000 short requests, n at a time."""
    p, url = start_server(model, threads, 8, ("--parallel", str(n), "-c", "1024"))
    try:
        def burst(start, count):
            with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
                lock, it = threading.Lock(), iter(range(start, start + count))

                def worker():
                    while True:
                        with lock:
                            i = next(it, None)
                        if i is None:
                            return
                        body = {"messages": [{"role": "user", "content": f"Request {i}: say a number."}],
                                "max_tokens": 4, "temperature": 0}
                        h.post("/v1/chat/completions", json=body).raise_for_status()
                ts = [threading.Thread(target=worker) for _ in range(n)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
        burst(0, 10)
        after10 = rss_mib(p.pid)
        t0 = time.monotonic()
        burst(10, 990)
        after1000 = rss_mib(p.pid)
        took = time.monotonic() - t0
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(30)
    return {"after_10_mib": round(after10, 1), "after_1000_mib": round(after1000, 1),
            "growth": round(after1000 / after10 - 1, 4), "990_requests_s": round(took, 1)}


def against(args) -> dict:
    """pi-serve from this tree and from --against (another checkout's src/) side by side: both started, both warmed
    up, then per round one client and --parallel at once on each, the trees' order alternating. A change to the
    server is measured against its parent this way; sequential runs drift with the host by more than it."""
    sparse = args.model == "planted"
    if sparse:
        from benchmarks import sparsity_demo as sd
    model = str(sd.planted_model(args.threads)) if sparse else args.model
    n = args.parallel
    extra = ("--parallel", str(n), "-c", "1024", *(("--sparse",) if sparse else ()))
    trees = [str(ROOT / "src"), args.against]
    servers = [start_server(model, args.threads, 8, extra, src) for src in trees]
    one, all_ = [[], []], [[], []]
    try:
        for _, url in servers:
            warm_up(url, n, args.max_tokens, chat=not sparse)
        for r in range(args.rounds):
            ps = round_prompts(n, r, chat=not sparse)
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                one[i].append(clients_at_once(servers[i][1], ps[:1], args.max_tokens)["tps"])
                all_[i].append(clients_at_once(servers[i][1], ps, args.max_tokens)["tps"])
    finally:
        stop_servers([p for p, _ in servers])
    med = statistics.median
    return {"model": args.model, "parallel": n, "rounds": args.rounds, "max_tokens": args.max_tokens,
            "trees": trees, "one_tps": [round(med(x), 1) for x in one], "all_tps": [round(med(x), 1) for x in all_],
            "all_over_one": [round(med([a / b for a, b in zip(all_[i], one[i], strict=True)]), 3) for i in (0, 1)],
            "one_over_against": round(med([a / b for a, b in zip(one[0], one[1], strict=True)]), 3),
            "all_over_against": round(med([a / b for a, b in zip(all_[0], all_[1], strict=True)]), 3)}


def render_targets(t: dict) -> None:
    print(f"pi-serve --parallel {t['parallel']}, {t['threads']} threads, {t['model']}, {t['max_tokens']} tokens per "
          f"client, {t['rounds']} paired rounds (medians):")
    print(f"  pinfer: one client {t['pinfer_one_tps']} tok/s, {t['parallel']} at once {t['pinfer_all_tps']} tok/s "
          f"aggregate = {t['pinfer_all_over_one']}x (target >= 2.5); last client's first token "
          f"{t['pinfer_last_ttft_s']} s (target <= 1.5)")
    if "llama_all_tps" in t:
        print(f"  llama-server -np {t['parallel']}: one {t['llama_one_tps']} tok/s, {t['parallel']} at once "
              f"{t['llama_all_tps']} = {t['llama_all_over_one']}x; last first token {t['llama_last_ttft_s']} s")
        print(f"  pinfer / llama-server aggregate {t['pinfer_over_llama_all']}x (target >= 1.0); last first token "
              f"pinfer / llama {t['ttft_last_pinfer_over_llama']}x (target <= 1.0)")
    else:
        print(f"  llama-server: {t['llama']}")
    print(f"  answers equal to pi-run's: {t['answers_equal_pi_run']} of {t['answers']}")
    pr = t["planted_relu"]
    print(f"  planted ReLU ({pr['model']}, --sparse): one {pr['one_tps']} tok/s, {t['parallel']} at once "
          f"{pr['all_tps']} = {pr['all_over_one']}x (target >= 2); neurons computed per token and layer "
          f"{pr['neurons_computed_share']}; read per step (a batch: the union of its rows') "
          f"{pr['neurons_read_per_pass_one']} alone, {pr['neurons_read_per_pass_all']} with {t['parallel']} clients")
    r = t["rss"]
    print(f"  RSS after 10 requests {r['after_10_mib']} MiB, after 1000 {r['after_1000_mib']} MiB: "
          f"{r['growth'] * 100:+.1f}% (target within 10%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--targets", action="store_true", help="issue #28's figures instead: one client vs --parallel "
                    "at once, against llama-server -np, a planted ReLU model, RSS over 1000 requests")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER))
    ap.add_argument("--against", metavar="DIR", help="another checkout's src/: its pi-serve and this tree's side by "
                    "side, one client and --parallel at once, --rounds paired rounds (--model planted: the planted "
                    "ReLU model, --sparse)")
    args = ap.parse_args()
    if args.against:
        if args.max_tokens == 32:
            args.max_tokens = 128
        t = against(args)
        if args.json:
            print(json.dumps(t, indent=1))
            return
        for i, tree in enumerate(t["trees"]):
            print(f"{tree}: one client {t['one_tps'][i]} tok/s, {t['parallel']} at once {t['all_tps'][i]} "
                  f"({t['all_over_one'][i]}x)")
        print(f"this tree / --against, medians of {t['rounds']} paired rounds: one client {t['one_over_against']}x, "
              f"{t['parallel']} at once {t['all_over_against']}x")
        return
    if args.targets:
        if args.max_tokens == 32:
            args.max_tokens = 128
        t = targets(args)
        print(json.dumps(t, indent=1)) if args.json else render_targets(t)
        return
    turns = TURNS[:args.turns]

    proc, url = start_server(args.model, args.threads, queue=args.clients)
    rss = RssSampler(proc.pid)
    try:
        warm = stream_chat(url, [{"role": "user", "content": "Hi."}], 8)
        if warm["error"]:
            raise SystemExit(f"warm-up failed: {warm['error']}")
        mark = rss.mark()
        prompts, results, wall = load_phase(url, args.clients, args.max_tokens)
        mark_load = rss.mark()
        convo_cached = conversation(url, turns, args.turn_tokens, cache=True)
        convo_fresh = conversation(url, turns, args.turn_tokens, cache=False)
    finally:
        rss.stop()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    # correctness: every client's answer against a fresh Model.generate of the same prompt
    refs = references(args.model, args.threads, prompts, args.max_tokens)
    errors = [r["error"] for r in results if r.get("error")]
    wrong = [i for i, (r, ref) in enumerate(zip(results, refs, strict=True)) if r.get("text") != ref]
    incomplete = [i for i, r in enumerate(results) if not r.get("done")]
    turn_match = {name: [t["text"] == r for t, r in zip(c, references(args.model, args.threads,
                                                                     histories(turns, c), args.turn_tokens),
                                                          strict=True)]
                  for name, c in (("with", convo_cached), ("without", convo_fresh))}

    mb = [s for _, s in rss.samples]
    after = mb[mark:] or mb
    tokens = sum(r["usage"]["completion_tokens"] for r in results if r.get("usage"))
    ttfts = sorted(r["ttft"] for r in results if r.get("ttft") is not None)
    report = {
        "model": args.model, "threads": args.threads, "clients": args.clients, "max_tokens": args.max_tokens,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "load": {"errors": errors, "incomplete": incomplete, "answers_differing_from_model_generate": wrong,
                 "wall_s": round(wall, 2), "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
                 "ttft_s": {"min": round(ttfts[0], 2), "median": round(statistics.median(ttfts), 2),
                            "max": round(ttfts[-1], 2)} if ttfts else None},
        "rss_mib": {"after_warmup": round(after[0], 1), "after_load": round(mb[max(mark_load - 1, 0)], 1),
                    "max": round(max(after), 1), "last": round(after[-1], 1),
                    "growth": round(max(after) - after[0], 1), "samples": len(mb)},
        "conversation": {
            "with_prefix_cache": [{k: v for k, v in t.items() if k != "text"} for t in convo_cached],
            "without_prefix_cache": [{k: v for k, v in t.items() if k != "text"} for t in convo_fresh],
            "same_answers_with_and_without": [a["text"] for a in convo_cached] == [b["text"] for b in convo_fresh],
            # each turn against Model.generate on that conversation's own history, prefilled from scratch
            "turns_equal_model_generate": turn_match},
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    ld = report["load"]
    print(f"load: {args.clients} streaming clients x {args.max_tokens} tokens, {args.threads} threads: "
          f"{ld['wall_s']} s, {ld['tokens_per_s']} tok/s; time to first token {ld['ttft_s']}")
    print(f"      errors {len(errors)}, incomplete {len(incomplete)}, answers differing from Model.generate: "
          f"{wrong or 'none'}")
    r = report["rss_mib"]
    print(f"rss:  {r['after_warmup']} MiB after warm-up, {r['after_load']} after the clients, max {r['max']}, last "
          f"{r['last']} ({r['samples']} samples)")
    for name in ("with_prefix_cache", "without_prefix_cache"):
        print(f"chat {name.replace('_', ' ')}:")
        for i, t in enumerate(report["conversation"][name], 1):
            print(f"  turn {i}: prompt {t['prompt_tokens']:4d} tokens, reused {t['reused']:4d}, "
                  f"first token {t['ttft_s']:6.3f} s, decode {t['decode_tps']} tok/s ({t['tokens']} tokens)")
    c = report["conversation"]
    print(f"same answers with and without the cache: {c['same_answers_with_and_without']}; turns equal to "
          f"Model.generate: {c['turns_equal_model_generate']}")


if __name__ == "__main__":
    main()
