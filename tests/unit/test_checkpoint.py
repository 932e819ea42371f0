"""kd.checkpoint: HF round trips (Qwen2 tied, Llama, LoRA), atomic step checkpoints, resume."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kd import _torchtune as tt
from kd import checkpoint as ck
from kd.errors import KDUserError
from kd.testing import TinyModel, write_tiny_model

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, MAX_SEQ = 256, 32, 64, 2, 4, 2, 64
LORA_ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
RANK, ALPHA = 4, 8.0


def _tiny_shape(kind: str, **extra: Any) -> TinyModel:
    """The tiny shape of ``kind`` (qwen2: tied embeddings; llama: untied)."""
    return TinyModel(
        VOCAB,
        LAYERS,
        HEADS,
        KV_HEADS,
        HIDDEN,
        INTER,
        max_seq_len=MAX_SEQ,
        tie_word_embeddings=kind == "qwen2",
        family=kind,
        **extra,
    )


def _hf_model(kind: str, dest: Path) -> tuple[torch.nn.Module, dict]:
    """A tiny transformers model saved as safetensors + config.json (+ a tokenizer-like file)."""
    shape = _tiny_shape(kind, rope_base=10000.0)
    # Random init has unit norms / zero biases; perturb everything so a wrong mapping shows.
    write_tiny_model(dest, shape, seed=0, writer="transformers", perturb=0.05)
    (dest / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return _load_transformers(dest), json.loads((dest / "config.json").read_text())


def _tune_builder(kind: str, lora: bool = False):
    args = dict(
        vocab_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        embed_dim=HIDDEN,
        intermediate_dim=INTER,
        max_seq_len=MAX_SEQ,
        norm_eps=1e-6,
        rope_base=10000.0,
    )
    if lora:
        args.update(
            lora_attn_modules=LORA_ATTN, apply_lora_to_mlp=True, lora_rank=RANK, lora_alpha=ALPHA
        )
    if kind == "qwen2":
        return (tt.lora_qwen2 if lora else tt.qwen2)(**args, tie_word_embeddings=True)
    return (tt.lora_llama3 if lora else tt.llama3)(**args)


MODEL_TYPE = {"qwen2": "QWEN2", "llama": "LLAMA3"}
TOKENS = torch.tensor([[1, 5, 9, 200, 17, 3, 44, 250, 8, 2, 2, 7]])


def _hf_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def _tune_logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(TOKENS).float()


def _load_transformers(path: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_hf_round_trip_matches_transformers_logits(kind: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    hf_model, hf_config = _hf_model(kind, src)
    hf_sd = ck.load_hf_weights(src)
    if kind == "qwen2":
        assert "lm_head.weight" not in hf_sd  # tied: transformers does not store it
    tune_sd = ck.hf_to_tune_state_dict(hf_sd, model_type=MODEL_TYPE[kind], hf_config=hf_config)
    model = _tune_builder(kind)
    model.load_state_dict(tune_sd, strict=True)
    expected = _hf_logits(hf_model)
    torch.testing.assert_close(_tune_logits(model), expected, atol=1e-4, rtol=1e-4)

    # Perturb the torchtune weights so the saved model is not just a copy of the source file.
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.add_(0.1)
        model.layers[1].attn.k_proj.weight.mul_(1.5)
    dest = tmp_path / "out"
    dest.mkdir()
    ck.save_hf_model(dest, model.state_dict(), model_type=MODEL_TYPE[kind], source_dir=src)
    assert (dest / "tokenizer_config.json").exists() and (dest / "config.json").exists()
    saved = load_file(str(dest / ck.MODEL_FILE))
    assert ("lm_head.weight" in saved) == (kind == "llama")
    reloaded = _load_transformers(dest)
    torch.testing.assert_close(_hf_logits(reloaded), _tune_logits(model), atol=1e-4, rtol=1e-4)


def test_untied_config_gets_lm_head_from_tied_tune_model() -> None:
    emb = torch.randn(VOCAB, HIDDEN)
    out = ck.tune_to_hf_state_dict(
        {"tok_embeddings.weight": emb, "norm.scale": torch.ones(HIDDEN)},
        model_type="LLAMA3_2",
        hf_config={"num_attention_heads": HEADS, "hidden_size": HIDDEN},
    )
    torch.testing.assert_close(out["lm_head.weight"], emb)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_lora_saved_merged_and_as_peft_adapter(kind: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    _, hf_config = _hf_model(kind, src)
    base_hf = ck.load_hf_weights(src)
    model = _tune_builder(kind, lora=True)
    base_tune = ck.hf_to_tune_state_dict(base_hf, model_type=MODEL_TYPE[kind], hf_config=hf_config)
    missing, unexpected = model.load_state_dict(base_tune, strict=False)
    assert not unexpected and all("lora" in k for k in missing)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)  # lora_b starts at zero; make it matter
    state = model.state_dict()
    adapter = tt.get_adapter_state_dict(state)
    adapter_config = {
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": tt.get_lora_module_names(LORA_ATTN, True, False),
    }
    dest = tmp_path / "out"
    dest.mkdir()
    ck.save_hf_model(
        dest,
        state,
        model_type=MODEL_TYPE[kind],
        source_dir=src,
        adapter_state_dict=adapter,
        adapter_config=adapter_config,
    )
    assert "layers.0.attn.q_proj.lora_a.weight" in state  # the caller's dict is not merged in place

    # Merged: transformers' logits equal the LoRA model's.
    torch.testing.assert_close(
        _hf_logits(_load_transformers(dest)), _tune_logits(model), atol=1e-4, rtol=1e-4
    )

    # PEFT: names, config, and W_merged = W_base + alpha / r * B @ A in HF layout for every module.
    peft_cfg_text = (dest / ck.ADAPTER_CONFIG_FILE).read_text()
    peft_cfg = json.loads(peft_cfg_text)
    assert peft_cfg["r"] == RANK and peft_cfg["lora_alpha"] == ALPHA
    assert set(peft_cfg["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    peft = load_file(str(dest / ck.ADAPTER_MODEL_FILE))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in peft
    merged = load_file(str(dest / ck.MODEL_FILE))
    a_keys = [k for k in peft if k.endswith(".lora_A.weight")]
    assert len(a_keys) == LAYERS * 7
    for a_key in a_keys:
        module = a_key[len("base_model.model.") : -len(".lora_A.weight")]
        b = peft[module.join(["base_model.model.", ".lora_B.weight"])]
        expected = base_hf[module + ".weight"] + (ALPHA / RANK) * b @ peft[a_key]
        torch.testing.assert_close(merged[module + ".weight"], expected, atol=1e-5, rtol=1e-5)

    # Resume path: the PEFT file converts back to the exact torchtune adapter.
    back = ck.load_adapter_weights(dest, model_type=MODEL_TYPE[kind], hf_config=hf_config)
    assert back.keys() == adapter.keys()
    for k in adapter:
        assert torch.equal(back[k], adapter[k]), k

    # adapter_only (a served sampler's LoRA push): the same adapter files, and nothing else.
    alone = tmp_path / "alone"
    alone.mkdir()
    ck.save_hf_model(
        alone,
        state,
        model_type=MODEL_TYPE[kind],
        source_dir=src,
        adapter_state_dict=adapter,
        adapter_config=adapter_config,
        adapter_only=True,
    )
    assert sorted(str(p.relative_to(alone)) for p in alone.rglob("*") if p.is_file()) == sorted(
        [ck.ADAPTER_CONFIG_FILE, ck.ADAPTER_MODEL_FILE]
    )
    assert (alone / ck.ADAPTER_CONFIG_FILE).read_text() == peft_cfg_text
    alone_peft = load_file(str(alone / ck.ADAPTER_MODEL_FILE))
    assert alone_peft.keys() == peft.keys()
    assert all(torch.equal(alone_peft[k], peft[k]) for k in peft)


def test_save_hf_model_casts_dtype_and_records_it(tmp_path: Path) -> None:
    src = tmp_path / "src"
    model, _ = _hf_model("qwen2", src)
    tune_sd = ck.hf_to_tune_state_dict(
        ck.load_hf_weights(src), model_type="qwen2", hf_config=ck.read_hf_config(src)
    )
    dest = tmp_path / "out"
    dest.mkdir()
    ck.save_hf_model(dest, tune_sd, model_type="QWEN2", source_dir=src, dtype=torch.bfloat16)
    assert {v.dtype for v in load_file(str(dest / ck.MODEL_FILE)).values()} == {torch.bfloat16}
    cfg = json.loads((dest / "config.json").read_text())
    assert "bfloat16" in {cfg.get("dtype"), cfg.get("torch_dtype")}


# ---------------------------------------------------------------------------------------------
# Atomic step checkpoints
# ---------------------------------------------------------------------------------------------


def _writer(payload: bytes = b"weights"):
    def write_model(dest: Path) -> None:
        (dest / ck.MODEL_FILE).write_bytes(payload)
        (dest / "config.json").write_text("{}")

    return write_model


def _recipe_state(step: int) -> dict:
    return {"optimizer": {"state": {0: {"exp_avg": torch.full((3,), float(step))}}}, "step": step}


def _save(out: Path, step: int, keep: int = 2, write_model=None, state=True) -> Path:
    return ck.save_checkpoint(
        out,
        step,
        epoch=0,
        write_model=write_model or _writer(),
        recipe_state=_recipe_state(step) if state else None,
        config_yaml="seed: 1\n",
        keep_last_n=keep,
    )


def test_save_layout_marker_and_load(tmp_path: Path) -> None:
    path = _save(tmp_path, 10)
    assert path == tmp_path / "step_000010"
    marker = json.loads((path / ck.MARKER_FILE).read_text())
    assert marker["step"] == 10 and marker["epoch"] == 0
    assert set(marker["files"]) == {
        ck.MODEL_FILE,
        "config.json",
        ck.RECIPE_STATE_FILE,
        "config.yaml",
    }
    assert "sha256" in marker["files"][ck.RECIPE_STATE_FILE]
    assert marker["config_hash"] == ck.config_hash("seed: 1\n")
    assert ck.load_recipe_state(path)["optimizer"]["state"][0]["exp_avg"].tolist() == [10.0] * 3
    assert ck.load_checkpoint_config(path) == "seed: 1\n"
    assert ck.find_latest_checkpoint(tmp_path) == path
    assert not list(tmp_path.glob(".tmp_*"))

    final = _save(tmp_path, 12, state=False)
    assert final == tmp_path / "final" and not (final / ck.RECIPE_STATE_FILE).exists()
    assert json.loads((final / ck.MARKER_FILE).read_text())["step"] == 12
    assert ck.find_latest_checkpoint(tmp_path) == path  # final/ is not a resume point


def test_keep_last_n_and_stale_tmp_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".tmp_step_000004_999999999"
    stale.mkdir(parents=True)
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006", "step_000008"]
    _save(tmp_path, 8, keep=2)  # the same step again replaces it in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006", "step_000008"]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError(
            "[enforce fail at inline_container.cc] PytorchStreamWriter failed writing file"
            " data/0: file write failed"
        ),
    ],
)
def test_disk_full_leaves_previous_checkpoint_intact(tmp_path: Path, error: Exception) -> None:
    good = _save(tmp_path, 10)
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    def failing(dest: Path) -> None:
        (dest / ck.MODEL_FILE).write_bytes(b"partial")
        raise error

    with pytest.raises(KDUserError, match=r"step_000020.*free disk space"):
        _save(tmp_path, 20, write_model=failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010"]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert ck.find_latest_checkpoint(tmp_path) == good


def test_torch_save_failure_is_a_user_error(tmp_path: Path, monkeypatch) -> None:
    _save(tmp_path, 10)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(KDUserError, match="No space left"):
        _save(tmp_path, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010"]


def test_non_io_error_propagates_and_cleans_up(tmp_path: Path) -> None:
    def buggy(dest: Path) -> None:
        (dest / "x").write_text("x")
        raise ValueError("bug")

    with pytest.raises(ValueError, match="bug"):
        _save(tmp_path, 10, write_model=buggy)
    assert list(tmp_path.iterdir()) == []


def test_recipe_state_must_be_weights_only(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"recipe_state\['bad'\]"):
        ck.save_checkpoint(
            tmp_path,
            1,
            epoch=0,
            write_model=_writer(),
            recipe_state={"bad": object()},
            config_yaml="",
            keep_last_n=1,
        )
    assert list(tmp_path.iterdir()) == []


def test_find_latest_skips_incomplete_and_corrupt(tmp_path: Path, caplog) -> None:
    good = _save(tmp_path, 10, keep=5)
    truncated = _save(tmp_path, 20, keep=5)
    rs = truncated / ck.RECIPE_STATE_FILE
    rs.write_bytes(rs.read_bytes()[:-7])
    flipped = _save(tmp_path, 25, keep=5)
    data = bytearray((flipped / ck.RECIPE_STATE_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (flipped / ck.RECIPE_STATE_FILE).write_bytes(bytes(data))
    no_marker = _save(tmp_path, 30, keep=5)
    (no_marker / ck.MARKER_FILE).unlink()
    bad_json = _save(tmp_path, 40, keep=5)
    (bad_json / ck.MARKER_FILE).write_text('{"step": 4')

    with caplog.at_level(logging.WARNING, logger="kd"):
        assert ck.find_latest_checkpoint(tmp_path) == good
    text = caplog.text
    assert "step_000040" in text and "unreadable" in text
    assert "step_000030" in text and "did not finish" in text
    assert "step_000025" in text and "sha256" in text
    assert "step_000020" in text and "truncated" in text
    assert ck.find_latest_checkpoint(tmp_path / "missing") is None


def test_load_recipe_state_rejects_pickles(tmp_path: Path) -> None:
    torch.save({"f": random.Random}, tmp_path / ck.RECIPE_STATE_FILE)  # a pickled class
    with pytest.raises(KDUserError, match="recipe_state.pt"):
        ck.load_recipe_state(tmp_path)


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from kd import checkpoint as ck
    out = Path(sys.argv[1])
    step = 0
    print("ready", flush=True)
    while True:
        step += 1
        ck.save_checkpoint(out, step, epoch=0,
            write_model=lambda d: (d / "model.safetensors").write_bytes(bytes(200_000)),
            recipe_state={"w": torch.full((50_000,), float(step))},
            config_yaml="seed: 1\\n", keep_last_n=2)
    """
)


