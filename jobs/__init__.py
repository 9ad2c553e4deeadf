"""Ray jobs: ``python -m jobs.NAME --config jobs/configs/X.yaml [section.key=value ...]``.

The same command runs under ``ray job submit --working-dir . -- python -m jobs.NAME ...``. Jobs stay thin: the
algorithms live in ``platform/eyas`` (which never imports Ray); a job wires them to Ray Train / Data / actors.
"""
from eyas.threads import set_openmp_env

# OpenMP reads its wait policy once, when torch loads it: set it before any module of this package imports torch
set_openmp_env()
