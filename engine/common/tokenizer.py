"""Tokenizer of a local Hugging Face model directory, on the Rust `tokenizers` library and jinja2 alone.

The gateway tokenizes and detokenizes every request and must never import torch; transformers 5
imports torch while it loads a tokenizer (configuration_utils -> modeling_rope_utils). So this
module does with the directory's files what transformers' `TokenizersBackend` (the class
`AutoTokenizer` picks for tokenizer_class PreTrainedTokenizerFast) does, and tests/test_tokenizer.py
holds the two equal, id for id and character for character:

- tokenizer.json is the pipeline as written (normalizer, pre-tokenizer, model, post-processor,
  decoder); its truncation and padding are switched off, as transformers switches them off for
  every call that asks for neither. tokenizer_config.json's add_bos_token / add_eos_token are
  ignored: transformers 5 drops them whenever tokenizer.json exists, so the post-processor alone
  decides whether encode(add_special_tokens=True) adds BOS or EOS.
- Special tokens named in tokenizer_config.json (bos_token ... mask_token, other `*_token` keys,
  extra_special_tokens) and its added_tokens_decoder join the vocabulary when tokenizer.json lacks
  them. Directories without added_tokens_decoder (older saves) are read the legacy way, through
  special_tokens_map.json, added_tokens.json and tokenizer.json's added_tokens.
- decode is the Rust decode; clean_up_tokenization_spaces (tokenizer_config.json, default off)
  applies to non-BPE models only, as in transformers 5.
- Chat templates come from chat_template.jinja and additional_chat_templates/*.jinja, else from
  tokenizer_config.json's chat_template; they render in jinja2's immutable sandbox with
  transformers' options (trim_blocks, lstrip_blocks, loop controls), filter (tojson without HTML
  escaping) and globals (raise_exception, strftime_now), and see the named special tokens.

Not read: tokenizer.model without tokenizer.json (converting SentencePiece needs transformers).
tokenizer_config.json's tokenizer_class is not consulted: where transformers would pick a class
that rebuilds the pipeline in Python (LlamaTokenizer for a Metaspace tokenizer.json, Qwen2Tokenizer,
...), tokenizer.json is still read as written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as RustTokenizer

# transformers' named special tokens, in its order (all_special_ids and the template see this order)
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # one reasoning text, several names
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where the final message ends in the rendered text


class Tokenizer:
    """Encode, decode and chat-template with one model directory's tokenizer (see the module docstring).

    `chat_template` is the template used when none is named (None: the directory has none);
    `chat_templates` holds the named ones when the directory has several ("default", "tool_use", ...).
    """

    def __init__(self, directory: str) -> None:
        self.name_or_path = directory
        root = Path(directory)
        config = _read_json(root / "tokenizer_config.json") or {}
        self._backend = _load_backend(root / "tokenizer.json")
        named, extras, added = _special_tokens(root, config, self._backend.get_added_tokens_decoder())
        _add_missing_tokens(self._backend, named, extras, added)
        if self._backend.post_processor is None:  # what transformers installs (it adds nothing)
            self._backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
        self._backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.special_tokens_map = {name: str(token) for name, token in named.items()}
        self.all_special_tokens = list(dict.fromkeys([*self.special_tokens_map.values(), *map(str, extras)]))
        self.all_special_ids = [self._token_id(token) for token in self.all_special_tokens]
        # transformers skips the clean-up for BPE models: it would strip legitimate spaces before punctuation
        is_bpe = type(self._backend.model).__name__ == "BPE"
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_applies = not is_bpe or bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        )
        templates = _read_chat_templates(root, config)
        self.chat_templates: dict[str, str] = templates if isinstance(templates, dict) else {}
        self.chat_template: str | None = templates.get("default") if isinstance(templates, dict) else templates

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._token_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._token_id(self.bos_token)

    def __len__(self) -> int:
        """Vocabulary size including added tokens (ids run 0 .. len - 1)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies tokenizer.json's post-processor (BOS/EOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str:
        """Text of `ids` by the Rust decoder. clean_up_tokenization_spaces None follows tokenizer_config.json;
        either way BPE models are not cleaned up (transformers 5 refuses to)."""
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean_up = self._clean_up_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return _clean_up_tokenization(text) if clean_up and self._clean_up_applies else text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the chat template (text, not ids), as transformers'
        apply_chat_template(..., tokenize=False). `chat_template` is a template's name or its text;
        continue_final_message (True: the "content" field, or a field's name) leaves the last message
        open for the model to continue. template_kwargs reach the template next to the special tokens
        (bos_token, eos_token, ...), which they override; `documents` is passed as transformers does."""
        template = self._pick_template(chat_template, tools)
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation; give at least one message")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt exclude each other: continuing the final "
                "message means no new assistant header; pass add_generation_prompt=False"
            )
        for tool in tools or ():
            if not isinstance(tool, Mapping):
                raise ValueError(f"each tool must be a JSON schema (a dict), got {type(tool).__name__}")
        documents = template_kwargs.pop("documents", None)
        for document in documents or ():
            if not isinstance(document, Mapping):
                raise TypeError(f"each document must be a dict with 'title' and 'text', got {type(document).__name__}")
        context = {
            **self.special_tokens_map,
            **template_kwargs,
            "tools": None if tools is None else list(tools),
            "documents": documents,
        }
        chat = _alias_reasoning_fields(_plain([_without_none_values(m) for m in messages]))
        return _render(template, chat, _plain(context), add_generation_prompt, continue_final_message)

    def _pick_template(self, chat_template: str | None, tools: Sequence[Any] | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is not None:
            return self.chat_template
        named = (
            f" (it has templates {sorted(self.chat_templates)} but none named 'default')" if self.chat_templates else ""
        )
        raise ValueError(f"tokenizer {self.name_or_path!r} has no chat template{named}; pass chat_template")

    def _token_id(self, token: str) -> int | None:
        token_id = self._backend.token_to_id(token)
        unk = self.special_tokens_map.get("unk_token")
        return token_id if token_id is not None or unk is None else self._backend.token_to_id(unk)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer saved in model directory `path` (local files only, never the hub).

    Raises FileNotFoundError when the directory does not exist, and ValueError naming the
    directory when it has no tokenizer.json or its tokenizer files cannot be read.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(
            f"cannot load a tokenizer from {path!r}: tokenizer.json is required (a directory with only "
            "tokenizer.model needs converting once: load it with transformers and save_pretrained it)"
        )
    return Tokenizer(path)


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    continue_final_message: bool | str = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render chat `messages` ([{"role": ..., "content": ...}]) with the tokenizer's template (or
    `chat_template`, a name or a template) and return the prompt token ids. The template itself
    writes any BOS token, so the text is encoded without adding special tokens again."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template; use a completion request with a "
            "plain prompt, or a model directory whose tokenizer_config.json has chat_template"
        )
    text = tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        **(chat_template_kwargs or {}),
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


# ---- loading ----


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from exc


def _load_backend(path: Path) -> RustTokenizer:
    try:
        backend = RustTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises a bare Exception
        raise ValueError(f"cannot load a tokenizer from {str(path.parent)!r}: {path.name}: {exc}") from exc
    backend.no_truncation()
    backend.no_padding()
    return backend


def _special_tokens(
    root: Path, config: dict, json_added: dict[int, AddedToken]
) -> tuple[dict[str, Any], list[Any], dict[int, AddedToken]]:
    """(named special tokens in transformers' order, extra special tokens, added tokens by id), each
    token a str or an AddedToken, as transformers derives them from the directory's files;
    `json_added` are tokenizer.json's added tokens."""
    config = dict(config)
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    custom = {k: config.pop(k) for k in list(config) if _is_custom_token(k, config[k], (str,))}
    if isinstance(config.get("extra_special_tokens"), dict):
        custom.update(config.pop("extra_special_tokens"))
    if "added_tokens_decoder" in config:
        added = {int(i): AddedToken(**token) for i, token in config["added_tokens_decoder"].items()}
    else:
        added = _legacy_added_tokens(root, config, custom, json_added)
    if "additional_special_tokens" in config and "extra_special_tokens" not in config:
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    config = _added_token_objects(config)
    by_content = {token.content: token for token in added.values()}
    named = {k: by_content.get(str(config[k]), config[k]) for k in _NAMED_TOKENS if config.get(k) is not None}
    custom = {**{k: v for k, v in config.items() if _is_custom_token(k, v, (str, AddedToken))}, **custom}
    named.update(custom)
    for name, token in named.items():
        if not isinstance(token, (str, AddedToken)):
            raise ValueError(f"special token {name} must be a string, got {token!r}")
    return named, list(config.get("extra_special_tokens") or []), added


def _is_custom_token(key: str, value: Any, types: tuple[type, ...]) -> bool:
    """A model's own named special token (image_token, ...): transformers treats it like bos_token."""
    return key.endswith("_token") and key not in _NAMED_TOKENS and isinstance(value, types)


def _legacy_added_tokens(
    root: Path, config: dict, custom: dict, json_added: dict[int, AddedToken]
) -> dict[int, AddedToken]:
    """Added tokens of a directory saved without added_tokens_decoder; merges special_tokens_map.json
    into `config` (and its named extras into `custom`) on the way."""
    for key, value in (_read_json(root / "special_tokens_map.json") or {}).items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            merged = list(config.get("extra_special_tokens") or [])
            tokens = (AddedToken(**t, special=True) if isinstance(t, dict) else t for t in value)
            value = merged + [t for t in tokens if t not in merged]
        config[key] = value
    if isinstance(config.get("extra_special_tokens"), dict):
        custom.update(config.pop("extra_special_tokens"))
    added: dict[int, AddedToken] = {}
    special = {str(config[k]) for k in _NAMED_TOKENS if config.get(k)} | set(
        map(str, config.get("extra_special_tokens") or [])
    )
    for content, token_id in (_read_json(root / "added_tokens.json") or {}).items():
        is_special = content in special
        added[token_id] = AddedToken(content, normalized=not is_special, special=is_special)
    return {**added, **json_added}


def _added_token_objects(value: Any) -> Any:
    """`{"__type": "AddedToken", ...}` entries of a saved config, as AddedToken objects."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
    if isinstance(value, (list, tuple)):
        return [_added_token_objects(v) for v in value]
    if isinstance(value, dict):
        return {k: _added_token_objects(v) for k, v in value.items()}
    return value


def _add_missing_tokens(backend: RustTokenizer, named: dict, extras: list, added: dict[int, AddedToken]) -> None:
    """Add the configured tokens tokenizer.json lacks, in transformers' order and with its flags:
    added_tokens_decoder by id, then named special tokens, then extras (strings become special)."""
    tokens: list[Any] = [added[i] for i in sorted(added)]
    known = {t.content for t in backend.get_added_tokens_decoder().values()} | {str(t) for t in tokens}
    for token in [*named.values(), *extras]:
        if str(token) not in known:
            tokens.append(token)
            known.add(str(token))
    named_contents = {str(t) for t in named.values()}
    for i, token in enumerate(tokens):
        if isinstance(token, str):
            tokens[i] = AddedToken(token, special=True)
        elif not token.special and token.content in named_contents:
            token.special = True
    if tokens:
        backend.add_tokens(tokens)


def _read_chat_templates(root: Path, config: dict) -> str | dict[str, str] | None:
    """The template files win over tokenizer_config.json: chat_template.jinja alone is the template;
    with additional_chat_templates/*.jinja they are named templates (chat_template.jinja is "default")."""
    files = {}
    if (root / "chat_template.jinja").is_file():
        files["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    if (root / "additional_chat_templates").is_dir():
        for path in sorted((root / "additional_chat_templates").glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):  # saved as [{"name": ..., "template": ...}]
        return {entry["name"]: entry["template"] for entry in template}
    return dict(template) if isinstance(template, Mapping) else template


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: drop the space WordPiece decoding leaves before punctuation
    and English contractions."""
    for spaced, joined in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(spaced, joined)
    return text


# ---- chat templates ----


def _render(
    template: str, chat: list[dict], context: dict, add_generation_prompt: bool, continue_final_message: bool | str
) -> str:
    """Render one conversation. To continue the final message, a tag is appended to it and the text is
    cut where the tag lands, so whatever the template writes after a message (end-of-turn tokens) goes."""
    if not continue_final_message:
        return _compile(template).render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message is set but the final message has no {field!r} to continue")
    fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final] if field in _REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message is set to {field!r} but the chat template never reads that field")
    if isinstance(final, (list, tuple)):  # content blocks: continue the last text block
        block = next((b for b in reversed(final) if "text" in b), None)
        if block is None:
            raise ValueError("continue_final_message is set but the final message has no text block to continue")
        final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
    else:
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    text = _compile(template).render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the chat template dropped part of the final message "
            f"{final.strip()!r}; rendered: {text!r}"
        )
    cut = text.rindex(tag)
    # a template that strips message text also strips the space after the tag: trim what it left
    return text[:cut] if text[cut : cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:cut].rstrip()


def _without_none_values(message: Mapping[str, Any]) -> dict:
    """The message without keys whose value is None (an API's content=None renders as "None" otherwise)."""
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    """Give a message's reasoning under the names templates read it by ("thinking", "reasoning_content")."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _plain(value: Any) -> Any:
    """A copy of `value` made of JSON types only: a chat template is untrusted code, so no object with
    methods reaches it (other objects become a "<TypeName>" placeholder)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums) lose their methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace() without underscore attributes (a way from a template into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named `self`, so namespace(self=...) works
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set namespace attribute {name!r}")


class _TemplateDict:
    """The `dict` a template sees: it builds dicts and offers no type to climb from."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """jinja2's own tojson escapes HTML characters (<, >, &, '), which would change the prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace
    )
    return env.from_string(template)