def test_kill_9_never_leaves_newest_checkpoint_unreadable(tmp_path: Path) -> None:
    script = tmp_path / "saver.py"
    script.write_text(_KILL_SCRIPT)
    out = tmp_path / "out"
    for delay in (0.05, 0.13, 0.31):
        proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        proc.kill()
        proc.wait()
        latest = ck.find_latest_checkpoint(out)
        if latest is None:  # killed before the first save of the first run finished
            continue
        state = ck.load_recipe_state(latest)
        step = ck.read_checkpoint_marker(latest)["step"]
        assert torch.equal(state["w"], torch.full((50_000,), float(step)))
    assert ck.find_latest_checkpoint(out) is not None


# ---------------------------------------------------------------------------------------------
# RNG and config compatibility
# ---------------------------------------------------------------------------------------------


def _draw() -> tuple:
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), torch.rand(3).tolist())


def test_rng_capture_restore_reproduces_draws(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    state = ck.capture_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    first = _draw()
    _draw()
    ck.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draw() == first


BASE_CFG = """
output_dir: /tmp/a
seed: 1
batch_size: 2
optimizer: {_component_: torch.optim.AdamW, lr: 2.0e-05}
checkpointer: {checkpoint_dir: /m/student, output_dir: /tmp/a}
log_every_n_steps: 1
memory: {budget_gib: 10}
"""


def test_config_compatibility() -> None:
    benign = (
        BASE_CFG.replace("/tmp/a", "/tmp/b")
        .replace("log_every_n_steps: 1", "log_every_n_steps: 5")
        .replace("budget_gib: 10", "budget_gib: 20")
    )
    ck.check_resume_compatible(BASE_CFG, benign)
    assert ck.config_hash(BASE_CFG) == ck.config_hash(benign)

    changed = BASE_CFG.replace("lr: 2.0e-05", "lr: 1.0e-04").replace("seed: 1", "seed: 2")
    changed += "kd_ratio: 0.9\n"
    assert ck.config_hash(BASE_CFG) != ck.config_hash(changed)
    with pytest.raises(KDUserError) as info:
        ck.check_resume_compatible(BASE_CFG, changed, checkpoint=Path("/o/step_000010"))
    lines = str(info.value).splitlines()
    assert lines[0].startswith("kd_ratio: 0.5 in the checkpoint, 0.9 now")  # the default
    assert lines[1].startswith("optimizer.lr: 2e-05 in the checkpoint, 0.0001 now")
    assert lines[2].startswith("seed: 1 in the checkpoint, 2 now")
    assert "/o/step_000010/config.yaml" in lines[-1] and len(lines) == 4


def test_schema_resume_flags_decide_what_may_change(monkeypatch) -> None:
    from kd.config import schema

    # may_change keys (top level, a section's leaf, a checkpointer's output path) are accepted.
    assert schema.TOP_LEVEL["keep_last_n"].resume == schema.MAY_CHANGE
    assert schema.FSDP["cpu_offload"].resume == schema.MAY_CHANGE
    benign = BASE_CFG + "keep_last_n: 5\nfsdp: {cpu_offload: true}\n"
    benign = benign.replace("output_dir: /tmp/a}", "output_dir: /tmp/b}")
    ck.check_resume_compatible(BASE_CFG, benign)
    assert ck.config_hash(BASE_CFG) == ck.config_hash(benign)

    # must_match keys are refused, each named.
    assert schema.TOP_LEVEL["gradient_accumulation_steps"].resume == schema.MUST_MATCH
    assert schema.KD_LOSS["beta"].resume == schema.MUST_MATCH
    changed = BASE_CFG + "gradient_accumulation_steps: 4\nkd_loss: {beta: 0.2}\n"
    with pytest.raises(KDUserError) as info:
        ck.check_resume_compatible(BASE_CFG, changed)
    lines = str(info.value).splitlines()
    assert lines[0] == "gradient_accumulation_steps: 1 in the checkpoint, 4 now"
    assert lines[1] == "kd_loss.beta: 0.5 in the checkpoint, 0.2 now"
    assert len(lines) == 3

    # The check and the hash read the flags from the schema.
    monkeypatch.setitem(
        schema.TOP_LEVEL,
        "gradient_accumulation_steps",
        dataclasses.replace(
            schema.TOP_LEVEL["gradient_accumulation_steps"], resume=schema.MAY_CHANGE
        ),
    )
    monkeypatch.setitem(
        schema.TOP_LEVEL,
        "keep_last_n",
        dataclasses.replace(schema.TOP_LEVEL["keep_last_n"], resume=schema.MUST_MATCH),
    )
    with pytest.raises(KDUserError) as info:
        ck.check_resume_compatible(BASE_CFG, changed + "keep_last_n: 5\n")
    lines = str(info.value).splitlines()
    assert lines[:2] == [
        "kd_loss.beta: 0.5 in the checkpoint, 0.2 now",
        "keep_last_n: 2 in the checkpoint, 5 now",
    ]
    assert ck.config_hash(BASE_CFG) != ck.config_hash(BASE_CFG + "keep_last_n: 5\n")


def _saved_run(out: Path, config_yaml: str) -> Path:
    return ck.save_checkpoint(
        out,
        1,
        epoch=0,
        write_model=_writer(),
        recipe_state=_recipe_state(1),
        config_yaml=config_yaml,
        keep_last_n=1,
    )


def test_marker_hash_is_checked_on_resume(tmp_path: Path) -> None:
    path = _saved_run(tmp_path, BASE_CFG)
    marker = ck.read_checkpoint_marker(path)
    assert marker["config_hash"] == ck.config_hash(BASE_CFG)
    changed = BASE_CFG.replace("seed: 1", "seed: 2")

    # The marker's hash matches this run's config: nothing more is compared (the snapshot given
    # here differs in seed, and is not looked at).
    ck.check_resume_compatible(changed, BASE_CFG, checkpoint=path)
    # It does not match: the keys are compared and the differing one named.
    with pytest.raises(KDUserError, match=r"^seed: 1 in the checkpoint, 2 now"):
        ck.check_resume_compatible(BASE_CFG, changed, checkpoint=path)


@pytest.mark.parametrize("old_hash", [None, "sha256 of the whole config.yaml"])
def test_marker_of_older_kd_falls_back_to_key_comparison(tmp_path: Path, old_hash) -> None:
    path = _saved_run(tmp_path, BASE_CFG)
    marker = ck.read_checkpoint_marker(path)
    if old_hash is None:
        del marker["config_hash"]
    else:
        marker["config_hash"] = hashlib.sha256(old_hash.encode()).hexdigest()
    (path / ck.MARKER_FILE).write_text(json.dumps(marker))
    ck.check_resume_compatible(
        BASE_CFG, BASE_CFG.replace("budget_gib: 10", "budget_gib: 20"), checkpoint=path
    )
    with pytest.raises(KDUserError, match=r"^seed: 1 in the checkpoint, 2 now"):
        ck.check_resume_compatible(
            BASE_CFG, BASE_CFG.replace("seed: 1", "seed: 2"), checkpoint=path
        )


# ---------------------------------------------------------------------------------------------
# Damaged resume files, full disks, config.json against its weights
# ---------------------------------------------------------------------------------------------


def _set_marker(ckpt: Path, edit) -> None:
    marker = json.loads((ckpt / ck.MARKER_FILE).read_text())
    edit(marker)
    (ckpt / ck.MARKER_FILE).write_text(json.dumps(marker))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda m: m.clear(), "not a kd marker"),
        (lambda m: m.update(files=[ck.MODEL_FILE]), "not a kd marker"),
        (lambda m: m["files"][ck.MODEL_FILE].pop("size"), "has no size"),
        (lambda m: m["files"][ck.MODEL_FILE].update(size="7"), "has no size"),
        (lambda m: m["files"][ck.MODEL_FILE].update(sha256=5), "is not a string"),
        (lambda m: m.update(step="20"), "step and epoch are not counts"),
        (lambda m: m.update(epoch=-1), "step and epoch are not counts"),
        (lambda m: m["files"].update({"../x": {"size": 1}}), "'../x' lies outside the folder"),
        (lambda m: m["files"].update({"/etc/hosts": {"size": 1}}), "lies outside the folder"),
        (lambda m: m.update(step=30), "says step 30, the folder is step 20"),
        (lambda m: m["files"].pop(ck.CONFIG_SNAPSHOT_FILE), "lists no config.yaml"),
        (lambda m: m["files"].pop(ck.MODEL_FILE), "lists no model.safetensors"),
        (lambda m: m["files"].update({"extra.bin": {"size": 3}}), "extra.bin is missing"),
        (lambda m: m["files"][ck.MODEL_FILE].update(size=3), "has 7 bytes, 3 expected"),
        (lambda m: m["files"][ck.MODEL_FILE].update(sha256="0" * 64), "does not match its sha256"),
    ],
)
def test_find_latest_skips_a_damaged_marker(tmp_path: Path, caplog, damage, reason) -> None:
    good = _save(tmp_path, 10, keep=5)
    damaged = _save(tmp_path, 20, keep=5)
    _set_marker(damaged, damage)
    with caplog.at_level(logging.WARNING, logger="kd"):
        assert ck.find_latest_checkpoint(tmp_path) == good
    assert f"skipping checkpoint {damaged}: " in caplog.text and reason in caplog.text


