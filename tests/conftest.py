"""Session-wide fixtures: the repo root, the default model (SmolLM2-135M-Instruct), and
the guard that the session leaves no runtime folder of its own behind (runtime_guard.py)."""

from __future__ import annotations

import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def no_runtime_folder_left_behind():
    """Fails the session (an error at the last teardown) when its servers or in-process
    processes left `kestrel-<id>` runtime or dump folders (tests/runtime_guard.py)."""
    from tests.runtime_guard import left_behind, runtime_folders

    before = runtime_folders()
    yield
    left = left_behind(before)
    if left:
        pytest.fail(f"the test session left runtime folders behind: {left}", pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    """After a session that passed, its servers' logs (tests/e2e/server.py `LOGS`, one
    /tmp/kestrel-serve-*.log per server) are removed; a failed session keeps them."""
    import os
    import sys

    mod = sys.modules.get("tests.e2e.server")
    if exitstatus == 0 and mod is not None:
        for path in mod.LOGS:
            try:
                os.unlink(path)
            except OSError:
                pass


@pytest.fixture(autouse=True)
def plain_weight_schemes():
    """A `ModelRunner` built in the test process sets process-wide weight schemes
    (`kernels.cpu_quant_linear.QUANTIZATION`, `kernels.fp8_linear.MODE`); they are put back
    to plain after each test so that a later test's layers are not quantized by an earlier
    test's runner."""
    import sys

    yield
    cq = sys.modules.get("kernels.cpu_quant_linear")
    if cq is not None:
        cq.QUANTIZATION = "none"
    f8 = sys.modules.get("kernels.fp8_linear")
    if f8 is not None:
        f8.MODE = "off"


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    """The repository's root folder."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def models_dir(repo_root) -> pathlib.Path:
    """The repo's `models/` folder (git-ignored), where fetched models live."""
    return repo_root / "models"


@pytest.fixture(scope="session")
def smollm2_dir(models_dir) -> pathlib.Path:
    """The converted HF folder of SmolLM2-135M-Instruct, fetched once (a no-op when present)."""
    from services.worker.fetch_model import fetch_model

    return pathlib.Path(fetch_model(str(models_dir)))


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir, models_dir) -> pathlib.Path:
    """The kept GGUF the folder was converted from (`models/.gguf/...Q4_1.gguf`)."""
    from services.worker.fetch_model import fetch_gguf

    return pathlib.Path(fetch_gguf(str(models_dir)))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own GGUF loader on the original file: (tokenizer, model), fp32, eval.

    The independent reference for parity and end-to-end tests (loads in ~18 s, once).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm2):
    """`hf_greedy(user_message, max_new_tokens) -> str`: transformers' greedy reply to one
    user message under the model's chat template (special tokens skipped). Cached."""
    import torch

    tok, model = hf_smollm2
    cache: dict = {}

    def run(prompt: str, n: int) -> str:
        if (prompt, n) not in cache:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            with torch.inference_mode():
                out = model.generate(**ids, max_new_tokens=n, do_sample=False)
            cache[(prompt, n)] = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        return cache[(prompt, n)]

    return run
