"""`kd generate`: the text equals transformers' own `generate` on the same folder (greedy, and
sampling with a seed), a kd LoRA folder loads its merged weights (not the adapter twice), an
adapter-only folder loads through peft, and every user mistake is one `kd: error:` line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kd.cli import main
from kd.generate import generate, load_model
from kd.testing import (
    TOKENIZER_VOCAB_SIZE,
    TinyModel,
    write_hf_tokenizer,
    write_tiny_model,
)

SHAPE = TinyModel(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=32,
    intermediate_dim=64,
    max_seq_len=256,
)
PROMPT = "12+30="


def copy_files(src: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        shutil.copyfile(item, dest / item.name)
    return dest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generate")
    folder = write_tiny_model(root / "model", SHAPE, seed=7, writer="transformers", perturb=0.05)
    copy_files(write_hf_tokenizer(root / "tokenizer"), folder)
    return folder


def reference(folder: Path, ids: list[int], *, max_new_tokens: int, **options) -> str:
    """transformers' own generate on ``folder`` (the model the test itself loads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    return _decode(folder, model, ids, max_new_tokens=max_new_tokens, **options)


def _decode(tokenizer_dir: Path, model, ids: list[int], *, max_new_tokens: int, **options) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    torch.manual_seed(options.pop("seed", 0))
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **options,
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def prompt_tokens(folder: Path, text: str, *, chat: bool) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return tokenizer(text, add_special_tokens=not chat)["input_ids"]


