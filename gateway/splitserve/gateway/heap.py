"""The gateway's heap handed back to the system after work that used a lot of it for a moment."""

from __future__ import annotations

import ctypes


def trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc's malloc_trim: every arena, the tokenizer's worker threads'
    too); glibc keeps them otherwise, and the gateway's resident memory would stay at its peak after one large
    answer or text. ctypes drops the GIL for the call: run on a worker thread, it holds back no one."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim
