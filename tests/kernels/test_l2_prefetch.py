"""kernels.l2_prefetch: the "ld" mode reads exactly the bytes asked for (each program's sink word is the int32
sum of its chunk's words), the wrapper's checks, and on a GPU both modes inside a captured CUDA graph."""

import pytest
import torch

from splitserve.kernels.l2_prefetch import CHUNK, LANES, l2_prefetch

PROGRAM_BYTES = CHUNK * LANES


def expected_sums(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Each program's int32 (wrapping) sum of the words of its bytes, bytes past nbytes counted as 0."""
    data = t.view(-1).view(torch.uint8)[:nbytes].cpu()
    programs = -(-nbytes // PROGRAM_BYTES)
    padded = torch.zeros(programs * PROGRAM_BYTES, dtype=torch.uint8)
    padded[:nbytes] = data
    words = padded.view(torch.int32).to(torch.int64).view(programs, -1)
    sums = words.sum(dim=1) % (1 << 32)
    return torch.where(sums >= 1 << 31, sums - (1 << 32), sums).to(torch.int32)


@pytest.mark.parametrize("nbytes", [None, PROGRAM_BYTES + 4096 + 48, 16, 40])
def test_ld_mode_reads_the_bytes_asked_for(device, nbytes):
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 256, (2 * PROGRAM_BYTES + 1000,), dtype=torch.uint8, generator=g).to(device)
    want_bytes = (t.numel() if nbytes is None else nbytes) // 16 * 16  # 40 -> 32: whole 16-byte units
    programs = -(-want_bytes // PROGRAM_BYTES)
    sink = torch.full((programs + 1,), 7, dtype=torch.int32, device=device)
    l2_prefetch(t, nbytes, mode="ld", sink=sink)
    assert torch.equal(sink[:programs].cpu(), expected_sums(t, want_bytes))
    assert sink[programs].item() == 7, "a program past the bytes asked for ran"


def test_checks_name_the_problem(device):
    t = torch.zeros(64, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="mode 'fetch' is not one of"):
        l2_prefetch(t, mode="fetch")
    with pytest.raises(ValueError, match="t must be contiguous"):
        l2_prefetch(torch.zeros(8, 8, device=device).t(), mode="ld", sink=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="mode 'ld' needs an int32 sink of at least 1 entries"):
        l2_prefetch(t, mode="ld", sink=None)
    if device == "cpu":
        with pytest.raises(ValueError, match="mode 'bulk' needs a CUDA tensor, got device cpu"):
            l2_prefetch(t)
    sink = torch.full((1,), 5, dtype=torch.int32, device=device)
    l2_prefetch(t, 15, mode="ld", sink=sink)  # under 16 bytes: nothing to ask for
    assert sink.item() == 5


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="sm_90 GPU")
def test_bulk_and_ld_in_a_cuda_graph():
    w = torch.randint(-100, 100, (4096, 4096), dtype=torch.int8, device="cuda").view(torch.float8_e4m3fn)
    sink = torch.zeros(-(-w.numel() // PROGRAM_BYTES), dtype=torch.int32, device="cuda")
    for mode in ("bulk", "ld"):
        l2_prefetch(w, mode=mode, sink=sink)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch(w, mode="bulk")
        l2_prefetch(w, 1 << 20, mode="ld", sink=sink)
    sink.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(sink[:2].cpu(), expected_sums(w, 1 << 20))
