"""Conversations: a message list through the model's own chat template to token ids (pi-run --chat, pi-serve, the
terminal chat in cli/chat.py)."""

from __future__ import annotations


def encode_chat(tok, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation in the model's chat template, ready for the assistant's answer."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    # a template that writes the BOS token itself must not get a second one
    bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else None
    return tok.encode(text, add_special=not (bos and text.startswith(bos)))
