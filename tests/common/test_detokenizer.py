"""Incremental detokenizer and tokenizer loading, on tiny tokenizers trained in the test."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from splitserve.common.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from splitserve.common.tokenizer import apply_chat_template, load_tokenizer

CORPUS = [
    "héllo wörld, café crème brûlée",
    "中文 字符 测试 中文",
    "emoji 😀 party 🎉 done",
    "the cat sat on the mat. stop here please",
    "hello hello world again",
] * 5
TEXT = "the café 😀 serves 中文 crème. stop here 🎉 and brûlée!"


@pytest.fixture(scope="module")
def byte_bpe():
    """Byte-level BPE with so few merges that emoji and some CJK chars span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def metaspace():
    """SentencePiece-style tokenizer: decoding strips the leading '▁' of the first token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["hello world again", "the cat sat on the mat"] * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def decode(tokenizer, ids, skip_special_tokens=True):
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(detok, ids, chunk=1):
    deltas = [detok.push(ids[i : i + chunk]).text for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_deltas_concatenate_to_the_full_decode(byte_bpe, chunk):
    ids = byte_bpe.encode(TEXT, add_special_tokens=False)
    deltas, tail = stream(IncrementalDetokenizer(byte_bpe), ids, chunk)
    assert "".join(deltas) == TEXT == decode(byte_bpe, ids)
    assert tail == ""
    assert not any("\ufffd" in d for d in deltas)


def test_a_character_split_across_tokens_is_held_until_complete(byte_bpe):
    ids = byte_bpe.encode("a😀b", add_special_tokens=False)
    emoji = byte_bpe.encode("😀", add_special_tokens=False)
    assert len(emoji) == 3 and decode(byte_bpe, emoji[:1]) == "\ufffd"  # really split
    detok = IncrementalDetokenizer(byte_bpe)
    assert [detok.push([i]).text for i in ids] == ["a", "", "", "😀", "b"]
    assert detok.output_text == "a😀b"


def test_flush_returns_an_incomplete_character_at_the_end(byte_bpe):
    emoji = byte_bpe.encode("x😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe)
    assert detok.push(emoji[:-1]) == DetokenizerDelta("x", None)
    assert detok.flush() == decode(byte_bpe, emoji[1:-1])  # what decode(all) would show
    assert detok.push(emoji[-1:]).text == ""  # finished


def test_skip_special_tokens(byte_bpe):
    ids = byte_bpe.encode("hello", add_special_tokens=False) + [byte_bpe.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(byte_bpe), ids)[0]) == "hello"
    kept = IncrementalDetokenizer(byte_bpe, skip_special_tokens=False)
    assert "".join(stream(kept, ids)[0]) == "hello</s>"


def test_prompt_context_keeps_the_leading_space(metaspace):
    prompt = metaspace.encode("hello", add_special_tokens=False)
    output = metaspace.encode("world again", add_special_tokens=False)
    alone = IncrementalDetokenizer(metaspace)
    assert "".join(stream(alone, output)[0]) == "world again"  # like decode(output)
    in_context = IncrementalDetokenizer(metaspace, prompt_token_ids=prompt)
    assert stream(in_context, output)[0] == [" world", " again"]


def test_stop_string_across_token_boundaries(byte_bpe):
    ids = byte_bpe.encode(TEXT, add_special_tokens=False)
    pieces = [decode(byte_bpe, [i]) for i in ids]
    assert "stop" not in pieces and " here" not in pieces  # the stop spans several tokens
    for include, expected in [
        (False, "the café 😀 serves 中文 crème. "),
        (True, "the café 😀 serves 中文 crème. stop here"),
    ]:
        detok = IncrementalDetokenizer(byte_bpe, stop=["stop here", "never"], include_stop_str_in_output=include)
        deltas = [detok.push([i]) for i in ids]
        assert "".join(d.text for d in deltas) == expected == detok.output_text
        first_stop = next(n for n, d in enumerate(deltas) if d.stop_str)
        assert deltas[first_stop].stop_str == "stop here" == detok.stop_str
        assert all(d.text == "" for d in deltas[first_stop + 1 :])
        assert detok.flush() == ""


def test_earliest_stop_string_wins_within_one_push(byte_bpe):
    ids = byte_bpe.encode("the cat sat on the mat", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe, stop=["mat", "sat", "at on"])
    assert detok.push(ids) == DetokenizerDelta("the cat ", "sat")


def test_possible_stop_prefix_is_held_back(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, stop=["stop here"])
    ids = byte_bpe.encode("go stop there", add_special_tokens=False)
    texts = [decode(byte_bpe, [i]) for i in ids]
    assert texts == ["g", "o", " s", "t", "op", " ", "the", "re"]
    deltas = [detok.push([i]).text for i in ids]
    # "s" .. "stop " could start "stop here": held back until "the" rules it out
    assert deltas == ["g", "o", " ", "", "", "", "stop the", "re"]


def test_flush_releases_a_held_stop_prefix(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, stop=["stop here"])
    assert detok.push(byte_bpe.encode("go sto", add_special_tokens=False)).text == "go "
    assert detok.output_text == "go sto"
    assert detok.flush() == "sto"
    assert detok.stop_str is None


def test_each_push_decodes_a_bounded_window(byte_bpe):
    calls = []

    class Counting:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return byte_bpe.decode(ids, **kwargs)

    ids = byte_bpe.encode(TEXT * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting())
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == TEXT * 20
    assert max(calls) <= 5  # a window of a few tokens, never the whole output
    assert len(calls) <= 2 * len(ids) + 2


def test_load_tokenizer_and_chat_template(byte_bpe, tmp_path):
    byte_bpe.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(TEXT, add_special_tokens=False) == byte_bpe.encode(TEXT, add_special_tokens=False)
    with pytest.raises(ValueError) as excinfo:
        apply_chat_template(loaded, [{"role": "user", "content": "hi"}])
    assert "has no chat template; use a completion request" in str(excinfo.value)
    loaded.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    ids = apply_chat_template(loaded, [{"role": "user", "content": "café 😀"}])
    assert ids == [loaded.bos_token_id] + loaded.encode("user: café 😀\nassistant:", add_special_tokens=False)


def test_load_tokenizer_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as excinfo:
        load_tokenizer(missing)
    assert str(excinfo.value) == f"tokenizer directory {str(missing)!r} does not exist"


def test_fast_decode_equals_transformers_decode(byte_bpe, metaspace, tmp_path):
    """fast_decode over splitserve's Tokenizer gives transformers' text for every id sequence, special
    tokens kept or skipped; over another tokenizer it calls that tokenizer's own decode."""
    import random

    from splitserve.common.detokenizer import fast_decode

    rng = random.Random(0)
    for n, tok in enumerate((byte_bpe, metaspace)):
        tok.save_pretrained(tmp_path / str(n))
        ours = load_tokenizer(tmp_path / str(n))
        for skip in (True, False):
            decode_ids = fast_decode(ours, skip)
            for _ in range(50):
                ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
                assert decode_ids(ids) == decode(tok, ids, skip_special_tokens=skip)

    class Shouting(type(byte_bpe)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=byte_bpe.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    ids = byte_bpe.encode("the cat", add_special_tokens=False)
    assert fast_decode(shouting, True)(ids) == "THE CAT"
    detok = IncrementalDetokenizer(shouting)
    assert "".join(stream(detok, ids)[0]) == "THE CAT"