def test_find_latest_skips_a_marker_that_is_not_text(tmp_path: Path, caplog) -> None:
    good = _save(tmp_path, 10, keep=5)
    (_save(tmp_path, 20, keep=5) / ck.MARKER_FILE).write_bytes(b"\xff\xfe{")
    with caplog.at_level(logging.WARNING, logger="kd"):
        assert ck.find_latest_checkpoint(tmp_path) == good
    assert "kd_checkpoint.json is unreadable (UnicodeDecodeError" in caplog.text


def test_disk_full_message_names_the_checkpoint_kept(tmp_path: Path) -> None:
    def full(dest: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(KDUserError, match="no earlier checkpoint was touched"):
        _save(tmp_path, 10, write_model=full)
    _save(tmp_path, 10)
    with pytest.raises(KDUserError) as raised:
        _save(tmp_path, 20, write_model=full, state=False)  # the final save
    message = str(raised.value)
    assert message.startswith(f"output_dir: could not write checkpoint {tmp_path / 'final'}: ")
    assert message.endswith(
        "(the earlier checkpoints are kept; the newest, step_000010, resumes with "
        "resume_from_checkpoint=true)"
    )
    assert "\n" not in message


def test_read_only_file_system_is_a_user_error(tmp_path: Path) -> None:
    def read_only(dest: Path) -> None:
        raise RuntimeError("Error while serializing: I/O error: Read-only file system")

    with pytest.raises(KDUserError, match="Read-only file system; free disk space"):
        _save(tmp_path, 10, write_model=read_only)


@pytest.mark.parametrize("state", [[1, 2], "text", 3])
def test_load_recipe_state_rejects_what_is_not_a_dict(tmp_path: Path, state) -> None:
    torch.save(state, tmp_path / ck.RECIPE_STATE_FILE)
    with pytest.raises(KDUserError, match=rf"holds a {type(state).__name__}, not a recipe state"):
        ck.load_recipe_state(tmp_path)


def _tiny_folder(kind: str, dest: Path) -> Path:
    return write_tiny_model(dest, _tiny_shape(kind), seed=0)


def _edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


HEAD_DIM = HIDDEN // HEADS


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_hf_config_that_describes_its_weights_has_no_problems(kind: str, tmp_path: Path) -> None:
    folder = _tiny_folder(kind, tmp_path / kind)
    shapes = ck.safetensors_shapes([folder / ck.MODEL_FILE])
    assert shapes["model.embed_tokens.weight"] == (VOCAB, HIDDEN)
    assert ("lm_head.weight" in shapes) == (kind == "llama")
    heads = (HEADS, KV_HEADS, HEAD_DIM)
    assert ck.hf_config_problems(folder, shapes, key="checkpointer", heads=heads) == []
    assert ck.hf_config_problems(folder, shapes, key="checkpointer") == []


@pytest.mark.parametrize(
    ("kind", "fields", "needle"),
    [
        ("qwen2", {"vocab_size": 300}, "vocab_size=300 but the weights have 256 (rows of"),
        ("qwen2", {"hidden_size": 64}, "hidden_size=64 but the weights have 32 (columns of"),
        ("llama", {"num_hidden_layers": 3}, "num_hidden_layers=3 but the weights have 2"),
        ("llama", {"intermediate_size": 32}, "intermediate_size=32 but the weights have 64"),
        ("qwen2", {"num_attention_heads": 8}, "num_attention_heads=8 but the weights have 4"),
        ("llama", {"num_key_value_heads": 4}, "num_key_value_heads=4 but the weights have 2"),
        ("llama", {"head_dim": 4}, "head_dim=4 but the weights have 8"),
        ("llama", {"tie_word_embeddings": True}, "tie_word_embeddings=true but the weights hold"),
        ("qwen2", {"tie_word_embeddings": False}, "tie_word_embeddings=false but the weights have"),
    ],
)
def test_hf_config_contradicting_its_weights(kind, fields, needle, tmp_path: Path) -> None:
    folder = _tiny_folder(kind, tmp_path / kind)
    _edit_config(folder, **fields)
    shapes = ck.safetensors_shapes([folder / ck.MODEL_FILE])
    problems = ck.hf_config_problems(
        folder, shapes, key="teacher_checkpointer", heads=(HEADS, KV_HEADS, HEAD_DIM)
    )
    (problem,) = problems
    assert problem.startswith(
        f"teacher_checkpointer.checkpoint_dir: {folder / 'config.json'} says {needle}"
    )
    field = next(iter(fields))
    assert f"; set {field} to " in problem and "\n" not in problem


def test_hf_config_heads_without_the_builder(tmp_path: Path) -> None:
    """The projections fix only heads x head_dim: without the builder a wrong head count is still
    caught (through the kv rows it implies)."""
    folder = _tiny_folder("llama", tmp_path / "llama")
    _edit_config(folder, num_attention_heads=8)  # head_dim 4 by hidden_size / heads
    shapes = ck.safetensors_shapes([folder / ck.MODEL_FILE])
    (problem,) = ck.hf_config_problems(folder, shapes, key="checkpointer")
    assert "num_key_value_heads=2 but the weights have 4" in problem


def test_hf_config_unreadable_headers_and_configs(tmp_path: Path) -> None:
    folder = _tiny_folder("qwen2", tmp_path / "qwen2")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes((folder / ck.MODEL_FILE).read_bytes()[:50])
    assert ck.safetensors_shapes([broken]) is None
    assert ck.safetensors_shapes([tmp_path / "absent.safetensors"]) is None
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(KDUserError, match="holds a JSON list, not an object"):
        ck.hf_config_problems(folder, {}, key="checkpointer")


def test_checkpoint_config_problems_reads_the_checkpointers_files(tmp_path: Path) -> None:
    folder = _tiny_folder("llama", tmp_path / "llama")
    heads = (HEADS, KV_HEADS, HEAD_DIM)
    assert ck.checkpoint_config_problems(str(folder), [ck.MODEL_FILE], key="checkpointer") == []
    _edit_config(folder, num_hidden_layers=3)
    (problem,) = ck.checkpoint_config_problems(
        str(folder), ck.MODEL_FILE, key="teacher_checkpointer", heads=heads
    )
    assert problem.startswith(
        f"teacher_checkpointer.checkpoint_dir: {folder / 'config.json'} says num_hidden_layers=3"
    )
    # torchtune's {filename_format, max_filename} names the files too.
    (folder / ck.MODEL_FILE).rename(folder / "model-00001-of-00001.safetensors")
    sharded = {"filename_format": "model-{}-of-{}.safetensors", "max_filename": "00001"}
    assert len(ck.checkpoint_config_problems(str(folder), sharded, key="checkpointer")) == 1
    # Nothing to read: the config check and the weight load report it.
    assert ck.checkpoint_config_problems(None, sharded, key="checkpointer") == []
    assert ck.checkpoint_config_problems(str(folder), None, key="checkpointer") == []
    assert ck.checkpoint_config_problems(str(folder), ["model.bin"], key="checkpointer") == []
    assert ck.checkpoint_config_problems(str(folder), [ck.MODEL_FILE], key="checkpointer") == []


@pytest.mark.parametrize(
    ("step", "epoch", "fits"),
    [(0, 0, True), (4, 1, True), (6, 1, True), (7, 1, False), (2, 1, False)],
)
def test_check_resume_position(tmp_path: Path, step: int, epoch: int, fits: bool) -> None:
    (tmp_path / ck.MARKER_FILE).write_text(json.dumps({"step": step, "epoch": epoch}))
    if fits:
        ck.check_resume_position(tmp_path, steps_per_epoch=3)
        return
    with pytest.raises(KDUserError) as e:
        ck.check_resume_position(tmp_path, steps_per_epoch=3)
    assert str(e.value) == (
        f"max_steps_per_epoch: the checkpoint is at step {step} in epoch {epoch}, which does not "
        "fit epochs of 3 steps; resume with the max_steps_per_epoch the run started with"
    )


def test_restore_training_checkpoint_blames_a_damaged_state_on_the_checkpoint(
    tmp_path: Path, monkeypatch
) -> None:
    from kd.runtime import checkpoints as training
    from kd.runtime.distributed import WorldInfo

    ckpt = tmp_path / "step_000004"
    args = dict(
        student=torch.nn.Linear(2, 2),
        optimizer=None,
        lr_scheduler=None,
        source=training.StudentSource("QWEN2", tmp_path, None),
        world=WorldInfo(world_size=1, rank=0, local_rank=0),
    )

    def raising(error: BaseException):
        def restore(*a, **k):
            raise error

        return restore

    monkeypatch.setattr(training, "_restore", raising(RuntimeError("size mismatch for w")))
    with pytest.raises(KDUserError) as e:
        training.restore_training_checkpoint(ckpt, **args)
    assert str(e.value) == (
        f"resume_from_checkpoint: cannot restore {ckpt} (RuntimeError: size mismatch for w); "
        "delete step_000004 to resume from an older checkpoint"
    )
    for passes in (KDUserError("its own line"), torch.OutOfMemoryError("CUDA out of memory")):
        monkeypatch.setattr(training, "_restore", raising(passes))
        with pytest.raises(type(passes)) as e:
            training.restore_training_checkpoint(ckpt, **args)
        assert e.value is passes


def test_a_key_added_by_a_newer_kd_resumes_at_its_default() -> None:
    # A checkpoint written before a key existed has no entry for it: at its declared default
    # the key is the behaviour the checkpoint trained with, so the run resumes; any other value
    # changes training and is refused, naming the default.
    from kd.config import schema

    assert schema.TOP_LEVEL["teacher_quantization"].default == "none"
    assert "teacher_quantization" not in BASE_CFG
    ck.check_resume_compatible(BASE_CFG, BASE_CFG + "teacher_quantization: none\n")
    with pytest.raises(
        KDUserError, match=r"^teacher_quantization: 'none' in the checkpoint, 'int8'"
    ):
        ck.check_resume_compatible(BASE_CFG, BASE_CFG + "teacher_quantization: int8\n")
