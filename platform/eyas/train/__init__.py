"""Drafter training without Ray: data regeneration, datasets, target features, losses, one training step."""
