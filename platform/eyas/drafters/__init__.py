"""Drafters: one module per family, and a registry from drafter type to builder (method names: eyas.methods).

Every trainable family module (eagle.py, dflash.py, medusa.py) provides:
  - ``<Family>Config``: a frozen dataclass of the family's hyper-parameters (validated in __post_init__);
  - ``<Family>Model(nn.Module)``: built from (config, target ModelConfig, frozen target embedding / LM head);
    ``training_loss(batch: TrainBatch, features: TargetFeatures) -> (loss, metrics)`` where metrics has
    ``acc_1..acc_K`` (per-position top-1 acceptance on the batch) and the family's loss terms;
  - a Drafter (see base.py) that wraps a trained model for the speculative loop with its tree shapes.
Checkpoints are directories: config.json (drafter type, target reference, tap layers, draft vocabulary map, the
family config) + model.safetensors, loaded by ``registry.load_model`` (a model) or ``eyas.methods.load_drafter``
(a ready drafter) without Ray or MLflow.
"""
