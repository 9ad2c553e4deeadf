"""Ray Tune sweeps over speculative-decoding settings: ``python -m tune.sweep --config tune/configs/X.yaml``.

  config.py    SweepConfig (the YAML schema), the search space, and every check that runs before a trial starts
  measure.py   Ray-free measurement: interleaved vanilla / speculative timing and a trial-sized training loop
  trials.py    the Tune trial functions (inference and training) that call measure.py
  report.py    MLflow parent / child runs, the curve figure, results table and the best-config YAML
  sweep.py     the CLI: validate, start Ray, build the Tuner, run it, report
"""
from eyas.threads import set_openmp_env

# OpenMP reads its wait policy once, when torch loads it: set it before any module of this package imports torch
set_openmp_env()
