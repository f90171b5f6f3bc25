"""Loaded at start-up by the service processes a test starts with faults (tests/service_harness.py
`fault_env`): this folder is first on their PYTHONPATH, so Python imports this module before any
other, in the service and in its spawned engine core alike. splitserve never imports it. The fault
module is loaded from its file, so nothing else of the checkout goes on the children's path."""

import os

if os.environ.get("SPLITSERVE_TEST_FAULTS"):
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fault_injection.py")
    spec = importlib.util.spec_from_file_location("splitserve_test_faults", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.install(os.environ["SPLITSERVE_TEST_FAULTS"])
