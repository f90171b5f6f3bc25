"""What the prefill, decode and worker services share: an engine core process behind a gRPC service, and its config."""
