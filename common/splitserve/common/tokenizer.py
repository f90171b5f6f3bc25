"""Tokenizer of a local Hugging Face model directory, on the Rust `tokenizers` library and jinja2 alone.

The gateway tokenizes and detokenizes every request and must never import torch; transformers 5
imports torch while it loads a tokenizer (configuration_utils -> modeling_rope_utils). So this
module does with the directory's files what transformers' `TokenizersBackend` (the class
`AutoTokenizer` picks for tokenizer_class PreTrainedTokenizerFast) does, and tests/common/test_tokenizer.py
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
Where tokenizer_config.json's tokenizer_class makes transformers build a class that rebuilds the
pipeline in Python (LlamaTokenizer over a Llama-2 style tokenizer.json, Qwen2Tokenizer, ...),
tokenizer.json is still read as written and one warning says ids may differ from AutoTokenizer's.
(A directory without tokenizer_class, which transformers maps through config.json's model_type,
is not checked.)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as RustTokenizer

from splitserve.common.chat_template import alias_reasoning_fields, plain, render, without_none_values

log = logging.getLogger("splitserve.tokenizer")

# tokenizer_class values for which transformers, too, reads tokenizer.json as written
_PIPELINE_AS_WRITTEN = frozenset({None, "PreTrainedTokenizer", "TokenizersBackend"})
# transformers' named special tokens, in its order (all_special_ids and the template see this order)
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# Longer texts and id lists go through the library's batch calls, which release the GIL while they work (its single
# encode and decode hold it). That makes a worker thread enough for the largest allowed input: the rest that holds
# the GIL (the ids' list, freeing the encoding) is ~50 ms for a 1 MB text, so no slicing into bounded parts.
GIL_FREE_ENCODE_CHARS = 4096
GIL_FREE_DECODE_IDS = 4096


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
        _warn_if_transformers_rebuilds(directory, config.get("tokenizer_class"), self._backend)
        named, extras, added = _special_tokens(root, config, self._backend.get_added_tokens_decoder())
        _add_missing_tokens(self._backend, named, extras, added)
        if self._backend.post_processor is None:  # what transformers installs (it adds nothing)
            self._backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
        self._backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.special_tokens_map = {name: str(token) for name, token in named.items()}
        self.all_special_tokens = list(dict.fromkeys([*self.special_tokens_map.values(), *map(str, extras)]))
        # every named and extra token is in the vocabulary now, so each has an id
        self.all_special_ids = [self._backend.token_to_id(token) for token in self.all_special_tokens]
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
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    def __len__(self) -> int:
        """Vocabulary size including added tokens (ids run 0 .. len - 1)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (None outside the vocabulary)."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies tokenizer.json's post-processor (BOS/EOS).

        A long text goes through the library's batch call, which releases the GIL while it works (its
        single encode holds it: a 1 MB text stopped every other thread for 1.4-2.4 s), so a caller can
        encode it on a worker thread without stalling the others. Same ids either way."""
        if len(text) > GIL_FREE_ENCODE_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str:
        """Text of `ids` by the Rust decoder. clean_up_tokenization_spaces None follows tokenizer_config.json;
        either way BPE models are not cleaned up (transformers 5 refuses to)."""
        if len(ids) > GIL_FREE_DECODE_IDS:  # 280,000 ids held every other thread for 0.15-0.27 s in one decode
            text = self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        else:
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
        chat = alias_reasoning_fields(plain([without_none_values(m) for m in messages]))
        return render(template, chat, plain(context), add_generation_prompt, continue_final_message)

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
    try:
        return Tokenizer(path)
    except (TypeError, KeyError) as exc:  # a config entry of the wrong shape
        raise ValueError(f"cannot load a tokenizer from {path!r}: tokenizer_config.json: {exc!r}") from exc


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    continue_final_message: bool | str = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Render chat `messages` ([{"role": ..., "content": ...}]) with the tokenizer's template (or
    `chat_template`, a name or a template) and `tools` (function tools, as transformers takes them), and
    return the prompt token ids. The template itself writes any BOS token, so the text is encoded without
    adding special tokens again."""
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
        tools=tools,
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


def _warn_if_transformers_rebuilds(directory: str, tokenizer_class: str | None, backend: RustTokenizer) -> None:
    """One line when AutoTokenizer would build a class that replaces tokenizer.json's pipeline in Python
    (LlamaTokenizer over a non-byte-level tokenizer.json, Qwen2Tokenizer, ...): ids may then differ."""
    name = tokenizer_class.removesuffix("Fast") if isinstance(tokenizer_class, str) else None
    parts = (backend.pre_tokenizer, backend.decoder)
    byte_level = any(b'"ByteLevel"' in part.__getstate__() for part in parts if part is not None)
    if name not in _PIPELINE_AS_WRITTEN and not (name == "LlamaTokenizer" and byte_level):
        log.warning(
            "tokenizer %r: tokenizer_config.json names %s, which transformers 5 rebuilds in Python; splitserve "
            "reads tokenizer.json as written, so ids may differ from AutoTokenizer's around spaces and special "
            "tokens (name PreTrainedTokenizerFast if tokenizer.json is right)",
            directory,
            tokenizer_class,
        )


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
    config, custom = _added_token_objects(config), _added_token_objects(custom)
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
