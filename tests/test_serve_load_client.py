"""benchmarks/serve_load.py's one-thread load generator (every stream polled from one thread, the bytes parsed after
the answers end) reads what the per-client http.client reader reads: the same texts, token counts and finish
reasons, from a tiny pi-serve, streamed chat and completions alike; and a chunked body split at any byte reads back
whole."""

import torch

from benchmarks import serve_load as sl
from tests.tiny_server import start_server, write_chat_model


def test_streams_at_once_reads_what_stream_chat_reads(tmp_path):
    threads = torch.get_num_threads()
    write_chat_model(tmp_path / "tiny-chat.gguf")
    srv, _ = start_server(tmp_path / "tiny-chat.gguf", parallel=2)
    try:
        prompts = [[{"role": "user", "content": "hi"}], "Once upon a time", [{"role": "user", "content": "more"}]]
        alone = [sl.stream_chat(srv.url, p, 12) for p in prompts]
        together = sl.streams_at_once(srv.url, prompts, 12)
    finally:
        srv.close()
        torch.set_num_threads(threads)
    for a, b in zip(alone, together, strict=True):
        assert b["error"] is None and b["done"], b
        assert b["text"] and b["text"] == a["text"]
        counts = [(r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"], r["finish"]) for r in (a, b)]
        assert counts[0] == counts[1]  # (the second time, the prompt's prefix may come from the cache)
        assert 0 < b["ttft"] <= b["wall"] and b["decode_s"] >= 0


def test_chunked_events_parse_whole_at_any_split():
    events = [b'data: {"choices":[{"text":"ab","finish_reason":null}]}\n\n',
              b'data: {"choices":[{"text":"c\\u00e9","finish_reason":"length"}],"usage":{"completion_tokens":2}}\n\n',
              b"data: [DONE]\n\n"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body
    for cut in range(1, len(raw)):  # two reads, split anywhere: the second's time is every event's that it completes
        got = sl.parse_stream(raw, [(1.0, cut), (2.0, len(raw))], 0.0, chat=False)
        assert (got["text"], got["finish"], got["done"]) == ("abcé", "length", True)
        assert got["usage"] == {"completion_tokens": 2}
        first_end = raw.index(events[0]) + len(events[0]) - 2  # the first event's bytes before its blank line
        assert got["ttft"] == (1.0 if cut >= first_end else 2.0)
    bad = sl.parse_stream(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy", [(1.0, 60)], 0.0, True)
    assert bad["error"].startswith("HTTP/1.1 503") and bad["text"] == ""
