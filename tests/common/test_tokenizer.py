"""splitserve's torch-free Tokenizer against transformers' AutoTokenizer on the same directories.

Each directory is built here from a tokenizer trained in the test (no hub). Every comparison is
exact: ids, text, vocabulary size, special token ids, rendered chat text.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from splitserve.common.default_model_path import default_model_path
from splitserve.common.tokenizer import GIL_FREE_DECODE_IDS, apply_chat_template, load_tokenizer

CORPUS = [
    "hello world, the cat sat on the mat.",
    "héllo wörld café crème brûlée",
    "中文 字符 测试 中文",
    "don't stop; it's what we've got. Isn't it?",
    "def f(x):\n    return x  # tab\there",
] * 4
TEXTS = [
    "hello world",
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "héllo wörld café 中文 😀 Ω ∑",
    "<s>hello</s> world <unk>",
    "say <s> twice <s><s>",
    "Don't stop , it 's fine . Really ?",
    "unseen ☃ glyphs ꙮ and 🎉🎉",
]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]


def _train(tok: Tokenizer, trainer) -> Tokenizer:
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _with_byte_fallback(tok: Tokenizer) -> Tokenizer:
    """Append <0x00>..<0xFF> to a trained BPE's vocabulary and switch byte fallback on (SentencePiece style)."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(data))


def llama_style(bos_in_post_processor: bool) -> Tokenizer:
    """SentencePiece-like BPE: Metaspace, byte fallback, '<s>' BOS through a TemplateProcessing or none."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok = _with_byte_fallback(_train(tok, trainers.BpeTrainer(vocab_size=200, special_tokens=LLAMA_SPECIALS)))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    if bos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


def byte_level(bos: str | None) -> Tokenizer:
    """GPT-2 / Llama-3 style byte-level BPE; `bos` is prepended by the post-processor when given."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|begin|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok = _train(tok, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def word_piece() -> Tokenizer:
    """BERT style: lower-casing normalizer, WordPiece, [CLS] $A [SEP] post-processor."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # the clean-up left is transformers'
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = _train(tok, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


def save(path: Path, tok: Tokenizer, config: dict, *, added_tokens_decoder: bool = True) -> Path:
    """tokenizer.json as built, tokenizer_config.json as given (plus added_tokens_decoder, as transformers saves)."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if added_tokens_decoder:
        decoder = tok.get_added_tokens_decoder()
        config = {**config, "added_tokens_decoder": {str(i): t.__getstate__() for i, t in decoder.items()}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


LLAMA_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
}
BYTE_LEVEL_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "additional_special_tokens": ["<|user|>", "<|assistant|>"],
    "clean_up_tokenization_spaces": True,  # ignored for BPE, by transformers and by us
}
WORD_PIECE_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "mask_token": "[MASK]",
    "clean_up_tokenization_spaces": True,
}

