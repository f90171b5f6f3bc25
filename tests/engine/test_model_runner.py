"""ModelRunner.prepare_inputs: the exact host-built inputs of a mixed prefill + decode step; launch's choice
between the sampler's greedy path and its full one."""

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.scheduling.output import ScheduledRequest, SchedulerOutput
from splitserve.engine.scheduling.request import Request
from splitserve.engine.worker.model_runner import ModelRunner, samples_plain_greedy, sampling_row
from splitserve.engine.worker.sampler import _is_plain_greedy


def request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    r = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=8), seed=0, max_tokens=8)
    r.token_ids.extend(output)
    return r


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_a_mixed_step_builds_exact_flat_inputs_and_zero_padded_block_tables(device):
    runner = ModelRunner(model=None, kv_cache=torch.zeros(1), block_size=4, device=torch.device(device))
    decoding = request("d", [5, 6, 7, 8, 9], output=[10])  # 6 tokens, 5 computed: one new token at position 5
    chunk = request("p", [1, 2, 3, 4, 5, 6, 7])  # a prompt chunk: tokens 2-4, not sampled yet
    out = SchedulerOutput([ScheduledRequest(decoding, 1, 5), ScheduledRequest(chunk, 3, 2)])
    inputs = runner.prepare_inputs(out, {"d": [7, 3], "p": [4, 9]})
    assert inputs.input_ids.tolist() == [10, 3, 4, 5]
    assert inputs.positions.tolist() == [5, 2, 3, 4]
    assert inputs.meta.slot_mapping.tolist() == [3 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0]
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 4] and inputs.meta.seq_lens.tolist() == [6, 5]
    assert inputs.meta.block_tables.dtype == torch.int32 and inputs.meta.block_tables.device.type == device
    assert inputs.meta.block_tables.tolist() == [[7, 3], [4, 9]]
    assert inputs.logits_indices.tolist() == [0] and inputs.sampling_request_ids == ["d"]
    # views of two joined copies, each at a 16-byte boundary as a tensor of its own would be (seq_lens follows
    # three int32 starts: 12 bytes without the padding)
    views = [inputs.input_ids, inputs.positions, inputs.meta.slot_mapping, inputs.logits_indices]
    views += [inputs.meta.query_start_loc, inputs.meta.seq_lens]
    assert [t.data_ptr() % 16 for t in views] == [0] * 6
    ragged = runner.prepare_inputs(
        SchedulerOutput([ScheduledRequest(decoding, 1, 5), ScheduledRequest(chunk, 3, 2)]),
        {"d": [7, 3], "p": [4, 9, 11, 12, 13]},
    )
    assert ragged.meta.block_tables.tolist() == [[7, 3, 0, 0, 0], [4, 9, 11, 12, 13]]


def test_block_table_rows_follow_each_request_s_growing_list_and_refill_after_preemption():
    from splitserve.engine.worker.model_runner import BlockTableRows

    tables = BlockTableRows(num_rows=2, num_cols=2)
    a, b = [5, 6], [7]
    tables.start_step()
    assert (tables.row_of("a", a), tables.row_of("b", b)) == (0, 1)
    a.extend([8, 9, 10])  # grows past the columns: the table widens, zeros beyond each request's blocks
    assert tables.row_of("a", a) == 0
    assert tables.table.tolist() == [[5, 6, 8, 9, 10, 0, 0, 0, 0, 0], [7] + [0] * 9]
    tables.start_step()
    again = [3]  # "a" preempted and allocated again: a new list refills its row
    assert tables.row_of("a", again) == 0 and tables.table[0].tolist() == [3] + [0] * 9
    assert tables.row_of("c", [4, 4]) == 1  # rows run out: "b", absent from this step, gives its row back
    assert tables.table[1].tolist()[:3] == [4, 4, 0]
    assert tables.row_of("d", [2]) == 2 and tables.table.shape[0] == 4  # no row to take back: more rows


def test_a_greedy_row_under_min_tokens_is_not_plain_until_its_position_reaches_it():
    """samples_plain_greedy decides without a SamplingRow what the sampler decides with one."""
    r = Request("m", [1, 2, 3], SamplingParams(temperature=0, min_tokens=2, max_tokens=8), seed=0, max_tokens=8)
    seen = []
    for output, pending in (([], 1), ([5], 1), ([5], 2), ([5, 6], 1)):  # output positions 0, 1, 2, 2
        r.token_ids[3:] = output
        r.num_pending_tokens = pending
        assert samples_plain_greedy(r) == _is_plain_greedy(sampling_row(r))
        seen.append((sampling_row(r).output_position, samples_plain_greedy(r)))
    assert seen == [(0, False), (1, False), (2, True), (2, True)]
    plain = Request("g", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8), seed=0, max_tokens=8)
    plain.num_pending_tokens = 1
    assert samples_plain_greedy(plain) and not samples_plain_greedy(
        Request("t", [1], SamplingParams(temperature=0.5, max_tokens=8), seed=0, max_tokens=8)
    )


class _FixedLogits(torch.nn.Module):
    """Every row's logits favour token 0 (the EOS below), then token 3."""

    def forward(self, input_ids, positions, kv_cache, meta):
        return torch.zeros(input_ids.shape[0], 4)

    def compute_logits(self, hidden):
        return torch.tensor([[5.0, 0.0, 1.0, 4.0]]).expand(hidden.shape[0], 4).clone()


def test_launch_takes_the_greedy_path_only_when_every_row_is_plain():
    """A batch of plain greedy rows takes argmax (EOS, token 0); a row still under min_tokens has EOS masked
    (token 3) and takes the rows next to it through the full sampler with it, where they get the same argmax."""
    runner = ModelRunner(model=_FixedLogits(), kv_cache=torch.zeros(1), block_size=4, device=torch.device("cpu"))

    def step(*params):
        requests = [Request(f"r{i}", [1, 2], p, seed=0, max_tokens=8, eos_token_ids=(0,)) for i, p in enumerate(params)]
        out = SchedulerOutput([ScheduledRequest(r, 2, 0) for r in requests])  # the prompts: each samples
        for r in requests:
            r.num_pending_tokens = 1  # as the scheduler leaves it: the first token on its way (output position 0)
        launched = runner.launch(out, {r.request_id: [1] for r in requests})
        return {request_id: token for request_id, (token, _) in launched.read().items()}

    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert step(greedy, greedy) == {"r0": 0, "r1": 0}
    assert step(greedy, SamplingParams(temperature=0, min_tokens=1, max_tokens=8)) == {"r0": 0, "r1": 3}
