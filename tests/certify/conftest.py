"""Fixtures shared by the certifier tests."""

from __future__ import annotations

import pytest

from ..helpers.tiny import make_model, make_tokenizer, noisy_copy


@pytest.fixture(scope="module")  # per module: each saves its own copy
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-models")
    tok = make_tokenizer()
    target = make_model(0)
    target.save_pretrained(d / "target")
    tok.save_pretrained(d / "target")
    draft = noisy_copy(target, 1.0)
    draft.save_pretrained(d / "draft")
    tok.save_pretrained(d / "draft")
    with pytest.MonkeyPatch.context() as mp:  # callable_sampler finds the target here; restored after the module
        mp.setenv("VERISPEC_TEST_TARGET", str(d / "target"))
        yield str(d / "target"), str(d / "draft")
