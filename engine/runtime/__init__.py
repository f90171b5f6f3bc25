"""The service runtime: gRPC server, service base, metrics, tracing, logs, service config."""
