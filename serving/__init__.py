"""Ray Serve application: tensor-parallel target workers with a colocated drafter, behind an OpenAI-style API.

    serve run serving/configs/tiny.yaml

Modules: config (the application's args), app (FastAPI ingress + deployment + builder), scheduler (the replica's
continuous-batching loop), worker (TP worker actors), protocol (OpenAI wire format), metrics (Prometheus via Ray).
"""