def kd_subprocess(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kd.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_greedy_cli_prints_what_transformers_generates(model_dir):
    ids = prompt_tokens(model_dir, PROMPT, chat=False)
    assert ids == list(PROMPT.encode())
    expected = reference(model_dir, ids, max_new_tokens=12, do_sample=False)
    assert expected.strip()  # a non-empty answer, so the comparison says something
    proc = kd_subprocess(
        "generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "12"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    assert proc.stderr == ""  # no progress bars or library warnings


def test_chat_uses_the_template(model_dir):
    ids = prompt_tokens(model_dir, PROMPT, chat=True)
    assert ids[:1] == [257] and ids[-3:] == list(b"nt\n")  # <|im_start|>user ... assistant\n
    expected = reference(model_dir, ids, max_new_tokens=10, do_sample=False)
    assert expected
    got = generate(model_dir, PROMPT, chat=True, max_new_tokens=10)
    assert got == expected
    assert got != generate(model_dir, PROMPT, chat=False, max_new_tokens=10)


def test_sampling_follows_the_seed(model_dir):
    ids = prompt_tokens(model_dir, PROMPT, chat=False)
    runs = {
        seed: generate(model_dir, PROMPT, max_new_tokens=16, temperature=1.5, seed=seed)
        for seed in (0, 1)
    }
    for seed, got in runs.items():
        want = reference(
            model_dir, ids, max_new_tokens=16, do_sample=True, temperature=1.5, seed=seed
        )
        assert got == want
    assert runs[0] != runs[1]


@pytest.fixture(scope="module")
def lora_folders(model_dir, tmp_path_factory) -> dict[str, Path]:
    """A LoRA adapter on ``model_dir``: ``adapter`` (adapter files + tokenizer only) and ``final``
    (merged weights next to the adapter files, as kd writes a LoRA student)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    torch.manual_seed(3)
    config = LoraConfig(
        r=4,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,  # random A and B: the adapter changes the model a lot
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, config)
    adapter = root / "adapter"
    peft_model.save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, adapter / name)
    final = root / "final"
    peft_model.merge_and_unload().save_pretrained(final)
    for item in adapter.iterdir():
        shutil.copyfile(item, final / item.name)
    return {"adapter": adapter, "final": final}


def test_lora_folder_loads_the_merged_weights(lora_folders, model_dir, tmp_path):
    from safetensors.torch import load_file

    final = lora_folders["final"]
    merged = load_file(str(final / "model.safetensors"))
    base = load_file(str(model_dir / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[key] - base[key]).abs().max() > 0.1  # the adapter is in the merged weights
    model, _ = load_model(final)
    state = model.state_dict()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for name, tensor in merged.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    # transformers' from_pretrained on `final` itself would load the adapter on top of the merged
    # weights (with peft 0.18 it fails): the reference reads a copy without the adapter files.
    plain = copy_files(final, tmp_path / "plain")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (plain / name).unlink()
    ids = prompt_tokens(final, PROMPT, chat=False)
    expected = reference(plain, ids, max_new_tokens=12, do_sample=False)
    assert generate(final, PROMPT, max_new_tokens=12) == expected


def test_adapter_only_folder_loads_through_peft(lora_folders, model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = lora_folders["adapter"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = prompt_tokens(adapter, PROMPT, chat=False)
    expected = _decode(adapter, peft_model, ids, max_new_tokens=12, do_sample=False)
    assert expected != reference(model_dir, ids, max_new_tokens=12, do_sample=False)
    assert generate(adapter, PROMPT, max_new_tokens=12) == expected
    # Without its own tokenizer files, the adapter folder uses its base folder's.
    (adapter / "tokenizer.json").unlink()
    (adapter / "tokenizer_config.json").unlink()
    assert generate(adapter, PROMPT, max_new_tokens=12) == expected


# ------------------------------------------------------------------------------ user mistakes
def broken(model_dir: Path, dest: Path, *, drop: tuple[str, ...] = (), **tokenizer) -> Path:
    copy_files(model_dir, dest)
    for name in drop:
        (dest / name).unlink()
    if tokenizer:
        write_hf_tokenizer(dest, **tokenizer)
    return dest


CASES = {
    "missing_folder": (lambda m, t: t / "nope", [], "--model: folder", "does not exist"),
    "no_config": (
        lambda m, t: broken(m, t / "x", drop=("config.json",)),
        [],
        "--model:",
        "has no config.json; pass a Hugging Face model folder",
    ),
    "no_weights": (
        lambda m, t: broken(m, t / "x", drop=("model.safetensors",)),
        [],
        "--model:",
        "has config.json but no model weights",
    ),
    "no_tokenizer": (
        lambda m, t: broken(m, t / "x", drop=("tokenizer.json",)),
        [],
        "--model:",
        "has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json); copy",
    ),
    "no_chat_template": (
        lambda m, t: broken(m, t / "x", chat_template=None),
        ["--chat"],
        "--chat: the tokenizer has no chat_template",
        "drop --chat",
    ),
    "zero_new_tokens": (
        lambda m, t: m,
        ["--max-new-tokens", "0"],
        "--max-new-tokens: 0 generates nothing",
        "pass a number >= 1",
    ),
    "too_many_new_tokens": (
        lambda m, t: m,
        ["--max-new-tokens", "251"],
        "--max-new-tokens: the prompt (6 tokens) plus 251 new tokens exceed the model's 256",
        "lower --max-new-tokens",
    ),
    "negative_temperature": (
        lambda m, t: m,
        ["--temperature", "-1"],
        "--temperature: -1.0 is not a temperature",
        "pass 0 (greedy)",
    ),
    "non_utf8_prompt": (
        lambda m, t: m,
        ["--prompt", os.fsdecode(b"12\xff+30")],  # what sys.argv holds for a latin-1 byte
        "--prompt: the prompt is not UTF-8 text (byte 0xff at character 2)",
        "pass UTF-8",
    ),
    "seed_past_64_bits": (
        lambda m, t: m,
        ["--temperature", "0.8", "--seed", str(2**64)],
        f"--seed: {2**64} is not a seed",
        f"pass an integer from 0 to {2**64 - 1}",
    ),
    "negative_seed": (
        lambda m, t: m,
        ["--seed", "-1"],
        "--seed: -1 is not a seed",
        "pass an integer from 0",
    ),
    "bad_weights": (
        lambda m, t: _junk_weights(broken(m, t / "x")),
        [],
        "--model: transformers cannot load the model in",
        "check config.json and the weight files",
    ),
    "adapter_base_missing": (
        lambda m, t: _adapter_with_base(t / "x", "/no/such/base"),
        [],
        "--model:",
        "holds only a LoRA adapter and its base model folder /no/such/base",
    ),
}


def _junk_weights(folder: Path) -> Path:
    (folder / "model.safetensors").write_bytes(b"junk")
    return folder


def _adapter_with_base(dest: Path, base: str) -> Path:
    dest.mkdir(parents=True)
    (dest / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    (dest / "adapter_model.safetensors").write_bytes(b"")
    return dest


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_mistakes_are_one_line(case, model_dir, tmp_path, capsys):
    make, extra, start, needle = CASES[case]
    folder = make(model_dir, tmp_path)
    argv = ["generate", "--model", str(folder), "--prompt", PROMPT, *extra]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"kd: error: {start}"), line
    assert needle in line, line


# Chat templates that cannot render (the cases training refuses, kd.hf.tokenization).
BROKEN_TEMPLATES = {
    "syntax": ("{% for m in messages %}{{ m['content'] }}", "is not valid Jinja (line 1"),
    "sandbox": ("{{ ''.__class__.__mro__ }}", "does something jinja2's sandbox forbids"),
    "escape": (
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "does something jinja2's sandbox forbids",
    ),
    "mutation": ("{{ messages.append(1) }}", "does something jinja2's sandbox forbids"),
    "raise_exception": (
        "{{ raise_exception('only user and assistant roles') }}",
        "stopped with its own error (TemplateError: only user and assistant roles)",
    ),
    "endless": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "did not finish rendering one conversation in 0.5 s",
    ),
    "empty": ("{% if false %}x{% endif %}", "renders the prompt as no text"),
}


@pytest.mark.parametrize("name", sorted(BROKEN_TEMPLATES))
def test_a_chat_template_that_cannot_render_is_one_line(
    name, model_dir, tmp_path, capsys, monkeypatch
):
    """``kd generate --chat`` renders as training does: jinja2's sandbox, the time limit (here
    0.5 s), the template's own error; one line naming the folder, no traceback, no hang."""
    from kd.hf import tokenization

    monkeypatch.setattr(tokenization, "TEMPLATE_TIME_LIMIT_S", 0.5)
    template, words = BROKEN_TEMPLATES[name]
    folder = broken(model_dir, tmp_path / "x", chat_template=template)
    argv = ["generate", "--model", str(folder), "--prompt", PROMPT, "--chat"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"kd: error: --chat: the chat template of {folder} "), line
    assert words in line and "fix or replace the folder's chat_template" in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_unavailable_subprocess(model_dir):
    proc = kd_subprocess("generate", "--model", str(model_dir), "--prompt", "x", "--device", "cuda")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "kd: error: --device cuda: no CUDA device is available on this machine; pass --device cpu"
    ]


