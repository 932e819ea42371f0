"""The transformers backend (``kd.hf.causal_lm`` / ``kd.hf.lora_causal_lm``) through ``kd run``.

The same tiny checkpoints train through torchtune's builders and through transformers, so every
number the torchtune path is known to get right (losses agree with TRL and torchtune, exact
resume, FSDP2 parity) is checked here against it, or against the HF path's own uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kd import cli
from kd.testing import TinyModel, hf_tokenizer_node, write_tiny_model
from tests.conftest import (
    MAX_SEQ_LEN,
    TEACHER,
    make_config,
    read_metrics,
    run_kd,
    sigterm_at_step,
    tiny_model,
    write_config,
)

COMPARED = ("loss", "ce_loss", "kd_loss", "grad_norm", "lr", "num_tokens")
VAL_COMPARED = ("val_loss", "val_ce_loss", "val_kd_loss", "val_top1_agreement", "val_num_tokens")
TOL = 1e-5


def hf_node(folder: Path, *, lora: bool = False) -> dict:
    if not lora:
        return {"_component_": "kd.hf.causal_lm", "path": str(folder)}
    return {
        "_component_": "kd.hf.lora_causal_lm",
        "path": str(folder),
        "lora_attn_modules": ["q_proj", "v_proj"],
        "apply_lora_to_mlp": True,
        "lora_rank": 4,
        "lora_alpha": 8,
    }


def hf_config(
    assets: dict,
    out: Path,
    *,
    student: str = "hf",
    teacher: str = "hf",
    lora: bool = False,
    **top,
) -> dict:
    """``make_config`` with the student and/or teacher on the transformers backend, and the
    tokenizer read by ``kd.hf.tokenizer`` from its folder."""
    cfg = make_config(assets, out, lora=lora and student == "tt", **top)
    cfg["tokenizer"] = hf_tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN)
    if student == "hf":
        cfg["model"] = hf_node(assets["student"], lora=lora)
        del cfg["checkpointer"]
    if teacher == "hf":
        cfg["teacher_model"] = hf_node(assets["teacher"])
        del cfg["teacher_checkpointer"]
    return cfg


def assert_same_metrics(a: Path, b: Path, tol: float = TOL) -> None:
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb, strict=True):
        for key in COMPARED if "loss" in x else VAL_COMPARED:
            assert y[key] == pytest.approx(x[key], abs=tol, rel=0), (x["step"], key)


@pytest.fixture(scope="module")
def llama_assets(assets, tmp_path_factory) -> dict:
    """Llama-architecture student and teacher (untied), sharing the tiny tokenizer."""
    root = tmp_path_factory.mktemp("llama")
    shape = TinyModel(
        vocab_size=288,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=256,
        tie_word_embeddings=False,
        family="llama",
        rope_base=500_000.0,
    )
    teacher = TinyModel(**{**shape.__dict__, "embed_dim": 48, "intermediate_dim": 96})
    return {
        **assets,
        "student": write_tiny_model(root / "student", shape, seed=11, writer="transformers"),
        "teacher": write_tiny_model(root / "teacher", teacher, seed=12, writer="transformers"),
        "student_shape": shape,
        "teacher_shape": teacher,
    }


def _torchtune_config(assets: dict, out: Path, **top) -> dict:
    """torchtune builders and checkpointers, with the folder tokenizer (kd.hf.tokenizer works with
    either backend; torchtune's Qwen2.5 tokenizer would not pass for Llama models), validated on
    a held-out slice after every step."""
    cfg = make_config(assets, out, **top)
    cfg["tokenizer"] = hf_tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN)
    cfg["validation"] = {
        "dataset": dict(cfg["dataset"]),
        "every_n_steps": 1,
        "max_batches": 2,
        "batch_size": 3,
    }
    if "student_shape" in assets:  # llama: the builders of those shapes
        cfg["model"] = assets["student_shape"].builder()
        cfg["teacher_model"] = assets["teacher_shape"].builder()
        for key, folder in (("checkpointer", "student"), ("teacher_checkpointer", "teacher")):
            cfg[key]["checkpoint_dir"] = str(assets[folder])
            cfg[key]["model_type"] = "LLAMA3"
    return cfg


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("student,teacher", [("hf", "hf"), ("hf", "tt"), ("tt", "hf")])
def test_losses_equal_the_torchtune_backend(
    assets, llama_assets, tmp_path, family, student, teacher
):
    """Same checkpoints, same data: the per-step losses, gradient norms and token counts of a
    transformers (or mixed) run equal the all-torchtune run's."""
    data = assets if family == "qwen2" else llama_assets
    ref = tmp_path / "tt"
    assert run_kd(_torchtune_config(data, ref), tmp_path / "tt.yaml") == 0
    cfg = _torchtune_config(data, tmp_path / "mixed")
    if student == "hf":
        cfg["model"] = hf_node(data["student"])
        del cfg["checkpointer"]
    if teacher == "hf":
        cfg["teacher_model"] = hf_node(data["teacher"])
        del cfg["teacher_checkpointer"]
    assert run_kd(cfg, tmp_path / "mixed.yaml") == 0
    assert_same_metrics(ref, tmp_path / "mixed")
    assert sum("val_loss" in r for r in read_metrics(ref)) == 3  # validation rows were compared


def test_activation_checkpointing_changes_no_number(assets, tmp_path):
    assert run_kd(hf_config(assets, tmp_path / "a"), tmp_path / "a.yaml") == 0
    cfg = hf_config(assets, tmp_path / "b", enable_activation_checkpointing=True)
    assert run_kd(cfg, tmp_path / "b.yaml") == 0
    assert_same_metrics(tmp_path / "a", tmp_path / "b")


def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def test_lora_final_loads_merged_and_as_peft_adapter(assets, tmp_path):
    """final/ loads with AutoModelForCausalLM (LoRA merged) and AutoTokenizer; its adapter/
    loads with peft on the student's base folder; both give the trained model's logits."""
    import peft
    import transformers

    out = tmp_path / "run"
    assert run_kd(hf_config(assets, out, lora=True), tmp_path / "c.yaml") == 0
    final = out / "final"
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(assets["student"], dtype=torch.float32)
    tokens = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    untrained = _hf_logits(base.eval(), tokens)
    adapted = peft.PeftModel.from_pretrained(base, final / "adapter").eval()
    a, b = _hf_logits(merged, tokens), _hf_logits(adapted, tokens)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (a - untrained).abs().max() > 1e-4  # the adapters trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)  # copied with the weights
    assert tokenizer.chat_template and tokenizer("abc")["input_ids"] == [97, 98, 99]
    # kd generate reads both: the merged folder, and the adapter on its base folder.
    from kd.generate import generate

    texts = [
        generate(folder, "12+30=", chat=True, max_new_tokens=5, device="cpu", temperature=0, seed=0)
        for folder in (final, final / "adapter")
    ]
    assert texts[0] == texts[1]
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    # Only the adapters trained: every base weight of final/ but the LoRA targets is the source's.
    source = load_file(assets["student"] / "model.safetensors")
    saved = load_file(final / "model.safetensors")
    for name, value in source.items():
        lora_target = any(t in name for t in ("q_proj", "v_proj", "mlp")) and "weight" in name
        if not lora_target:
            assert torch.equal(saved[name], value), name


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sigterm_then_resume_is_bit_identical(assets, tmp_path, monkeypatch, lora):
    top = dict(
        shuffle=True,
        epochs=2,
        max_steps_per_epoch=3,
        save_every_n_steps=2,
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 2,
        },
        metric_logger={"_component_": "kd.metrics.StdoutLogger"},
    )
    ref = tmp_path / "ref"
    assert run_kd(hf_config(assets, ref, lora=lora, **top), tmp_path / "ref.yaml") == 0
    out = tmp_path / "run"
    config = hf_config(assets, out, lora=lora, **top)
    with monkeypatch.context() as m:
        sigterm_at_step(m, 4)  # in epoch 1: the resumed run restores the data order too
        assert run_kd(config, tmp_path / "run.yaml") == 0
    assert not (out / "final").exists()
    assert run_kd(config, tmp_path / "run.yaml", "resume_from_checkpoint=true") == 0
    a, b = (
        load_file(ref / "final" / "model.safetensors"),
        load_file(out / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_same_metrics(ref, out, tol=0)


def _error_lines(capsys, *argv: str) -> list[str]:
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [ln for ln in err.splitlines() if ln.startswith("kd: error:")]


def test_user_mistakes_are_one_line_each(assets, tmp_path, capsys):
    # A folder that does not exist.
    cfg = hf_config(assets, tmp_path / "o1")
    cfg["model"]["path"] = str(tmp_path / "nowhere")
    lines = _error_lines(
        capsys, "validate", "--config", str(write_config(tmp_path / "1.yaml", cfg))
    )
    assert lines == [
        f"kd: error: model.path: {tmp_path / 'nowhere'} does not exist; point it at a local "
        "Hugging Face model folder (config.json + *.safetensors)"
    ]
    # A checkpointer next to a Hugging Face model.
    cfg = hf_config(assets, tmp_path / "o2")
    cfg["checkpointer"] = make_config(assets, tmp_path / "o2")["checkpointer"]
    lines = _error_lines(
        capsys, "validate", "--config", str(write_config(tmp_path / "2.yaml", cfg))
    )
    assert len(lines) == 1 and "remove checkpointer" in lines[0]
    # config.json only (the weights still downloading): kd validate says what kd run would.
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((assets["student"] / "config.json").read_text())
    cfg = hf_config(assets, tmp_path / "o3")
    cfg["model"]["path"] = str(partial)
    lines = _error_lines(
        capsys, "validate", "--config", str(write_config(tmp_path / "3.yaml", cfg))
    )
    assert len(lines) == 1 and "holds no *.safetensors weights" in lines[0]
    assert "kd run needs the weights" in lines[0]
    # A config.json that contradicts its weights.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((assets["student"] / "model.safetensors").read_bytes())
    config = json.loads((assets["student"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    cfg = hf_config(assets, tmp_path / "o4")
    cfg["model"]["path"] = str(bad)
    lines = _error_lines(
        capsys, "validate", "--config", str(write_config(tmp_path / "4.yaml", cfg))
    )
    assert lines == [
        f"kd: error: model.path: {bad / 'config.json'} says intermediate_size=96 but the weights "
        "have 64 (rows of model.layers.0.mlp.gate_proj.weight); set intermediate_size to 64 in "
        "that file (or restore it from the model's source)"
    ]
    # A LoRA module name the model does not have.
    cfg = hf_config(assets, tmp_path / "o5", lora=True)
    cfg["model"]["lora_attn_modules"] = ["q_proj", "qkv_proj"]
    lines = _error_lines(
        capsys, "validate", "--config", str(write_config(tmp_path / "5.yaml", cfg))
    )
    assert len(lines) == 1 and lines[0].startswith("kd: error: model.lora_attn_modules: 'qkv_proj'")


def test_validate_passes_and_writes_nothing(assets, tmp_path):
    out = tmp_path / "run"
    path = write_config(tmp_path / "c.yaml", hf_config(assets, out, lora=True))
    assert cli.main(["validate", "--config", str(path)]) == 0
    assert not out.exists()


@pytest.mark.parametrize("tied", [True, False])
def test_teacher_with_padded_vocab_and_tied_student(assets, tmp_path, tied):
    """A student tied or not, a teacher with more vocab rows: the run trains and final/ reloads."""
    import transformers

    shape = tiny_model(
        {**dict(vocab=288, hidden=32, inter=64, layers=2, heads=4, kv_heads=2), "tied": tied}
    )
    folder = write_tiny_model(tmp_path / "student", shape, seed=5, writer="transformers")
    cfg = hf_config({**assets, "student": folder}, tmp_path / "run")
    assert TEACHER["vocab"] > shape.vocab_size
    assert run_kd(cfg, tmp_path / "c.yaml") == 0
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert final.config.tie_word_embeddings == tied
    assert (final.lm_head.weight is final.model.embed_tokens.weight) == tied


# ------------------------------------------------------------------ FSDP2 on 2 CPU ranks (slow)
def _pair_hf(assets: dict, root: Path, name: str, *, lora: bool, **top) -> tuple[Path, Path]:
    """One device with batch 8 vs 2 ranks with batch 4 each, accumulation 2: the same global
    batch, launched as a user would (``kd run --nproc_per_node 2``)."""
    from tests.integration.runtime.test_distributed_run import _launch

    one, two = root / f"{name}_1", root / f"{name}_2"
    common = dict(gradient_accumulation_steps=2, lora=lora, save_every_n_steps=2, **top)
    assert run_kd(hf_config(assets, one, batch_size=8, **common), root / f"{name}_1.yaml") == 0
    _launch(write_config(root / f"{name}_2.yaml", hf_config(assets, two, batch_size=4, **common)))
    return one, two


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_two_ranks_match_one_device(assets, tmp_path, lora):
    """Per-decoder-layer FSDP2 of transformers models: the losses and the saved weights of 2
    ranks equal one device's (tied student with activation checkpointing, untied teacher)."""
    from tests.integration.runtime.test_distributed_run import _assert_same_files

    one, two = _pair_hf(assets, tmp_path, "hf", lora=lora, enable_activation_checkpointing=True)
    assert_same_metrics(one, two)
    _assert_same_files(one / "final", two / "final")
    _assert_same_files(one / "step_000002", two / "step_000002")
    if lora:
        _assert_same_files(one / "final", two / "final", "adapter/adapter_model.safetensors")


def test_teacher_with_another_tokenizer_is_refused(assets, tmp_path, capsys):
    """A Hugging Face teacher whose own tokenizer maps text to other ids than the run's tokenizer
    is refused before loading (KD would compare ids that mean different text)."""
    import shutil

    from tests.integration.test_scaffold_cli import write_hf_tokenizer as write_variant_tokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(assets["teacher"], teacher)
    write_variant_tokenizer(teacher, merges=True)  # "He" is one token: ids differ from the run's
    cfg = hf_config({**assets, "teacher": teacher}, tmp_path / "out")
    lines = _error_lines(
        capsys, "validate", "--config", str(write_config(tmp_path / "c.yaml", cfg))
    )
    assert len(lines) == 1 and lines[0].startswith("kd: error: tokenizers differ: the teacher")
    # The same teacher folder with the run's tokenizer files passes.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(assets["tokenizer"] / name, teacher / name)
    assert cli.main(["validate", "--config", str(tmp_path / "c.yaml")]) == 0


@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("max_position_embeddings", "abc", "max_position_embeddings is 'abc', not a whole number"),
        ("rope_scaling", "garbage", "rope_scaling"),
        ("hidden_size", -3, "hidden_size is -3, not a whole number"),
    ],
)
def test_a_bad_config_json_field_is_named_in_that_file(
    assets, tmp_path, capsys, command, field, value, said
):
    """`kd validate` and `kd plan` name the field of the model's config.json and say to fix it
    there: not a tokenizer or builder problem (issue 23)."""
    import json
    import shutil

    folder = tmp_path / "student"
    shutil.copytree(assets["student"], folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    cfg = hf_config(assets, tmp_path / "out")
    cfg["model"]["path"] = str(folder)
    lines = _error_lines(capsys, command, "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kd: error: model.path: {folder / 'config.json'}: "), lines
    assert said in lines[0] and "in that file" in lines[0], lines
    assert "tokenizer" not in lines[0] and "torchtune builder" not in lines[0], lines
