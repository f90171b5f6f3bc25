"""Loaded at start-up by the service processes a test starts with faults (tests/service_harness.py
`fault_env`): this folder is first on their PYTHONPATH, so Python imports this module before any
other, in the service and in its spawned engine core alike. splitserve never imports it."""

import os

if os.environ.get("SPLITSERVE_TEST_FAULTS"):
    from tests.fault_injection import install

    install(os.environ["SPLITSERVE_TEST_FAULTS"])
