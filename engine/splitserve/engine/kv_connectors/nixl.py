"""The `nixl` transport: one-sided READs of the prefill's pool over NIXL (UCX: RDMA, TCP, shared memory, CUDA IPC),
so prefill and decode may sit on different hosts and the prefill does nothing per pull.

    prefill core (at start)                           decode core
    ───────────────────────                           ───────────
    agent "<instance>-<start>-<pid>", UCX backend     agent of its own; its pool registered (the READ's target)
    pool registered with it (DRAM or VRAM)
    endpoint: agent name, metadata (base64), pool     MapPeer / first pull: the metadata from the prefill's own
      address, memory kind, device, num_blocks  ──▶     Describe loaded (add_remote_agent), connection made
                                                      pull (lane worker): one descriptor per run of consecutive
                                                        blocks on both sides (block-major pools: a block is one
                                                        contiguous range), READ, polled until done or timeout_s

The lease rules are the other transports': the decode checks the copy through ReleaseKv's answer (no lease slot
table is shared across hosts), releases after commit, and a failed READ (the prefill gone: UCX reports the
disconnect) fails the pull and drops the remote agent, which the next pull loads again from the metadata.
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import threading
import time

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.common.nixl_package import NIXL_MODULES, nixl_missing
from splitserve.engine.kv_connectors.base import KvConnector, Moved, PullTarget
from splitserve.engine.kv_connectors.block_copies import block_runs
from splitserve.engine.worker.kv_cache import allocate_kv_cache

log = logging.getLogger("splitserve.kv")

POLL_S = 100e-6  # how often a READ in progress is checked (each check also drives the decode's UCX worker)
# NIXL's own progress thread polls without pause: ~0.5 of a core per idle agent on the 2-core CPU machine, and
# slower READs there (the cores it takes). A decode's agent needs none (its READs' polling drives it); a prefill's
# answers peers (connection set-up, TCP and shared-memory reads) from a thread of ours that drives it this often.
PROGRESS_S = 1e-3
ENDPOINT_KEYS = ("nixl_agent", "nixl_metadata", "nixl_pool_addr", "nixl_mem", "nixl_device", "num_blocks")


# UCX settings the connector needs unless the deployment sets them; UCX reads them when NIXL creates its context.
# UCX_MEM_EVENTS=no, set before UCX loads: UCX's memory hooks (registration-cache invalidation on every mmap/munmap)
# slowed the torch allocations of a CPU engine's steps: a 2,048-token hand-off took 143-155 ms with them, 22-28 ms
# without (docs/performance.md). Every pool NIXL moves is registered explicitly, once, for the process's life, so UCX
# needs no such tracking; cuda_ipc keys its cache of mapped peer pools by CUDA buffer id, not by these events.
UCX_ENV_DEFAULTS = {"UCX_MEM_EVENTS": "no"}
# For a VRAM pool, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: a pull is a READ (a UCP get). UCX turns cuda_ipc's get off unless
# it finds an active NVLink on GPU 0 (PCIe GPUs, a one-GPU machine or VM), and a VRAM READ between processes of one
# host then falls back to a software-emulated get over TCP or shared memory, staged through host memory in small
# pieces, each answered by the prefill's CPU (docs/kv-connector.md, "nixl on one host"). Newer NIXL releases enable
# this in their UCX plugin (1.5.1's does not); it changes nothing across hosts (cuda_ipc reaches only its own host's
# peers). Only for VRAM: UCX without its CUDA module warns of the variable as unused.
UCX_VRAM_ENV_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def apply_ucx_defaults(environ, vram: bool) -> dict[str, str]:
    """Set each of the defaults (UCX_VRAM_ENV_DEFAULTS too for a VRAM pool) that `environ` lacks; returns those it
    set (a deployment's own value wins)."""
    defaults = {**UCX_ENV_DEFAULTS, **(UCX_VRAM_ENV_DEFAULTS if vram else {})}
    applied = {key: value for key, value in defaults.items() if key not in environ}
    environ.update(applied)
    return applied


def load_nixl_api():
    """NIXL's `_api` module (nixl_agent, nixl_agent_config, ...): the meta package's, else a CUDA build's."""
    apply_ucx_defaults(os.environ, vram=False)  # before UCX loads
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ModuleNotFoundError as exc:
            if exc.name not in (name, f"{name}._api"):
                raise
            continue
        # NIXL logs to stdout through a handler of its own; its lines go through this process's logging instead
        # (JSON logs stay JSON), its per-agent INFO lines left out unless NIXL_LOG_LEVEL asks for them
        nixl_log = logging.getLogger("nixl")
        nixl_log.handlers.clear()
        nixl_log.propagate = True
        if not os.environ.get("NIXL_LOG_LEVEL"):
            nixl_log.setLevel(logging.WARNING)
        return api
    raise RuntimeError(nixl_missing())


def memory_kind(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id for a pool on `device`: ("VRAM", its CUDA index) or ("DRAM", 0). UCX finds
    the GPU from the address itself; NIXL keeps the id in the descriptors, so it must be the pool's own."""
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"a NIXL pool needs its CUDA device index (got {device}): pass the tensor's device")
        return "VRAM", device.index
    return "DRAM", 0


def read_descriptors(
    runs: list[tuple[int, int, int]], block_bytes: int, local: tuple[int, int], remote: tuple[int, int]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """A READ's descriptor lists (address, bytes, device id), one descriptor per run of consecutive blocks on both
    sides (block-major pools: a run is one contiguous range). `runs`: (src block, dst block, count) as block_runs
    gives them; `local`/`remote`: each pool's (base address, device id)."""
    (local_addr, local_dev), (remote_addr, remote_dev) = local, remote
    local_descs = [(local_addr + d * block_bytes, n * block_bytes, local_dev) for _, d, n in runs]
    remote_descs = [(remote_addr + s * block_bytes, n * block_bytes, remote_dev) for s, _, n in runs]
    return local_descs, remote_descs


def check_endpoint(prefill_instance: str, endpoint: dict) -> None:
    """Raise unless `endpoint` names a NIXL pool (an {"error": ...} endpoint: why the prefill could not say)."""
    if "error" in endpoint:
        raise RuntimeError(endpoint["error"])
    missing = [key for key in ENDPOINT_KEYS if key not in endpoint]
    if missing:
        raise ValueError(f"{prefill_instance} reports no NIXL pool (endpoint lacks {', '.join(missing)})")


class NixlConnector(KvConnector):
    """Cross-host pulls: the decode READs the prefill's registered pool with NIXL (the prefill only registers)."""

    transport = "nixl"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._api = load_nixl_api()
        self._agent = None
        self._registered = None  # the pool's registration list, deregistered at close
        self._pool_addr = 0
        self._mem = "DRAM"
        self._device_id = 0
        self._block_bytes = 0
        self._lock = threading.Lock()  # guards the remote-agent maps (core thread and lane workers)
        self._remotes: dict[str, str] = {}  # prefill instance -> the remote agent name loaded for it
        self._stopped = threading.Event()
        self._progress: threading.Thread | None = None

    def place_pool(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        kv_cache = allocate_kv_cache(layout, num_blocks, device)  # (N, L, 2, bs, Hkv, D), contiguous
        self._mem, self._device_id = memory_kind(kv_cache.device)
        apply_ucx_defaults(os.environ, vram=self._mem == "VRAM")  # before the agent creates its UCX context
        api = self._api
        name = f"{self.instance}-{self.start_epoch}-{os.getpid()}"
        # several threads use the agent (the core thread loads peers, lane workers read, the progress thread)
        config = api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self._agent = api.nixl_agent(name, config)
        self._pool_addr = kv_cache.data_ptr()
        self._block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        region = [(self._pool_addr, num_blocks * self._block_bytes, self._device_id, "")]
        self._registered = self._agent.register_memory(region, self._mem)
        if self.exports:
            self.endpoint = {
                "nixl_agent": name,
                "nixl_metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                "nixl_pool_addr": str(self._pool_addr),
                "nixl_mem": self._mem,
                "nixl_device": str(self._device_id),
                "num_blocks": str(num_blocks),
            }
            self._progress = threading.Thread(target=self._drive_progress, name="nixl-progress", daemon=True)
            self._progress.start()
        log.info("NIXL agent %s: %d blocks of %d bytes registered (%s)", name, num_blocks, self._block_bytes, self._mem)
        return kv_cache

    def _drive_progress(self) -> None:
        """The prefill's agent answers its peers: its UCX worker driven every PROGRESS_S until close."""
        warned = False
        while not self._stopped.wait(PROGRESS_S):
            try:
                self._agent.get_new_notifs()
            except Exception as exc:  # never fatal: a peer's fault shows in its own READ; said once, not per ms
                if not warned:
                    log.warning("driving the NIXL agent failed (said once): %s", exc)
                    warned = True

    # -- peers ------------------------------------------------------------------------------
    def map_source(self, prefill_instance: str, transport: str, endpoint: dict, layout: KvLayout) -> None:
        """At start (MapPeer): load the prefill's agent and connect, so its first pull pays neither."""
        if transport != self.transport:
            raise ValueError(f"a {transport} pool cannot be read by the {self.transport} transport")
        remote = self._remote(prefill_instance, endpoint)
        self._agent.make_connection(remote)
        return None

    def _remote(self, prefill_instance: str, endpoint: dict) -> str:
        """The remote agent of the prefill's pool, its metadata loaded on first use (a restarted prefill's new
        agent replaces its old one)."""
        check_endpoint(prefill_instance, endpoint)
        name = endpoint["nixl_agent"]
        with self._lock:
            known = self._remotes.get(prefill_instance)
            if known == name:
                return name
            if known is not None:
                self._drop_remote(known)
                log.info("%s's NIXL agent changed (restarted); dropped the old one", prefill_instance)
            loaded = self._agent.add_remote_agent(base64.b64decode(endpoint["nixl_metadata"]))
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                self._drop_remote(loaded)
                raise ValueError(f"{prefill_instance}'s NIXL metadata names agent {loaded!r}, not {name!r}")
            self._remotes[prefill_instance] = name
            return name

    def _forget(self, prefill_instance: str, name: str) -> None:
        """After a failed READ: drop the remote agent (its UCX endpoints may be broken); the next pull loads it
        again from the metadata."""
        with self._lock:
            if self._remotes.get(prefill_instance) == name:
                del self._remotes[prefill_instance]
                self._drop_remote(name)

    def _drop_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            log.warning("removing NIXL agent %s failed: %s", name, exc)

    # -- pulls (lane worker) ------------------------------------------------------------------
    def pull(self, spec, indices: list[int], dst_blocks: list[int], target: PullTarget) -> Moved:
        """READ the handle's blocks at `indices` into `dst_blocks`; returns when they are in place."""
        if not indices:
            return Moved(0)
        check_endpoint(spec.prefill_instance, spec.endpoint)
        src_ids = [spec.block_ids[i] for i in indices]
        num_remote = int(spec.endpoint["num_blocks"])
        if not 0 <= min(src_ids) <= max(src_ids) < num_remote:
            raise ValueError(f"block ids {min(src_ids)}..{max(src_ids)} outside the prefill's {num_remote} blocks")
        remote = self._remote(spec.prefill_instance, spec.endpoint)
        local, remote_descs = read_descriptors(
            block_runs(src_ids, dst_blocks),
            self._block_bytes,
            (self._pool_addr, self._device_id),
            (int(spec.endpoint["nixl_pool_addr"]), int(spec.endpoint["nixl_device"])),
        )
        with self._side_stream(target.kv_cache) as stream:
            if stream is not None:
                stream.synchronize()  # what earlier steps queued on these blocks is done before the READ lands
        start = time.perf_counter_ns()
        try:
            self._read(remote, local, remote_descs, spec.endpoint["nixl_mem"])
        except Exception as exc:
            self._forget(spec.prefill_instance, remote)
            raise RuntimeError(f"NIXL READ from {spec.prefill_instance} failed: {exc}") from exc
        log.debug(
            "kv timing nixl read: %d blocks in %d runs, %.3f ms",
            len(src_ids),
            len(local),
            (time.perf_counter_ns() - start) / 1e6,
        )
        return Moved(len(src_ids) * self._block_bytes)

    def _read(self, remote: str, local: list[tuple], remote_descs: list[tuple], remote_mem: str) -> None:
        """One READ, polled until done; past timeout_s it is cancelled (TimeoutError). Returns only once nothing
        more can land in the local blocks."""
        agent = self._agent
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, self._mem),
            agent.get_xfer_descs(remote_descs, remote_mem),
            remote,
        )
        deadline = time.monotonic() + self.timeout_s
        try:
            state = agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
        except BaseException:
            self._release(handle)
            raise
        self._release(handle)  # a READ still in progress is cancelled here, or waited for
        if state == "PROC":
            raise TimeoutError(f"the READ did not finish within the transfer timeout ({self.timeout_s:g} s)")
        if state != "DONE":
            raise RuntimeError(f"the READ ended in state {state}")

    def _release(self, handle) -> None:
        """Free a transfer handle; one NIXL cannot cancel yet is waited for (until it leaves PROC), so no byte
        lands after the pull returns (the lane's deadline reports it failed meanwhile)."""
        while True:
            try:
                self._agent.release_xfer_handle(handle)
                return
            except Exception as exc:
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception:
                    state = "ERR"
                if state != "PROC":
                    log.warning("releasing a NIXL transfer (state %s) failed: %s", state, exc)
                    return
                time.sleep(POLL_S * 10)

    def release_transport(self) -> None:
        if self._agent is None:
            return
        self._stopped.set()
        if self._progress is not None:
            self._progress.join()
        with self._lock:
            for name in self._remotes.values():
                self._drop_remote(name)
            self._remotes.clear()
        if self._registered is not None:
            try:
                self._agent.deregister_memory(self._registered)
            except Exception as exc:
                log.warning("deregistering the KV pool from NIXL failed: %s", exc)
            self._registered = None
        self._agent = None