def test_bad_merged_weights_name_the_folder(lora_folders, tmp_path, capsys):
    """A LoRA folder is read through a temporary folder without the adapter; errors name the real one."""
    folder = _junk_weights(copy_files(lora_folders["final"], tmp_path / "final"))
    assert main(["generate", "--model", str(folder), "--prompt", PROMPT]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kd: error: --model: transformers cannot load the model in {folder} (")


def test_seed_past_2_63_samples(model_dir, capsys):
    """A seed in torch's upper half (2**63 .. 2**64 - 1) samples like any other, reproducibly."""
    argv = ["generate", "--model", str(model_dir), "--prompt", PROMPT, "--temperature", "0.8"]
    assert main([*argv, "--seed", str(2**63), "--max-new-tokens", "4"]) == 0
    first = capsys.readouterr().out
    assert main([*argv, "--seed", str(2**63), "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == first


def test_a_terminal_is_told_what_the_minutes_go_to(model_dir, capsys, monkeypatch):
    """On a terminal, loading and generating each say so first (issue 42: minutes without a
    word); piped, stderr stays empty (test_greedy_cli_prints_what_transformers_generates)."""
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = ["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "3"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"kd: loading {model_dir} on cpu" in err
    assert any(line.startswith("kd: generating up to 3 tokens after a ") for line in err), err
