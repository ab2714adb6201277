"""The interactive terminal chat of `pi-run MODEL` on a terminal without a prompt (or --chat without one, -i, -cnv).

The terminal chat keeps the KV cache between turns: each turn re-renders the whole conversation and
Model.generate(reuse_prefix=True) prefills only what the cache does not already hold, as llama.cpp does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from pinfer_llm.runtime.generation.chat import encode_chat

HELP = "type a message; /reset forgets the conversation, /exit or end of input (Ctrl-D) quits, Ctrl-C stops an answer"


def chat_loop(m, system: str | None, max_tokens: int, sampling: dict, read: Callable[[str], str] = input,
              out: TextIO = sys.stdout, err: TextIO = sys.stderr, first: str | None = None,
              stop: Sequence[str] = ()) -> None:
    """An interactive conversation: read a line, stream the answer, repeat. Ctrl-C (KeyboardInterrupt) during an
    answer stops that answer and keeps what was said of it; at the prompt it only starts a new line. first: the
    first message (pi-run -cnv -p TEXT), shown as if typed. stop: reverse prompts (-r), each of which ends an answer
    where it appears."""
    from pinfer_llm.runtime.generation.textgen import TextGeneration

    if first is not None:
        read = _first_then(first, read, out)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    print(f"pi-run: chat with {m.file.path.name}, context {m.ctx_size} tokens; {HELP}", file=err)
    while True:
        try:
            line = read("> ")
        except EOFError:
            print(file=out)
            return
        except KeyboardInterrupt:
            print(file=out)
            continue
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return
        if cmd == "/reset":
            messages = list(start)
            continue
        if cmd.startswith("/") and " " not in cmd:
            print(f"unknown command {cmd}; {HELP}", file=err)
            continue
        if not cmd:
            continue
        ids = encode_chat(m.tokenizer, messages + [{"role": "user", "content": line}])
        if len(ids) >= m.ctx_size:
            print(f"pi-run: the conversation is {len(ids)} tokens and the context holds {m.ctx_size}: /reset, or "
                  f"restart with a larger -c", file=err)
            continue
        gen = TextGeneration(m, ids, stop=stop, max_tokens=max_tokens, reuse_prefix=True, **sampling)
        answer, note = [], ""
        try:
            for delta in gen:
                answer.append(delta)
                out.write(delta)
                out.flush()
        except KeyboardInterrupt:
            note = ", stopped"
        out.write("\n")
        out.flush()
        st = m.stats
        print(f"[{st.decode_tokens} tokens, {st.decode_tps:.1f} tok/s; prompt {st.prompt_tokens} tokens, "
              f"{st.reused_tokens} reused from the cache{note}]", file=err, flush=True)
        # an interrupted answer stays in the conversation as far as it went, so the next turn follows on from it
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": "".join(answer)}]


def _first_then(first: str, read: Callable[[str], str], out: TextIO) -> Callable[[str], str]:
    """`read`, whose first line is `first`, echoed after the prompt as a typed line would be."""
    pending = [first]

    def reader(prompt: str) -> str:
        if pending:
            out.write(f"{prompt}{first}\n")
            return pending.pop()
        return read(prompt)

    return reader
