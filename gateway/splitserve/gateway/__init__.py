"""The gateway: the front door of splitserve.

It validates and tokenizes requests (gRPC `Generation` and an OpenAI-compatible REST shim),
routes each to a prefill instance and then to a decode instance with an equal KV layout (or
to a colocated worker), and streams detokenized text back with stop strings applied. It
relies only on the wire contract in `protos/`.

    config.py    GatewayConfig, UpConfig
    registry.py  instances, Describe health loop, discovery rounds, layout compatibility, readiness
    discovery.py pool entries (host:port, dns:///host:port) and the resolver that answers the names
    members.py   each pool's instances: joining, leaving (drained, then closed), rejoining
    decode_link.py  the one bidirectional Decode.Generate stream per decode instance
    router.py    prefill / decode choice (load, prefix affinity)
    service.py   the request path shared by gRPC and REST
    generation_input.py, tokenizing.py   what a front end hands it; prompts to ids and back
    request_run.py  one request's run (its seat, prefill call and messages: request_seat/_prefill/_messages.py)
    admission.py requests and callers' sequences in flight, rate buckets: per process or shared by all
    grpc_api.py  Generation servicer, grpc.health.v1, reflection
    rest.py      FastAPI shim (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, ...)
    rest_server.py  uvicorn inside the gateway's loop
    rest_tools.py, tool_parsers/   tool calling (tools, tool_choice, vLLM's --tool-call-parser formats)
    server.py    `splitserve gateway`
    processes.py `--api-server-count N`: a supervisor and N gateway processes sharing the ports
"""
