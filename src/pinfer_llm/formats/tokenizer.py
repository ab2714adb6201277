"""Tokenisers built from a GGUF's own vocabulary, with the `tokenizers` library doing the work.

- tokenizer.ggml.model == "gpt2": byte-level BPE from tokens + merges. The pre-tokeniser regexes follow llama.cpp's
  per-`tokenizer.ggml.pre` table, so our ids match llama.cpp's on the same file.
- tokenizer.ggml.model == "llama": SentencePiece BPE (LLaMA, ReluLLaMA, ProSparse). The merges are not stored in the
  file; they are recovered from the scores (a pair merges with the rank of the score of the token it forms), the way
  SentencePiece itself orders merges. Unknown characters fall back to <0xNN> byte tokens.

Control and user-defined tokens are matched as whole tokens in the input text (as llama.cpp does with
parse_special), so chat templates that produce "<|im_start|>" tokenize correctly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError, quote
from pinfer_llm.formats.header import GGUFFile

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, applied one after another.
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "gpt-2": [_GPT2], "gpt2": [_GPT2], "mpt": [_GPT2], "olmo": [_GPT2], "jais": [_GPT2],
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2], "codeshell": [r"\p{N}", _GPT2], "exaone": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "llama-bpe": [_LLAMA3], "dbrx": [_LLAMA3], "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2], "stablelm2": [_QWEN2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}  # llama.cpp takes a whole word if it is in the vocabulary


@dataclass
class GGUFTokenizer:
    tok: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    vocab_size: int
    chat_template: str | None = None
    stop_ids: set[int] = field(default_factory=set)
    tokens: list[str] = field(default_factory=list, repr=False)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        # encode_batch, not encode: the same ids, but it lets go of the GIL, so a long text tokenised on one
        # thread (pi-serve's request parsing) does not stop every other (its event loop) until it is done
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise PinferError("this model has no tokenizer.chat_template; run without --chat")
        template = _compiled_template(self.chat_template)
        tokens = self.tokens
        special = lambda i: tokens[i] if i is not None and 0 <= i < len(tokens) else ""  # noqa: E731
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=special(self.bos_id), eos_token=special(self.eos_id))
        except PinferError:
            raise
        except Exception as e:  # noqa: BLE001 - a template is a program from the file: any failure is the file's
            raise PinferError(f"the model's chat template fails on these messages ({_why(e)}); run without "
                              f"--chat, or fix tokenizer.chat_template") from None


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled once per text: compiling SmolLM2's took ~2 ms of every pi-serve request (27 ms the
    first time), rendering it ~0.1 ms. jinja2's templates render from several threads at once."""
    import jinja2

    def raise_exception(msg):
        raise PinferError(f"chat template: {quote(msg, 200)}")

    env = _template_environment()(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: __import__("json").dumps(v, indent=indent, ensure_ascii=False)
    try:
        return env.from_string(source)
    except (jinja2.TemplateError, RecursionError, MemoryError) as e:
        raise PinferError(f"the model's chat template does not parse ({_why(e)}); run without --chat") from None


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {quote(str(e), 200)[1:-1]}"


_TEMPLATE_SIZE = 1 << 24  # characters (or items) a template may build with * or produce with **


@functools.cache
def _template_environment():
    """jinja2's immutable sandbox, which refuses attribute tricks (SecurityError) and bounds range(), with `*` and
    `**` bounded too: `'a' * 10**10` in a template would otherwise take the machine's memory before anything failed."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                n, seq = (right, left) if isinstance(left, (str, list, tuple)) else (left, right)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _TEMPLATE_SIZE:
                    raise SecurityError(f"a sequence of {len(seq) * n} items is too large")
            elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 1 and \
                    right * max(abs(left).bit_length(), 1) > 8 * _TEMPLATE_SIZE:
                raise SecurityError(f"{left} ** {right} is too large")
            return super().call_binop(context, operator, left, right)

    return Environment




def _get(f: GGUFFile | dict, key: str, default: Any = None) -> Any:
    return (f.metadata if isinstance(f, GGUFFile) else f).get(key, default)


def load_tokenizer(f: GGUFFile | dict) -> GGUFTokenizer:
    """Build the tokenizer a GGUF file describes (its metadata is all that is read)."""
    path = f.path if isinstance(f, GGUFFile) else "model"
    kind = _get(f, C.TOKENIZER_MODEL)
    tokens = _get(f, C.TOKENIZER_TOKENS)
    if kind is None or tokens is None:
        raise PinferError(f"{path}: the file has no tokenizer (tokenizer.ggml.model/tokens); convert it with "
                          f"llama.cpp's convert_hf_to_gguf.py")
    types = _get(f, C.TOKENIZER_TOKEN_TYPE)
    types = np.asarray(types) if types is not None else np.full(len(tokens), C.TOKEN_TYPE_NORMAL)
    check_vocabulary(path, f, kind, tokens, types)
    if kind == "gpt2":
        tok = _library(path, _bpe_tokenizer, tokens, _get(f, C.TOKENIZER_MERGES, []),
                       str(_get(f, C.TOKENIZER_PRE, "default")))
        default_add_bos = False
    elif kind == "llama":
        scores = _get(f, C.TOKENIZER_SCORES)
        if scores is None:
            raise PinferError(f"{path}: SentencePiece vocabulary without tokenizer.ggml.scores")
        tok = _library(path, _spm_tokenizer, tokens, np.asarray(scores, dtype=np.float32), types,
                       bool(_get(f, C.TOKENIZER_ADD_SPACE_PREFIX, True)))
        default_add_bos = True
    else:
        raise PinferError(f"{path}: tokenizer type {quote(kind)} is not supported (only 'gpt2' BPE and 'llama' "
                          f"SentencePiece)")
    special_types = (C.TOKEN_TYPE_CONTROL, C.TOKEN_TYPE_USER_DEFINED)
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True) if ty in special_types and t]
    if specials:
        tok.add_special_tokens(specials)
    bos, eos = _get(f, C.TOKENIZER_BOS_ID), _get(f, C.TOKENIZER_EOS_ID)
    stop = {int(i) for i in (eos, _get(f, C.TOKENIZER_EOT_ID)) if i is not None}
    token_index = {t: i for i, t in enumerate(tokens) if types[i] == C.TOKEN_TYPE_CONTROL}
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):  # chat end-of-turn markers
        if name in token_index:
            stop.add(token_index[name])
    return GGUFTokenizer(tok, None if bos is None else int(bos), None if eos is None else int(eos),
                         bool(_get(f, C.TOKENIZER_ADD_BOS, default_add_bos)), bool(_get(f, C.TOKENIZER_ADD_EOS, False)),
                         len(tokens), _get(f, C.TOKENIZER_CHAT_TEMPLATE), stop, list(tokens))


def check_vocabulary(path, f: GGUFFile | dict, kind: Any, tokens: Any, types: np.ndarray) -> None:
    """The tokenizer.ggml.* keys hold what a converter writes: a list of strings, per-token arrays of its length,
    special ids inside it. A damaged one otherwise surfaced as an internal error (a zip() of unequal lengths)."""
    def bad(what: str):
        raise PinferError(f"{path}: {what}; the file's tokenizer.ggml.* metadata is damaged")

    if not isinstance(kind, str):
        bad(f"{C.TOKENIZER_MODEL} is {type(kind).__name__}, expected a string")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        bad(f"{C.TOKENIZER_TOKENS} is {type(tokens).__name__}, expected a non-empty list of strings")
    if types.ndim != 1 or types.dtype.kind not in "iu" or len(types) != len(tokens):
        bad(f"{C.TOKENIZER_TOKEN_TYPE} holds {types.size} {types.dtype} values for {len(tokens)} tokens")
    scores = _get(f, C.TOKENIZER_SCORES)
    if scores is not None and (not isinstance(scores, np.ndarray) or scores.dtype.kind not in "fiu"
                               or scores.shape != (len(tokens),)):
        bad(f"{C.TOKENIZER_SCORES} is not one number per token")
    merges = _get(f, C.TOKENIZER_MERGES, [])
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        bad(f"{C.TOKENIZER_MERGES} is {type(merges).__name__}, expected a list of strings")
    for key in (C.TOKENIZER_BOS_ID, C.TOKENIZER_EOS_ID, C.TOKENIZER_EOT_ID):
        i = _get(f, key)
        if i is not None and (isinstance(i, bool) or not isinstance(i, (int, np.integer))
                              or not 0 <= i < len(tokens)):
            bad(f"{key} is {quote(i, 40)}, not the id of one of its {len(tokens)} tokens")
    for key in (C.TOKENIZER_PRE, C.TOKENIZER_CHAT_TEMPLATE):
        v = _get(f, key)
        if v is not None and not isinstance(v, str):
            bad(f"{key} is {type(v).__name__}, expected a string")


def _library(path, build, *args) -> Tokenizer:
    """build(*args) with what the `tokenizers` library rejects (it raises plain Exception, TypeError or ValueError,
    sometimes over several lines) turned into one line that names the file."""
    try:
        return build(*args)
    except Exception as e:  # noqa: BLE001 - whatever the library raises about the vocabulary
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PinferError(f"{path}: the tokenizer library rejects the file's vocabulary ({why}); its tokenizer.ggml.* "
                          f"metadata is damaged") from None


def _bpe_tokenizer(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in IGNORE_MERGES))
    regexes = PRE_TOKENIZER_REGEXES.get(pre, PRE_TOKENIZER_REGEXES["default"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: np.ndarray, types: np.ndarray) -> list[tuple[str, str]]:
    """Recover SentencePiece-BPE merges: every split of a normal token into two vocabulary pieces is a merge,
    ranked by the score of the token it produces (higher score merges first)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (C.TOKEN_TYPE_NORMAL, C.TOKEN_TYPE_USER_DEFINED)}
    found = []
    for t, i in vocab.items():
        if len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                found.append((-float(scores[i]), i, vocab[a], vocab[b], a, b))
    found.sort()
    return [(a, b) for *_, a, b in found]


def _spm_tokenizer(tokens: list[str], scores: np.ndarray, types: np.ndarray, add_space_prefix: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((t for t, ty in zip(tokens, types, strict=True) if ty == C.TOKEN_TYPE_UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok
