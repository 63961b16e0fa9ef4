"""The official OpenAI Python client against `switchyard up`, unchanged.

Run by `make test-python` (SWITCHYARD_BIN points at the built binary; plugins/ must hold the
built-in policies).
"""

import os
import re
import subprocess
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SWITCHYARD_BIN", str(ROOT / "target" / "debug" / "switchyard"))


@pytest.fixture(scope="module")
def base_url():
    proc = subprocess.Popen(
        [BIN, "up", "--port", "0", "--plugins", str(ROOT / "plugins")],
        stdout=subprocess.PIPE,
        text=True,
    )
    url = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.match(r"switchyard router ready on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "switchyard up did not report ready"
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def client(base_url):
    # No client retries: the client's default (2) would hide a transient 5xx from the router.
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


PROMPT = "Disaggregated serving splits prefill from decode"


def test_completion_non_stream_has_real_usage(client):
    r = client.completions.create(model="switchyard-reference", prompt=PROMPT, max_tokens=12)
    assert r.id.startswith("cmpl-")
    assert r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(PROMPT)
    assert r.usage.completion_tokens == len(r.choices[0].text)


def test_completion_stream_equals_non_stream(client):
    whole = client.completions.create(model="switchyard-reference", prompt=PROMPT, max_tokens=12)
    chunks = list(
        client.completions.create(
            model="switchyard-reference",
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


# What the documented default chat rendering makes of the messages (no model dir, no template).
CHAT_RENDERED = "<|user|>\nSay something\n<|assistant|>\n"


def test_chat_non_stream_and_stream(client):
    messages = [{"role": "user", "content": "Say something"}]
    r = client.chat.completions.create(model="switchyard-reference", messages=messages, max_tokens=10)
    assert r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    content = r.choices[0].message.content
    assert content
    # The reference tokenizer is byte-level: one token per byte.
    assert r.usage.prompt_tokens == len(CHAT_RENDERED.encode())
    assert r.usage.completion_tokens == len(content.encode())
    chunks = list(
        client.chat.completions.create(
            model="switchyard-reference",
            messages=messages,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_equals_a_completion_of_the_rendered_prompt(client):
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="switchyard-reference", messages=messages, max_tokens=10)
    completion = client.completions.create(model="switchyard-reference", prompt=CHAT_RENDERED, max_tokens=10)
    assert chat.choices[0].message.content == completion.choices[0].text


def test_bad_request_is_an_openai_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="switchyard-reference", prompt=PROMPT, max_tokens=0)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="switchyard-reference", messages=[], max_tokens=5)
    assert e.value.body["param"] == "messages"