# name -> (tokenizer builder, tokenizer_config.json, keep added_tokens_decoder)
DIRECTORIES = {
    # (a) Llama: add_bos_token in the config, BOS added by tokenizer.json's post-processor
    "llama_bos": (lambda: llama_style(True), LLAMA_CONFIG, True),
    "llama_bos_legacy_config": (lambda: llama_style(True), LLAMA_CONFIG, False),
    # add_bos_token: true over a post-processor that adds nothing: transformers 5 adds no BOS
    "llama_config_only_bos": (lambda: llama_style(False), LLAMA_CONFIG, True),
    # the class transformers maps to its own LlamaTokenizer, rebuilding this same pipeline
    "llama_class": (lambda: llama_style(True), {**LLAMA_CONFIG, "tokenizer_class": "LlamaTokenizerFast"}, True),
    # (b) no BOS at all; clean-up asked for but skipped (BPE); a pad token and extras missing from tokenizer.json
    "byte_level_no_bos": (lambda: byte_level(None), BYTE_LEVEL_CONFIG, True),
    "byte_level_new_tokens": (
        lambda: byte_level(None),
        {
            **BYTE_LEVEL_CONFIG,
            "pad_token": "<pad>",
            "image_token": "<image>",
            "additional_special_tokens": ["<|user|>", "<tool>"],
        },
        True,
    ),
    # (c) tokenizer.json's post-processor adds BOS; the config says nothing, or even add_bos_token: false
    "byte_level_bos": (lambda: byte_level("<|begin|>"), {**BYTE_LEVEL_CONFIG, "bos_token": "<|begin|>"}, True),
    "byte_level_bos_config_false": (
        lambda: byte_level("<|begin|>"),
        {**BYTE_LEVEL_CONFIG, "bos_token": "<|begin|>", "add_bos_token": False},
        True,
    ),
    "byte_level_split_special": (lambda: byte_level(None), {**BYTE_LEVEL_CONFIG, "split_special_tokens": True}, True),
    # WordPiece: [CLS]/[SEP] from the post-processor, clean-up of tokenization spaces applied
    "word_piece": (word_piece, WORD_PIECE_CONFIG, True),
    "word_piece_no_clean_up": (word_piece, {**WORD_PIECE_CONFIG, "clean_up_tokenization_spaces": False}, True),
}


@pytest.fixture(scope="module", params=sorted(DIRECTORIES))
def pair(request, tmp_path_factory):
    """(ours, transformers') for one directory."""
    build, config, keep_decoder = DIRECTORIES[request.param]
    path = save(tmp_path_factory.mktemp(request.param), build(), config, added_tokens_decoder=keep_decoder)
    return load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))


def ids_to_check(ours, theirs) -> list[list[int]]:
    every = list(range(len(theirs)))
    long = (every * (GIL_FREE_DECODE_IDS // len(every) + 2))[: GIL_FREE_DECODE_IDS + 9]  # the batch call's path
    return [every, every[::-1], every[:40], long, *[theirs.encode(t, add_special_tokens=True) for t in TEXTS]]


def test_encode_equals_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == theirs.encode(text, add_special_tokens=add), text


def test_decode_equals_transformers(pair):
    ours, theirs = pair
    for ids in ids_to_check(ours, theirs):
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            for clean in (True, False):
                kwargs = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": clean}
                assert ours.decode(ids, **kwargs) == theirs.decode(ids, **kwargs)


def test_vocabulary_and_special_tokens_equal_transformers(pair):
    ours, theirs = pair
    assert len(ours) == len(theirs)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.special_tokens_map == theirs.special_tokens_map


def test_what_each_directory_adds(tmp_path):
    """The cases above really differ: BOS from the post-processor only, [CLS]/[SEP], clean-up for WordPiece,
    configured tokens missing from tokenizer.json added to the vocabulary."""
    for name, bos in {"llama_bos": "<s>", "llama_config_only_bos": None, "byte_level_bos": "<|begin|>"}.items():
        build, config, _ = DIRECTORIES[name]
        tok = load_tokenizer(save(tmp_path / name, build(), config))
        with_specials, without = tok.encode("hello world"), tok.encode("hello world", add_special_tokens=False)
        assert with_specials == ([tok.token_to_id(bos)] if bos else []) + without
    build, config, _ = DIRECTORIES["word_piece"]
    bert = load_tokenizer(save(tmp_path / "bert", build(), config))
    ids = bert.encode("Hello , world .")
    assert [bert.decode(ids[:1]), bert.decode(ids[-1:])] == ["[CLS]", "[SEP]"]
    assert bert.decode(ids, skip_special_tokens=True) == "hello, world."
    assert bert.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == "hello , world ."
    build, config, _ = DIRECTORIES["byte_level_new_tokens"]
    grown = load_tokenizer(save(tmp_path / "grown", build(), config))
    assert len(grown) == byte_level(None).get_vocab_size() + 3  # <pad>, <image>, <tool>
    assert grown.encode("a<image>b<pad>", False)[1::2] == [grown.token_to_id("<image>"), grown.token_to_id("<pad>")]


CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0) %}"
    "{% if tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% if message['role'] == 'stop' %}{% break %}{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message.get('meta') %}{{ message['meta'] | tojson(indent=2) }}\n{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if not loop.last or message['role'] != 'assistant' %}{{ eos_token }}\n{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "{% endfor %}"
    "{% for key, value in dict(turns=ns.turns).items() %}[{{ key }}={{ value }}]{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>{% endif %}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief & <polite>."},
    {"role": "skip", "content": "never shown"},
    {"role": "user", "content": "héllo 😀", "meta": {"lang": "fr", "tags": ["<a>", "ü"]}},
    {"role": "assistant", "content": "Hi there   "},
]


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    save(path, llama_style(True), {**LLAMA_CONFIG, "chat_template": CHAT_TEMPLATE})
    return load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize(
    "messages, kwargs",
    [
        (MESSAGES, {"add_generation_prompt": True}),
        (MESSAGES, {"add_generation_prompt": False}),
        (MESSAGES, {"add_generation_prompt": False, "continue_final_message": True}),
        (MESSAGES[:3], {"add_generation_prompt": True, "enable_thinking": True}),
        (MESSAGES + [{"role": "stop", "content": "x"}, {"role": "bogus", "content": "y"}], {}),
        (MESSAGES[:3], {"tools": [{"name": "get_weather", "parameters": {"city": "string <b>"}}]}),
        (MESSAGES[:3], {"eos_token": "<END>", "add_generation_prompt": True}),
        ([{"role": "user", "content": "hi", "tool_calls": None}], {"add_generation_prompt": True}),
    ],
)
def test_chat_template_renders_as_transformers(chat_pair, messages, kwargs):
    ours, theirs = chat_pair
    kwargs = {"add_generation_prompt": False, **kwargs}  # transformers' default is False, ours True
    expected = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == expected
    assert expected.startswith("<s>")


