"""The splitserve v1 wire contract: `.proto` sources and their generated stubs.

Regenerate with `python -m splitserve.protos.generate` (grpcio-tools 1.84.0, the GPU image's
grpcio version, so the stubs import there as well as in the venv). A test fails when
the committed stubs differ from what the sources generate.
"""
