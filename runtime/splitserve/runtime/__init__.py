"""The service runtime, torch-free: gRPC server, metrics, tracing, logs (the gateway uses it too)."""
