"""Ray Serve application: tensor-parallel target workers with a colocated drafter, behind an OpenAI-style API.

    serve run serving/configs/tiny.yaml

Modules: config (the application's args), app (FastAPI ingress + deployment + builder), scheduler (the replica's
continuous-batching loop), worker (TP worker actors), protocol (OpenAI wire format), metrics (Prometheus via Ray).
"""
from eyas.threads import set_openmp_env

# OpenMP reads its wait policy once, when torch loads it: set it before any module of this package imports torch
set_openmp_env()
