"""The gateway's use of the model's tokenizer: a prompt (text, token ids or a chat rendered with its template) to
checked ids, and ids back to text. Long work runs on a thread: the event loop never runs O(prompt) work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from splitserve.gateway.errors import invalid
from splitserve.gateway.generation_input import ChatOptions, GenerationInput
from splitserve.gateway.heap import trim_heap

# Texts up to this many characters are tokenized on the event loop (tens of microseconds); longer
# ones on a thread, through the tokenizer's GIL-releasing batch call.
INLINE_TOKENIZE_CHARS = 8192
TRIM_AFTER_CHARS = 128 << 10  # a text this long is encoded, then the freed heap goes back to the system


class GatewayTokenizer:
    """Tokenizes and detokenizes for the request path and the tokenize endpoints. `chat_template`: the
    --chat-template every chat is rendered with (None: the model's)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = len(tokenizer)

    async def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids as the tokenizer defines them, special tokens included (BOS where the
        model's tokenizer adds one), as transformers and vLLM encode a completion prompt. Past
        INLINE_TOKENIZE_CHARS the work runs on a thread (the event loop never runs O(prompt) work)."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(await asyncio.to_thread(self._encode_large, text, add_special_tokens))

    def _encode_large(self, text: str, add_special_tokens: bool) -> list[int]:
        """On a worker thread: a long text's ids; past TRIM_AFTER_CHARS the heap its encoding took goes back to the
        system (a 1 MB text's encoding peaks at ~250 MB, and glibc kept ~70 MB of it: 102 MB RSS after, 81 after a
        trim, from 35)."""
        ids = self.tokenizer.encode(text, add_special_tokens)
        if len(text) > TRIM_AFTER_CHARS:
            trim_heap()
        return ids

    async def tokenize_chat(self, turns: Sequence[tuple[str, str]], options: ChatOptions | None = None) -> list[int]:
        """The chat rendered with the model's template, then encoded without special tokens (the
        template writes them); long conversations off the event loop."""
        from functools import partial

        from splitserve.common.tokenizer import apply_chat_template

        options = options or ChatOptions()
        if options.continue_final_message and options.add_generation_prompt:
            raise invalid(
                "continue_final_message continues the last message: set add_generation_prompt to false with it",
                "continue_final_message",
            )
        extras = options.message_extras or ((),) * len(turns)
        render = partial(
            apply_chat_template,
            self.tokenizer,
            [{"role": r, "content": c, **dict(extra)} for (r, c), extra in zip(turns, extras)],
            options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            chat_template=self.chat_template,
            chat_template_kwargs=dict(options.template_kwargs),
            tools=list(options.tools) if options.tools is not None else None,
        )
        try:
            if sum(len(c) for _, c in turns) <= INLINE_TOKENIZE_CHARS:
                return render()
            return await asyncio.to_thread(render)
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None
        except Exception as exc:  # a template that raises (e.g. roles must alternate)
            raise invalid(f"messages cannot be rendered with the chat template: {exc}", "messages") from None

    async def detokenize(
        self, token_ids: Sequence[int], skip_special_tokens: bool = False, param: str = "tokens"
    ) -> str:
        """Text of `token_ids` (each checked against the vocabulary); long lists off the event loop."""
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise invalid(
                    f"{param} must hold token ids 0..{self.vocab_size - 1} (the vocabulary), got {token_id!r}", param
                )
        if len(token_ids) <= INLINE_TOKENIZE_CHARS // 4:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return await asyncio.to_thread(self.tokenizer.decode, list(token_ids), skip_special_tokens=skip_special_tokens)

    async def prompt_token_ids(self, inp: GenerationInput, max_model_len: int) -> list[int]:
        """Tokenize and check the prompt: non-empty, ids in the vocabulary, within the context (`max_model_len`;
        0: not known yet)."""
        if inp.chat is not None:
            if not inp.chat:
                raise invalid("messages must not be empty", "messages")
            ids = await self.tokenize_chat(inp.chat, inp.chat_options)
            param = "messages"
        elif inp.token_ids is not None:
            ids = list(inp.token_ids)
            param = "prompt"
            for token_id in ids:
                if not 0 <= token_id < self.vocab_size:
                    raise invalid(
                        f"prompt token id {token_id} is out of range; the vocabulary has "
                        f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})",
                        "prompt",
                    )
        else:
            ids = await self.tokenize_text(inp.text or "", inp.add_special_tokens)
            param = "prompt"
        if not ids:
            raise invalid(f"{param} must not be empty", param)
        limit = max_model_len
        if limit and len(ids) >= limit:
            raise invalid(
                f"{param} has {len(ids)} tokens, but the model's context limit (max_model_len) "
                f"is {limit} tokens, which must also hold at least one generated token",
                param,
            )
        return ids
