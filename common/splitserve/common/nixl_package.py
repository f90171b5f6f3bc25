"""Whether the optional NIXL package is installed, asked without importing it (no torch, no UCX loaded): the
services and `splitserve up` refuse `--kv-transport nixl` without it, naming the extra that installs it."""

from __future__ import annotations

import importlib.util

# The `nixl` meta package picks its CUDA build at import; the builds install under their own names (the engine's
# extra installs nixl-cu12, which also runs CPU-only).
NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")
NIXL_EXTRA = "splitserve-engine[nixl]"


def nixl_module() -> str | None:
    """The first of NIXL_MODULES installed, or None."""
    for name in NIXL_MODULES:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def nixl_missing(flag: str = "--kv-transport nixl") -> str | None:
    """Why `flag` cannot be used here (the package is not installed), or None when it can."""
    if nixl_module() is not None:
        return None
    return (
        f"{flag} needs the NIXL package, which is not installed: install the extra "
        f"(pip install '{NIXL_EXTRA}', or scripts/install.sh VENV --dev from the lock)"
    )
