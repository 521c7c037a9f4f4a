"""`train_eagle3` tells its progress through a callback (train-draft renders it): the target's features while they
are cached, then every step with its record, the tokens it read (one epoch reads every sequence once) and the
epoch. A tiny 8-layer target."""

from __future__ import annotations

import torch

from verispec.model.loading import LoadedModel
from verispec.training.heads import TrainConfig, _batches, train_eagle3

from ..helpers.tiny import make_model, make_tokenizer


def test_features_then_steps_with_tokens_and_epoch(tmp_path):
    target = LoadedModel(make_model(0, layers=8), make_tokenizer(), "tiny-8l")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 32, (n,), generator=gen).tolist() for n in (9, 12, 7, 15, 10, 8)]
    data = {"seqs": seqs, "starts": [3] * len(seqs)}
    cfg = TrainConfig(draft_vocab=16, ttt=2, batch_tokens=32, cache_features=True, seed=0)
    steps = len(_batches(seqs, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed)))  # one epoch
    cfg.max_steps = steps
    told = []
    train_eagle3(target, data, tmp_path, cfg, progress=lambda step, info: told.append((step, info)))
    features = [info for _, info in told if info.get("phase") == "features"]
    assert features and features[-1]["done"] == features[-1]["total"] == len(seqs)
    assert told[: len(features)] == [(0, f) for f in features]  # before any step
    trained = told[len(features) :]
    assert [step for step, _ in trained] == list(range(1, steps + 1))
    assert sum(info["tokens"] for _, info in trained) == sum(map(len, seqs))  # every sequence read once
    assert trained[-1][1]["epoch"] == 1.0 and all(0 < info["epoch"] <= 1 for _, info in trained)
    assert all({"loss", "top1", "seconds"} <= info.keys() for _, info in trained)
