"""Decode steps replayed as CUDA graphs, one per bucketed batch size.

A graph bakes in tensor addresses, so every decode input lives in a static buffer sized for
the largest bucket; a step of n sequences copies its inputs into the first n rows, marks
rows n..bucket-1 as padding (seq_len 0 → zero attention output, slot -1 → no KV write) and
replays the smallest bucket >= n. Prefill and mixed steps run eagerly.

    static rows:  [ seq 0 | seq 1 | ... | seq n-1 | pad ... pad ]   <- bucket B >= n
"""

from __future__ import annotations

import logging
import time

import torch

from splitserve.engine.worker.attention import AttentionMetadata

log = logging.getLogger("splitserve.graphs")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Captured decode graphs of one model over one KV cache."""

    def __init__(self, model, kv_cache: torch.Tensor, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        device = kv_cache.device
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.buckets = sorted(set(self.buckets))
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * self.kv_cache.shape[3],
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[1] * b,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            meta = self._meta(b)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (Triton autotune/compile) outside the capture
                    self.model(self.input_ids[:b], self.positions[:b], self.kv_cache, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self.model(self.input_ids[:b], self.positions[:b], self.kv_cache, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d decode graphs (batch %s) in %.1f s",
            len(self.graphs),
            self.buckets,
            time.perf_counter() - start,
        )

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Replay the graph for n = len(input_ids) one-token sequences; returns hidden (n, H)."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        width = block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if b > n:
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(0)
        self.graphs[b].replay()
        return self.outputs[b][:n]
