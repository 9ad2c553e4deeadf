"""The peer engines (vLLM, llama.cpp) run from their own tool environments, for the jobs that measure eyas drafters
on them side by side (jobs.load --endpoint, jobs.peers.parity).

One module per engine, each with the same shape: ``<engine>_python()`` or the binary it needs (a clear error naming
the make target that builds it), the environment it runs in, and a context manager ``<engine>_server(...)`` that
starts the engine's OpenAI-compatible server, waits for its /health with progress output, yields the base URL
(``http://127.0.0.1:PORT``, the OpenAI API under ``/v1``) and always kills it.

``cli`` holds what the peer benches (jobs.bench_peers, jobs.load_peers) share around their measurements: the
--out/--report/--from/--lock flags and the ``main`` that measures or re-renders, their lists, the CPU lock.
"""
