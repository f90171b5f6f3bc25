"""The embedded default model (engine/common/default_model, splitserve.common.default_model_path): loads,
tokenizes exactly, has learned
its corpus, and splitserve's engine reproduces transformers' greedy output on it.

Expected numbers were recorded from the committed weights in float32 on CPU
(docs/default-model.md says how the model was trained).
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve.common.default_model_path import default_model_path

DATA = Path(__file__).parent.parent / "data"
PROMPT = "def fibonacci(n):"
PROMPT_IDS = [555, 886, 69, 273, 733, 661, 11, 81, 296]
# transformers greedy, 24 tokens, float32 CPU; the smallest top-1/top-2 logit margin
# along the way is 0.094, far above float32 noise.
# fmt: off
FIB_IDS = [
    265, 279, 17, 351, 11, 270, 17, 440, 376, 1843, 17, 390,
    11, 270, 17, 440, 376, 1843, 361, 998, 1076, 68, 317, 284,
]
# fmt: on
FIB_TEXT = "\n        self.assertEqual(self.fixtures.get(self.fixtures),\n                         ['a', '"
NUM_EVAL_TOKENS = 4096
MODEL_PPL = 9.6074  # model perplexity on the first NUM_EVAL_TOKENS of heldout.txt


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


def test_directory_is_a_small_llama_with_gqa_and_tied_embeddings(model):
    files = {p.name: p.stat().st_size for p in default_model_path().iterdir()}
    assert sorted(files) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sum(files.values()) <= 16_000_000
    cfg = model.config
    assert (cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads) == ("llama", 8, 2)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (256, 8, 8192)
    assert cfg.max_position_embeddings == 1024 and cfg.tie_word_embeddings
    assert model.generation_config.eos_token_id == 0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 7_344_384
    with safe_open(default_model_path() / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_tokenizer_round_trips_and_has_the_chat_template(tokenizer):
    text = (DATA / "heldout.txt").read_text()
    source = 'def f(x):\n    """Ünïcødé — 日本語 🐍"""\n\treturn x  # tab\r\n'
    for s in (text, source):
        assert tokenizer.decode(tokenizer.encode(s)) == s
    assert tokenizer.encode(PROMPT) == PROMPT_IDS
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]) == [0, 1, 2, 3]
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nhi<|endoftext|>\n<|assistant|>\n"


def unigram_perplexity(targets: torch.Tensor) -> float:
    """Add-one-smoothed unigram model fitted on the *training* token stream (not the held-out)."""
    counts = torch.tensor(json.loads((DATA / "unigram_counts.json").read_text())["counts"], dtype=torch.float64)  # (V,)
    log_p = ((counts + 1) / (counts.sum() + counts.numel())).log()  # (V,)
    return math.exp(-log_p[targets].mean().item())


def test_heldout_perplexity_is_far_below_unigram(tokenizer, model):
    ids = torch.tensor(tokenizer.encode((DATA / "heldout.txt").read_text())[: NUM_EVAL_TOKENS + 1])
    nll = 0.0
    with torch.no_grad():
        for start in range(0, NUM_EVAL_TOKENS, 1024):  # independent 1024-token contexts
            window = ids[start : start + 1025]  # (1025,)
            logits = model(window[None, :-1]).logits[0]  # (1024, V)
            nll += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
    model_ppl = math.exp(nll / NUM_EVAL_TOKENS)
    unigram_ppl = unigram_perplexity(ids[1:])
    assert model_ppl == pytest.approx(MODEL_PPL, rel=1e-4)
    assert unigram_ppl == pytest.approx(1156.42, rel=1e-5)
    assert model_ppl < 0.05 * unigram_ppl


def test_greedy_completion_reads_like_python(tokenizer, model):
    ids = torch.tensor([PROMPT_IDS])
    out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, len(PROMPT_IDS) :]
    assert out.tolist() == FIB_IDS
    assert tokenizer.decode(out) == FIB_TEXT


ENGINE_PROMPTS = [
    PROMPT,
    "import os\n\n\ndef ",
    "<|user|>\nWhat does `json.dumps` do?<|endoftext|>\n<|assistant|>\n",
    'class Stack:\n    """A last-in, first-out list."""\n\n    def push(self, item):\n',
]


def test_engine_greedy_equals_transformers(tokenizer, model):
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(model=str(default_model_path()), dtype="float32", device="cpu")
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert (outs[0].token_ids, outs[0].text) == (FIB_IDS, FIB_TEXT)
    for prompt, out in zip(ENGINE_PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :]
        assert out.prompt_token_ids == ids
        assert out.token_ids == want.tolist(), prompt
