"""`verispec serve --spec draft=online`: the head learns from the server's traffic (inline within its budget on the
engine thread, and while no request runs), is kept in --online-dir (saved atomically, at shutdown), and a restarted
server continues from it. An 8-layer tiny target (EAGLE-3's default aux layers 2, 4, 5)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import save

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.heads.online import STATE as STATE_FILE
from verispec.rollout import RolloutEngine
from verispec.sampling import SamplingParams
from verispec.serve import create_app
from verispec.serve.online import OnlineKeeper, check_online_dir, online_config, recover, saved_head

from ..helpers.cli import run_verispec
from ..helpers.server import MODEL, LiveServer, free_port, wait_for_health, wait_until
from ..helpers.tiny import loaded, make_tokenizer

ONLINE = SpecConfig(draft="online", gamma=3)
# 2 requests x 8 choices x 36 tokens = 576 generated tokens: past the first head's 512
REQUEST = {"model": MODEL, "n": 8, "max_tokens": 36, "ignore_eos": True, "temperature": 1.0}
PROMPTS = ["a b c a b", "x0 d e d e f"]


@pytest.fixture(scope="module")
def tiny8():
    return loaded(0, layers=8)


def _traffic(url: str, seed: int) -> None:
    for k, prompt in enumerate(PROMPTS):
        r = httpx.post(url + "/v1/completions", json=REQUEST | {"prompt": prompt, "seed": seed + k}, timeout=120)
        assert r.status_code == 200, r.text


def _rollouts(url: str, seed: int) -> int:
    """The same volume through the RL route /generate/ (TRL's); returns the weight version they were drawn under."""
    body = {k: REQUEST[k] for k in ("n", "max_tokens", "temperature")} | {"prompts": PROMPTS}
    body["generation_kwargs"] = {"seed": seed, "ignore_eos": True}
    r = httpx.post(url + "/generate/", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["weight_version"]


def _saved_version(folder) -> int:
    return torch.load(folder / STATE_FILE, weights_only=False)["version"]


def test_the_head_learns_from_traffic_and_a_restart_continues_from_it(tiny8, tmp_path):
    folder = tmp_path / "head"
    gen = SpeculativeGenerator(tiny8, config=online_config(ONLINE, folder))  # nothing saved yet: a fresh head
    learner = gen.learner
    assert learner.version == 0 and gen.config.model is None
    with LiveServer(gen, online_dir=folder) as s:
        _traffic(s.url, 0)
        assert learner.train_seconds > 0  # trained inline, within the budget, on the engine thread
        wait_until(lambda: learner.idle_seconds > 0 and learner.version >= 1, "training while no request runs")
        greedy = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        text = httpx.post(s.url + "/v1/completions", json=greedy, timeout=120).json()["choices"][0]["text"]
        wait_until(lambda: not s.engine.online.idle_work(), "idle training to stop (IDLE_PASSES)")
    version = learner.version
    assert saved_head(folder) and _saved_version(folder) == version  # written at shutdown: the last version
    assert sorted(p.name for p in folder.parent.iterdir()) == ["head"]  # no .head.tmp / .head.old left
    plain = SpeculativeGenerator(tiny8, config=SpecConfig(draft="none"))
    ref = plain.generate([PROMPTS[0]], SamplingParams(temperature=0.0), max_new_tokens=24, ignore_eos=True)
    assert text == ref[0].text  # greedy through the learning server is plain greedy

    again = SpeculativeGenerator(tiny8, config=online_config(ONLINE, folder))  # the restart: model=DIR
    assert again.config.model == str(folder.resolve()) and again.learner.version == version
    assert again.learner.steps == learner.steps
    with LiveServer(again, online_dir=folder, enable_weight_updates=True) as s:  # an RL step on the server
        new = {k: v.contiguous() for k, v in loaded(5, layers=8).model.state_dict().items()}
        headers = {"content-type": "application/octet-stream"}
        up = httpx.post(s.url + "/update_weights_from_tensor", content=save(new), headers=headers, timeout=120)
        assert up.status_code == 200 and again.learner.version == version  # the update leaves the head as it is
        assert _rollouts(s.url, 10) == 1
        wait_until(lambda: again.learner.version > version, "a newer version, from the new policy's rollouts")
    assert _saved_version(folder) == again.learner.version > version


def test_online_dir_refusals(tiny8, tmp_path, capsys):
    with pytest.raises(ValueError, match="draft=online generator, not draft=none"):
        create_app(SpeculativeGenerator(tiny8, config=SpecConfig(draft="none")), MODEL, online_dir=tmp_path)
    with pytest.raises(ValueError, match="give --spec draft=online"):
        online_config(SpecConfig(draft="ngram"), tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files than an online head's save"):
        online_config(ONLINE, tmp_path)
    trained = tmp_path / "train-draft-run"  # a head with its training run's data: never replaced by a save
    trained.mkdir()
    for name in ("config.json", "model.safetensors", "data.pt"):
        (trained / name).write_text("{}")
    with pytest.raises(ValueError, match="holds other files than an online head's save"):
        online_config(ONLINE, trained)
    with pytest.raises(ValueError, match="not a directory"):
        check_online_dir(tmp_path / "notes.txt")
    res = run_verispec(
        ["serve", "--spec", "draft=ngram", "--online-dir", tmp_path / "h", "--port", free_port()], capsys
    )
    assert res.returncode == 2 and "--online-dir keeps an online head" in res.stderr.strip().splitlines()[-1]


@pytest.fixture
def trained(tiny8):
    """A learner with a version (one rollout batch trained on)."""
    eng = RolloutEngine(tiny8, config=SpecConfig.parse("draft=online,gamma=3,stop_below=none,random=stream"))
    eng.generate(
        [[1, 5, 6, 7, 8], [1, 9, 9, 3]], n=8, params=SamplingParams(temperature=1.0), max_new_tokens=40, ignore_eos=True
    )
    assert eng.learner.version >= 1
    return eng.learner


def test_a_save_is_atomic(trained, tmp_path, monkeypatch):
    folder = tmp_path / "head"
    keeper = OnlineKeeper(trained, folder, 8, save_interval=3600.0)
    assert 0 < keeper.due() <= 3600  # the learner's version is new to the (empty) directory; not yet due
    keeper.save(now=True)
    first = _saved_version(folder)
    assert first == trained.version and keeper.due() is None
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    trained.train(steps=1)
    assert 0 < keeper.due() <= 3600  # newer, not yet due
    keeper.save()
    assert _saved_version(folder) == first

    def crash(self, where, layers):  # a save that dies half-way through writing
        (where / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
        (where / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(type(trained), "save", crash)
    keeper.save(now=True)  # logged, not raised
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the old head, whole
    monkeypatch.undo()
    recover(folder)  # what a restart does first: the half-written copy goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
    folder.rename(tmp_path / ".head.old")  # a crash between the swap's two renames: only the replaced head is left
    assert check_online_dir(folder) == folder and saved_head(folder) and _saved_version(folder) == first
    keeper.save(now=True)
    assert _saved_version(folder) == trained.version > first


@pytest.mark.slow  # two `verispec serve` processes: ~30 s on 2 cores
def test_cli_serve_online_dir_survives_a_restart(tmp_path):
    from ..helpers.tiny import make_model

    make_model(0, layers=8).save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    folder = tmp_path / "head"
    versions = []
    for run in range(2):
        port = free_port()
        argv = ["serve", "--target", tmp_path / "target", "--port", port, "--served-model-name", MODEL]
        argv += ["--spec", "draft=online,gamma=3", "--online-dir", folder]
        proc = subprocess.Popen(
            [sys.executable, "-m", "verispec.cli", *map(str, argv)], stderr=subprocess.PIPE, text=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_health(url, proc, "verispec serve")
            _traffic(url, 20 * run)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, -signal.SIGTERM), err
        serving = next(line for line in err.splitlines() if line.startswith("serving"))
        assert ("model=" in serving) == (run == 1), serving  # the restart starts from the saved head
        versions.append(_saved_version(folder))
    assert 1 <= versions[0] < versions[1]
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
