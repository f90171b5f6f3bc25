"""The decode role (and the colocated worker): imports KV, runs the batch, streams tokens."""
