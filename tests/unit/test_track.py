"""eyas.track: experiments open as model-training experiments in the MLflow UI (not under its GenAI views)."""
from __future__ import annotations

from eyas import track


def test_experiments_are_model_training_experiments(mlflow_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    experiment_id = track.ensure_experiment("eyas-drafters")
    experiment = track.client().get_experiment(experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert track.ensure_experiment("eyas-drafters") == experiment_id


def test_an_untagged_experiment_gets_its_kind(mlflow_uri):
    client = track.client()
    experiment_id = client.create_experiment("made-by-hand")
    assert "mlflow.experimentKind" not in client.get_experiment(experiment_id).tags
    assert track.ensure_experiment("made-by-hand") == experiment_id
    assert client.get_experiment(experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
