"""Tensor parallelism: which slice of each weight a rank holds, and the collectives between ranks.

N ranks (`--tensor-parallel-size N`), one process each; rank r holds:

    q heads       [r Hq/N, (r+1) Hq/N)                          column-parallel rows of qkv_proj
    kv heads      Hkv >= N: [r Hkv/N, (r+1) Hkv/N)               (sharded)
                  Hkv <  N: the one head r // (N/Hkv)            (replicated on N/Hkv ranks, as vLLM)
    o_proj        the columns of its q heads                     row-parallel: all-reduce after
    gate|up       rows [r F/N, (r+1) F/N) of each                column-parallel
    down_proj     the columns of those rows                      row-parallel: all-reduce after
    experts       every expert, its rows / columns as gate|up and down; the router whole (models/moe.py)
    vocab         rows [r ceil(V/N), ...) of the embedding and the LM head, the last rank's padded
                  with zero rows; the embedding sums over ranks, the logits are gathered

so each layer costs two all-reduces of the (T, H) hidden states, and the logits one all-gather.
A rank's KV cache holds only its kv heads (`KvLayout.num_kv_heads` is the per-rank count).

`TpGroup` joins a rank to its instance: the process groups are built directly on a TCPStore on
loopback (rank 0 hosts it), never `init_process_group`'s one global world, so several instances
and the KV connectors' pair groups live in one process. Model collectives run on the device's
backend (NCCL on CUDA, gloo on CPU); step messages from rank 0 go over a gloo group always.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from dataclasses import dataclass

import torch

# Collectives wait this long for a peer: a dead peer fails a collective at once (its sockets close);
# this bounds only a live peer that stopped answering.
GROUP_TIMEOUT_S = 600.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or exited: the instance cannot step any more."""


@dataclass(frozen=True)
class TpShard:
    """The piece of a checkpoint tensor a rank reads: `size` entries from `start` along `dim`."""

    dim: int
    start: int
    size: int


def check_shardable(
    num_heads: int, num_kv_heads: int, intermediate_size: int, size: int, expert_intermediate_size: int = 0
) -> None:
    """ValueError naming the model field and the size when `size` ranks cannot split the model
    (`expert_intermediate_size`: a mixture of experts' rows per expert, split as the MLP's)."""
    if size == 1:
        return
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide num_attention_heads {num_heads}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and num_key_value_heads {num_kv_heads}: one must divide the other"
        )
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide intermediate_size {intermediate_size}")
    if expert_intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the experts' intermediate size {expert_intermediate_size}"
        )


def kv_heads_of_rank(num_kv_heads: int, size: int, rank: int) -> range:
    """The KV heads rank `rank` of `size` holds (see the module docstring)."""
    if num_kv_heads >= size:
        per_rank = num_kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (size // num_kv_heads)
    return range(head, head + 1)


def vocab_rows(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """(first row, rows filled from the checkpoint, rows held incl. padding) of a rank's vocabulary shard."""
    per_rank = -(-vocab_size // size)
    start = rank * per_rank
    return start, max(0, min(per_rank, vocab_size - start)), per_rank


class TpGroup:
    """One rank's membership in a tensor-parallel instance: rank, size, its process groups.

    `device_group` carries the model's collectives (NCCL on CUDA, gloo on CPU); `control_group` (gloo)
    carries rank 0's step messages. Every rank must call the collectives in the same order.
    """

    def __init__(self, rank: int, size: int, port: int, device: torch.device, listener=None) -> None:
        import torch.distributed as dist
        from torch._C._distributed_c10d import ProcessGroupGloo

        self.rank, self.size, self.device = rank, size, device
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        self._store = dist.TCPStore(
            "127.0.0.1",
            port,
            size,
            is_master=rank == 0,
            timeout=timeout,
            master_listen_fd=listener.fileno() if listener is not None else None,
        )
        self._listener = listener  # the store serves on this socket: keep it open
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.control_group = ProcessGroupGloo(dist.PrefixStore("control", self._store), rank, size, opts)
        if device.type == "cuda":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            torch.cuda.set_device(device)
            store = dist.PrefixStore("device", self._store)
            self.device_group = ProcessGroupNCCL(store, rank, size, ProcessGroupNCCL.Options())
        else:
            self.device_group = ProcessGroupGloo(dist.PrefixStore("device", self._store), rank, size, opts)

    @staticmethod
    def listen() -> tuple[socket.socket, int]:
        """Rank 0's store socket on a free loopback port (bound before the other ranks start: no race)."""
        listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        return listener, listener.getsockname()[1]

    # -- the model's collectives ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns it."""
        self.device_group.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of `x` over ranks, in place; returns it (fp8 row scales of split rows, at load)."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.device_group.allreduce([x], opts).wait()
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) on each rank -> (N, size * C), rank r's columns at [r C, (r+1) C)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks each rank's memory allows)."""
        t = torch.tensor([value], dtype=torch.int64)
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control_group.allreduce([t], opts).wait()
        return int(t.item())

    # -- step messages: rank 0 sends, the others receive -----------------------------------------
    def send_object(self, obj) -> None:
        """Rank 0: broadcast a picklable object to every other rank (length first, then the bytes)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self.control_group.broadcast([torch.tensor([payload.numel()], dtype=torch.int64)], _root(0)).wait()
        self.control_group.broadcast([payload], _root(0)).wait()

    def recv_object(self):
        """Ranks > 0: the next object rank 0 sent."""
        length = torch.zeros(1, dtype=torch.int64)
        self.control_group.broadcast([length], _root(0)).wait()
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.control_group.broadcast([payload], _root(0)).wait()
        return pickle.loads(payload.numpy().tobytes())


def _root(rank: int):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    return opts
