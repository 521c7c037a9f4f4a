"""The model id the server reports and accepts: a plain id derived from a name, path or display string."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.loading import DEFAULT_MODEL_NAME
from verispec.serve import create_app
from verispec.serve.app import served_model_id


@pytest.mark.parametrize(
    "name,expected",
    [
        ("SmolLM2-135M-Instruct (Q4_1 GGUF)", "SmolLM2-135M-Instruct"),
        ("/nowhere/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-1.5b-instruct-q4_k_m"),
        ("models/qwen2.5-0.5b.Q4_K_M.GGUF", "qwen2.5-0.5b.Q4_K_M"),
        ("~/models/Qwen2.5-0.5B-Instruct/", "Qwen2.5-0.5B-Instruct"),  # a folder keeps its dots
        ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),  # a hub id stays
        ("my model", "my-model"),
        ("tiny", "tiny"),
        ("(only a remark)", "model"),
    ],
)
def test_plain_ids(name, expected):
    assert served_model_id(name) == expected


def test_the_default_model_and_local_folders(tmp_path):
    assert served_model_id(DEFAULT_MODEL_NAME) == "SmolLM2-135M-Instruct"
    folder = tmp_path / "org" / "Qwen2.5-0.5B"
    folder.mkdir(parents=True)
    assert served_model_id(str(folder)) == "Qwen2.5-0.5B"
    assert served_model_id(str(folder.parent.parent / "org" / "Qwen2.5-0.5B") + "/") == "Qwen2.5-0.5B"


def test_the_server_lists_the_plain_id_and_accepts_the_name_it_was_given(tiny_target):
    app = create_app(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), "Tiny Llama (random weights)")
    with TestClient(app, base_url="http://localhost") as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["Tiny-Llama"]
        for model in ("Tiny-Llama", "Tiny Llama (random weights)"):
            r = client.post("/v1/completions", json={"model": model, "prompt": "a b", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "Tiny-Llama"
        r = client.post("/v1/completions", json={"model": "Tiny", "prompt": "a b", "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert 'model_name="Tiny-Llama"' in client.get("/metrics").text