def test_chat_template_errors_as_transformers(chat_pair):
    import jinja2

    ours, theirs = chat_pair
    bad = MESSAGES + [{"role": "bogus", "content": "y"}]
    for tok, extra in ((ours, {}), (theirs, {"tokenize": False})):
        with pytest.raises(jinja2.TemplateError, match="unknown role bogus"):
            tok.apply_chat_template(bad, add_generation_prompt=False, **extra)
        with pytest.raises(ValueError, match="add_generation_prompt"):
            tok.apply_chat_template(MESSAGES, add_generation_prompt=True, continue_final_message=True, **extra)


INDENTED_TEMPLATE = """{%- for message in messages %}
    {% if message['role'] == 'user' %}
        User: {{ message['content'] | trim }}
    {% else %}
        {{ message['role'] | capitalize }}: {{ message['content'] }}
    {% endif %}
{% endfor -%}
{% if add_generation_prompt %}
Assistant:{% endif %}"""


def test_block_whitespace_and_sandbox_as_transformers(chat_pair):
    """trim_blocks and lstrip_blocks shape the text; the sandbox refuses underscore namespace attributes."""
    import jinja2

    ours, theirs = chat_pair
    for prompt in (True, False):
        expected = theirs.apply_chat_template(
            MESSAGES, tokenize=False, chat_template=INDENTED_TEMPLATE, add_generation_prompt=prompt
        )
        assert ours.apply_chat_template(MESSAGES, chat_template=INDENTED_TEMPLATE, add_generation_prompt=prompt) == (
            expected
        )
    escape = "{% set ns = namespace(_hidden=1) %}{{ ns }}"
    for tok, extra in ((ours, {}), (theirs, {"tokenize": False})):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(MESSAGES, chat_template=escape, **extra)


