"""The engine core process: its loop, the messages between a service and its core, the client a service holds,
and the core's scheduler side of KV transfer (turning connector events into messages)."""
