"""Tokenizer: a ``tokenizers.Tokenizer`` plus special ids and the model's own Jinja chat template."""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.sandbox
import tokenizers


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False):
    # jinja2's built-in tojson HTML-escapes <, >, & and ' — wrong for prompts; templates expect json.dumps.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way Hugging Face renders them (sandboxed, trimmed blocks)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text ↔ token ids for one model.

    ``encode`` does not add special tokens by default: prompts come from the chat template, which
    already writes BOS/role markers as text (and those are matched as special tokens).
    ``stop_ids`` are the ids that end a generated response (EOS plus any extra end-of-turn ids).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | None = None, extra_stop_ids: Sequence[int] = ()):
        self.backend = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token = pad_token if pad_token is not None else eos_token
        self.bos_id = self._token_id(bos_token, "bos_token")
        self.eos_id = self._token_id(eos_token, "eos_token")
        self.pad_id = self._token_id(self.pad_token, "pad_token")
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        stops = ([self.eos_id] if self.eos_id is not None else []) + [int(i) for i in extra_stop_ids]
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))

    def _token_id(self, token: str | None, role: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` of each text, in parallel (the Rust tokenizer's threads)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's own template."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template (none in tokenizer_config.json, "
                             "chat_template.jinja or the GGUF metadata)")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
        # Like transformers, tools/documents are always defined (None unless given): templates test them.
        context = dict(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                       tools=None, documents=None)
        context.update(template_kwargs)
        return self._template.render(**context)

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        """From a Hugging Face model folder: tokenizer.json, tokenizer_config.json (special tokens,
        chat_template), chat_template.jinja (newer transformers save it there), generation_config.json
        (extra stop ids)."""
        path = pathlib.Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:   # tokenizers raises a bare Exception: a file cut short, not UTF-8
            raise ValueError(f"{tokenizer_file} cannot be read as a tokenizer ({e}); a copy that "
                             f"was cut short or is not a Hugging Face tokenizer.json: copy it "
                             f"again from the model's source") from e
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        generation = _read_json(path / "generation_config.json")
        stop = generation.get("eos_token_id", [])
        stop = [stop] if isinstance(stop, int) else list(stop or [])
        return cls(backend, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")),
                   pad_token=_token_text(config.get("pad_token")), chat_template=template,
                   extra_stop_ids=stop)


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _token_text(token) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token