def test_template_files_and_named_templates(tmp_path):
    """chat_template.jinja wins over the config; additional_chat_templates/ makes named ones ("default" used)."""
    save(tmp_path, byte_level(None), {**BYTE_LEVEL_CONFIG, "chat_template": "config {{ messages[0]['content'] }}"})
    messages = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "config hi"
    (tmp_path / "chat_template.jinja").write_text("file {{ messages[0]['content'] }}")
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "file hi"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools {{ tools | length }}")
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_templates == theirs.chat_template and set(ours.chat_templates) == {"default", "tool_use"}
    tools = [{"name": "a"}, {"name": "b"}]
    for kwargs in ({}, {"tools": tools}, {"chat_template": "tool_use", "tools": tools}, {"chat_template": "x{{ 1 }}"}):
        assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    assert ours.apply_chat_template(messages, tools=tools) == "tools 2"


def test_module_apply_chat_template_encodes_without_special_tokens(chat_pair):
    ours, theirs = chat_pair
    ids = apply_chat_template(ours, MESSAGES[:3], chat_template_kwargs={"enable_thinking": True})
    assert (
        ids == theirs.apply_chat_template(MESSAGES[:3], add_generation_prompt=True, enable_thinking=True)["input_ids"]
    )
    assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1  # the template's BOS, not a second one
    continued = apply_chat_template(ours, MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert ours.decode(continued).endswith("</s>\n<|assistant|>\nHi there   ")  # open: no </s> after it


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError) as excinfo:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(excinfo.value) and "tokenizer.json is required" in str(excinfo.value)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load a tokenizer from"):
        load_tokenizer(tmp_path)


def test_the_default_model_matches_transformers():
    path = default_model_path()
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    assert len(ours) == len(theirs) == 8192 and ours.eos_token_id == theirs.eos_token_id == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_loading_the_default_tokenizer_imports_no_torch():
    code = (
        "import sys\nimport splitserve.common.tokenizer as t\n"
        "from splitserve.common.default_model_path import default_model_path\n"
        "tok = t.load_tokenizer(default_model_path())\n"
        "t.apply_chat_template(tok, [{'role': 'user', 'content': 'hi'}])\n"
        "assert tok.decode(tok.encode('hi')) == 'hi'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def llama2_legacy() -> Tokenizer:
    """Llama-2's tokenizer.json shape: the '▁' prefix from the normalizer, no pre-tokenizer."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok = _with_byte_fallback(_train(tok, trainers.BpeTrainer(vocab_size=200, special_tokens=LLAMA_SPECIALS)))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def test_a_class_transformers_rebuilds_is_read_as_tokenizer_json_says(tmp_path, caplog):
    """For tokenizer_class LlamaTokenizer over a Llama-2 style tokenizer.json, transformers 5 swaps the
    normalizer for a Metaspace pre-tokenizer; we keep tokenizer.json's pipeline (what TokenizersBackend
    reads) and say so in one warning."""
    tok = llama2_legacy()
    as_written = AutoTokenizer.from_pretrained(str(save(tmp_path / "plain", tok, LLAMA_CONFIG)))
    rebuilt = AutoTokenizer.from_pretrained(
        str(save(tmp_path / "llama", tok, {**LLAMA_CONFIG, "tokenizer_class": "LlamaTokenizer"}))
    )
    with caplog.at_level("WARNING", logger="splitserve.tokenizer"):
        ours = load_tokenizer(tmp_path / "llama")
    assert "names LlamaTokenizer, which transformers 5 rebuilds" in caplog.text
    assert type(rebuilt).__name__ == "LlamaTokenizer"
    text = "<s>hello</s> world  "
    assert ours.encode(text) == as_written.encode(text) != rebuilt.encode(text)


def test_added_token_flags_from_the_config_are_kept(tmp_path):
    """An added token that strips spaces on its left (lstrip) behaves the same in both."""
    tok = byte_level(None)
    tok.add_special_tokens([AddedToken("<mark>", lstrip=True, rstrip=False, normalized=False, special=True)])
    save(tmp_path, tok, {**BYTE_LEVEL_CONFIG, "additional_special_tokens": ["<mark>"]})
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("a   <mark>b", "<mark> <mark>"):
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == theirs.decode(theirs.encode(text), True)
