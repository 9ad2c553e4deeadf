"""Ray jobs: ``python -m jobs.NAME --config jobs/configs/X.yaml [section.key=value ...]``.

The same command runs under ``ray job submit --working-dir . -- python -m jobs.NAME ...``. Jobs stay thin: the
algorithms live in ``platform/eyas`` (which never imports Ray); a job wires them to Ray Train / Data / actors.
"""
