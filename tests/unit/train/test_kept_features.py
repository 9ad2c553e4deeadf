"""The data engine keeps the target's features (jobs.generate_data ``keep_taps``): the taps recorded from the
regenerating forwards equal what the trainer's own target forward computes over prompt + answer; a Regenerator writes
them into the disk feature cache a trainer opens, so its training runs no target forward and learns exactly as on
computed features; a drafter reading taps the data did not keep computes them; a mix links its parts' features; a
shard is written only after all of its features."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from train_testing import data_config, epoch_config, train_once

from eyas.config import ConfigError, to_dict
from eyas.models import load_target
from eyas.train.config import DataConfig, TrainConfig, data_path, target_path
from eyas.train.data import SequenceDataset, collate, regenerate, response_row, shard_path
from eyas.train.feature_cache import ARGMAX, FeatureCache, cache_base, row_file, sequence_key, stored_taps
from eyas.train.kept_features import TapRecorder


def recorded_and_computed(target_dir: Path, dtype: torch.dtype, prompts: list[list[int]], max_new: int,
                          eos: list[int]) -> tuple[list[dict], object, list[list[int]]]:
    """(the rows a TapRecorder kept while regenerating, the FeatureCache's features of the same sequences, answers)"""
    target = load_target(target_dir, dtype=dtype)
    taps = stored_taps(target, (0, 1, 2))
    P = max(map(len, prompts))
    recorder = TapRecorder(target, taps, len(prompts), P + max_new)
    answers = regenerate(target, prompts, max_new, eos_token_ids=eos, recorder=recorder)
    rows = recorder.rows([P - len(p) for p in prompts], [P + len(a) for a in answers])
    batch = collate([response_row(p, a) for p, a in zip(prompts, answers)], max_len=512)
    computed = FeatureCache(target, taps, "memory").features(batch)  # the trainer's own forward, right-padded
    return rows, computed, answers


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_features_kept_while_regenerating_equal_the_trainers_own_forward(random_checkpoint, dtype, tolerance):
    """Every position of prompt + answer, left-padded prompts of several lengths (a prefill of more rows than the
    fused decode kernel takes, so prefill and the trainer's forward run other kernels than decode), a row that
    stops at an EOS while the others go on, and rows that end at max_new_tokens (their last token fed once more)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (30, 7, 22, 1)]
    free = recorded_and_computed(random_checkpoint, dtype, prompts, 10, eos=[])[2]
    eos = [free[1][3]]  # row 1's 4th answer token: with it as EOS, row 1 stops early
    rows, computed, answers = recorded_and_computed(random_checkpoint, dtype, prompts, 10, eos)
    assert len(answers[1]) <= 4 < max(map(len, answers)) == 10
    for b, (prompt, answer) in enumerate(zip(prompts, answers)):
        length = len(prompt) + len(answer)
        assert set(rows[b]) == set(computed.taps) | {3, ARGMAX}
        for tap, kept_TE in rows[b].items():
            if tap == ARGMAX:
                continue
            assert kept_TE.dtype == dtype and kept_TE.shape[0] == length
            want_TE = computed.taps[tap][b, :length] if tap != 3 else None
            if want_TE is not None:
                error = (kept_TE.float() - want_TE).norm() / want_TE.norm()
                assert error <= tolerance, (b, tap, float(error))
        agree = (rows[b][ARGMAX] == computed.argmax_BT[b, :length]).float().mean()
        assert agree == 1.0 if dtype == torch.float32 else agree >= 0.9


# ---------------------------------------------------------------- jobs.generate_data's Regenerator -> the trainer


def kept_config(**changes) -> DataConfig:
    return data_config({"name": "kept", "target": "target-rand", "source": "regenerate", "num_prompts": 8,
                        "num_heldout_prompts": 2, "max_prompt_tokens": 24, "max_new_tokens": 12, "batch_size": 3,
                        "shard_size": 8, "keep_taps": "[1, 2]"}, **changes)


def regenerate_data(cfg: DataConfig, kept: bool = True) -> tuple[Path, dict]:
    """Both splits, one shard each, answered by a Regenerator in this process (the class the Ray actors run)."""
    from jobs.data_actors import Regenerator, plan_kept_features, plan_prompts

    out, target_dir = data_path(cfg.name), home_target()
    plan = plan_kept_features(cfg, out, target_dir) if kept else None
    regenerator = Regenerator(to_dict(cfg), str(target_dir), False, plan)
    prompts = plan_prompts(cfg, target_dir)
    result = regenerator.run("train", 0, prompts["train"], str(out))
    regenerator.run("heldout", 0, prompts["heldout"], str(out))
    return out, result


def home_target() -> Path:
    return target_path("target-rand")


def train_config(drafter: dict) -> TrainConfig:
    return epoch_config(drafter, "kept-train", "target-rand", "kept", max_len=64)


def train_kept(cfg: TrainConfig, data_dir: Path) -> tuple[list[float], int]:
    return train_once(cfg, str(home_target()), data_dir)


def test_a_trainer_reads_the_kept_features_and_runs_no_target_forward(home):
    out, result = regenerate_data(kept_config())
    rows = SequenceDataset(out, "train").rows
    assert result["kept_rows"] == result["rows"] == 8
    assert result["positions"] == sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    # the job names the cache by an unfused float32 load of the target (seconds faster), the trainer by a fused one
    assert cache_base(load_target(home_target(), fuse=False)) == cache_base(load_target(home_target()))
    caches = [m.parent for m in (out / "features").glob("*/cache.json")]
    assert len(caches) == 1 and json.loads((caches[0] / "cache.json").read_text())["taps"] == [1, 2, 3]
    for row in rows + SequenceDataset(out, "heldout").rows:
        assert row_file(caches[0], sequence_key(torch.tensor(row["prompt_ids"] + row["response_ids"]))).is_file()

    plain = data_path("plain")  # the same rows, no kept features: the trainer computes them
    shutil.copytree(out, plain, ignore=shutil.ignore_patterns("features"))
    eagle3 = train_config({"type": "eagle3", "config": {"taps": [1, 1, 2], "ttt_steps": 2, "draft_vocab_size": 64}})
    computed_losses, computed_forwards = train_kept(eagle3, plain)
    assert computed_forwards == 2 + 1  # two train batches of 4, one held-out batch of 2
    kept_losses, kept_forwards = train_kept(eagle3, out)
    assert kept_forwards == 0
    assert kept_losses == pytest.approx(computed_losses, abs=1e-5)

    eagle1 = train_config({"type": "eagle1", "config": {}})  # reads the final state only, which is kept too
    assert train_kept(eagle1, out)[1] == 0
    # taps the data did not keep (the embeddings, 0) fall back to computing them, as if nothing had been kept
    wider = train_config({"type": "eagle3", "config": {"taps": [0, 1, 2], "ttt_steps": 2, "draft_vocab_size": 64}})
    wider_losses, wider_forwards = train_kept(wider, out)
    assert wider_forwards == 3
    assert wider_losses == pytest.approx(train_kept(wider, plain)[0], abs=1e-6)


def test_a_shard_is_written_after_all_of_its_features(home, monkeypatch):
    """An actor that dies while it keeps a shard's features leaves no shard (a rerun builds it again, features
    and all) and no feature file cut short (each is renamed into place whole)."""
    import jobs.data_actors as job

    written = []

    def dying_write(directory, sequences, rows, tag):
        if written:
            raise KeyboardInterrupt("killed")  # as a process killed after its first batch's features
        written.append(len(rows))
        real_write(directory, sequences, rows, tag)

    real_write = job.write_kept
    monkeypatch.setattr(job, "write_kept", dying_write)
    with pytest.raises(KeyboardInterrupt):
        regenerate_data(kept_config())
    out = data_path("kept")
    assert not shard_path(out, "train", 0).exists()
    files = list((out / "features").glob("*/*.safetensors"))
    assert len(files) == written[0] == 3  # the first batch's rows, whole
    from safetensors.torch import load_file

    assert all(load_file(str(f))[ARGMAX].ndim == 1 for f in files)
    assert not list((out / "features").glob("*/.*.tmp"))


def test_shards_built_before_keep_taps_are_reported_and_their_features_left_to_training(home, capsys):
    from jobs.data_actors import plan_kept_features, report_unkept

    out, _ = regenerate_data(kept_config(), kept=False)
    cfg = kept_config()
    kept = plan_kept_features(cfg, out, home_target())
    report_unkept(out, kept, todo=[("heldout", 0)])  # the held-out shard is about to be built again
    assert "8 of the 8 sequences already on disk have no kept features" in capsys.readouterr().out
    regenerate_data(cfg)
    report_unkept(out, kept, todo=[])
    assert "no kept features" not in capsys.readouterr().out


def test_a_mix_links_its_parts_kept_features(home):
    from jobs.generate_data import link_features

    out, _ = regenerate_data(kept_config())
    mix_features = home / "data" / "mix" / "features"
    link_features(out / "features", mix_features)
    part_files = sorted(p.relative_to(out / "features") for p in (out / "features").rglob("*") if p.is_file())
    assert sorted(p.relative_to(mix_features) for p in mix_features.rglob("*") if p.is_file()) == part_files
    assert all((mix_features / f).samefile(out / "features" / f) for f in part_files)  # hard links, no copies


def test_keep_taps_is_checked(home):
    from jobs.generate_data import check_target

    with pytest.raises(ConfigError, match="keep_taps.*only a source the target answers"):
        kept_config(source="corpus")
    with pytest.raises(ConfigError, match="keep_taps.*distinct layer numbers"):
        kept_config(keep_taps="[1, 1]")
    with pytest.raises(ConfigError, match=r"keep_taps=\[1, 4\]: the target has 3 layers"):
        check_target(kept_config(keep_taps="[1, 4]"))
