"""The official OpenAI Python client against `switchyard serve` in front of two reference
engines serving different models (`--served-model-name`): the router lists both and routes each
model to its engine; an unknown model is a 404 `model_not_found`.

Run by `make test-python` (SWITCHYARD_BIN points at the built binary; plugins/ must hold the
built-in policies).
"""

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SWITCHYARD_BIN", str(ROOT / "target" / "debug" / "switchyard"))
MODELS = ("alpha", "beta")


def start(args, ready):
    """`switchyard ARGS…`, and the URL its first stdout line matching `ready` names."""
    proc = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.match(ready, line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError(f"switchyard {args} did not report ready")


@pytest.fixture(scope="module")
def client():
    procs = []
    try:
        engines = []
        for name in MODELS:
            proc, url = start(
                ["engine", "--port", "0", "--served-model-name", name],
                r"switchyard engine ready on (http://\S+)",
            )
            procs.append(proc)
            engines.append(url)
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "router.toml"
            config.write_text("".join(f'[[models]]\nname = "{m}"\n' for m in MODELS))
            endpoints = [arg for url in engines for arg in ("--endpoint", url)]
            proc, url = start(
                ["serve", "--port", "0", "--plugins", str(ROOT / "plugins"),
                 "--policy", "round-robin", "--config", str(config), *endpoints],
                r"switchyard router listening on (http://\S+)",
            )
            procs.append(proc)
            # No client retries: the client's default (2) would hide a transient 5xx.
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            # Ready, and both engines probed: their models are listed.
            deadline = time.monotonic() + 60
            while True:
                try:
                    if set(MODELS) <= {m.id for m in client.models.list()}:
                        break
                except openai.APIStatusError:
                    pass
                assert time.monotonic() < deadline, "the router never listed both models"
                time.sleep(0.05)
            yield client
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_models_lists_every_engines_model(client):
    listed = {m.id: m for m in client.models.list()}
    for name in MODELS:
        assert listed[name].owned_by


@pytest.mark.parametrize("model", MODELS)
def test_each_model_is_answered(client, model):
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4)
    assert r.model == model
    assert r.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == model
    assert chat.choices[0].message.content


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="nope", prompt="Hello", max_tokens=4)
    assert refused.value.code == "model_not_found"
