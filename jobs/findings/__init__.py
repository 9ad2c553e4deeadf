"""The papers' findings as jobs: one command checks a claim on your own target and writes one MLflow run with its
figures, a table and a verdict computed from the measured numbers (jobs/findings/common.py states the rule).

    python -m jobs.findings --finding NAME [--scale micro|default|large] [--target T] [key=value ...]
    ray job submit --working-dir . -- python -m jobs.findings --finding tree-vs-chain

One module per finding (calibration, position_context, data_scaling, tree_chain, hardware_nstar, dflash_eagle3,
peagle_cost, dspark_dflash, eagle31_eagle3);
common.py (settings, verdicts, the run), measure.py (prompts, drafters, interleaved generation, the cost curve),
training.py (drafter variants through the one trainer, locally or on Ray Train) and families.py (families trained
alike, measured per suite) are shared.
"""
