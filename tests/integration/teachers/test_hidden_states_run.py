"""Hidden-state distillation through ``kd run kd``, ``kd validate`` and ``kd init``: the hidden
loss is logged and validated, the width projections are trained, saved in step checkpoints,
restored bit-exactly on resume and never exported; stored logits and bad maps are refused in one
line; kd init proposes the map of a pruned student."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kd import checkpoint, cli
from kd.checkpoint.recipe_state import load_recipe_state
from tests.conftest import make_config, read_metrics, run_kd, sigterm_at_step, write_config

HIDDEN = {"layer_map": ["embed:embed", "0:0", "1:1", "norm:norm"], "loss": "cosine", "weight": 1.0}


def _config(assets, out: Path, **top) -> dict:
    base = dict(
        hidden_states=dict(HIDDEN),
        max_steps_per_epoch=4,
        save_every_n_steps=2,
        shuffle=True,
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 1,
        },
        validation={
            "dataset": {
                "_component_": "torchtune.datasets.instruct_dataset",
                "source": "json",
                "data_files": str(assets["data"]),
                "split": "train",
            },
            "every_n_steps": 2,
            "max_batches": 2,
        },
    )
    base.update(top)
    return make_config(assets, out, **base)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hidden_ref")
    out = root / "run"
    assert run_kd(write_config(root / "cfg.yaml", _config(assets, out))) == 0
    return out


def test_hidden_loss_logged_trained_and_not_exported(assets, reference):
    rows = read_metrics(reference)
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == 4
    for r in train_rows:
        # loss = (1 - r) CE + r KD + weight * hidden (kd_ratio 0.5, weight 1)
        want = 0.5 * r["ce_loss"] + 0.5 * r["kd_loss"] + r["hidden_loss"]
        assert r["loss"] == pytest.approx(want, rel=1e-5)
        assert 0 < r["hidden_loss"] < 2  # a cosine distance
    # Training moves the hidden states toward the teacher's: the held-out cosine distance falls
    # at every evaluation (1.010 untrained, 0.955 at step 2, 0.905 at step 4 with lr 1e-3; step 1
    # is the warmup's lr 0), and the last is well below the first step's.
    val = [r["val_hidden_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0] - 0.02
    assert val[-1] < train_rows[0]["hidden_loss"] - 0.05
    assert train_rows[-1]["hidden_loss"] < train_rows[0]["hidden_loss"] - 0.05
    # The projections (student width 32 -> teacher 48) are trained and saved with the resume
    # state; final/ holds exactly the student's weights.
    state = load_recipe_state(reference / "step_000002")
    assert sorted(state["extra"]) == [
        f"{p}.weight" for p in ("0_to_0", "1_to_1", "embed_to_embed", "norm_to_norm")
    ]
    assert state["extra"]["0_to_0.weight"].shape == (48, 32)
    later = load_recipe_state(reference / "step_000004")["extra"]
    assert all(not torch.equal(state["extra"][k], later[k]) for k in later)  # they train
    final = load_file(reference / "final" / "model.safetensors")
    student = load_file(assets["student"] / "model.safetensors")
    assert sorted(final) == sorted(student)


def test_sigterm_then_resume_restores_projections_bit_identical(
    assets, reference, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", _config(assets, out))
    with monkeypatch.context() as m:
        sigterm_at_step(m, 2)
        assert run_kd(config) == 0
    assert checkpoint.read_checkpoint_marker(checkpoint.find_latest_checkpoint(out))["step"] == 2
    assert run_kd(config, "resume_from_checkpoint=true") == 0
    a = load_file(reference / "final" / "model.safetensors")
    b = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    untimed = {"tokens_per_second", "time_teacher_s", "time_student_s", "peak_memory_gib"}
    untimed |= {"planned_peak_gib", "val_seconds", "peak_memory_reserved_gib", "device_used_gib"}

    def rows(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in untimed} for r in read_metrics(path)]

    assert rows(out) == rows(reference)


def _validate(config: Path, capsys) -> tuple[int, str]:
    rc = cli.main(["validate", "--config", str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, "\n".join(err)


def test_stored_logits_or_no_teacher_refused(assets, tmp_path, capsys):
    cfg = _config(assets, tmp_path / "a", teacher_logits={"path": str(tmp_path / "store")})
    rc, err = _validate(write_config(tmp_path / "a.yaml", cfg), capsys)
    assert rc == 2
    assert "hidden_states" in err and "teacher_logits" in err and "Traceback" not in err
    cfg = _config(
        assets, tmp_path / "b", teacher_model=None, teacher_checkpointer=None, kd_ratio=0.0
    )
    rc, err = _validate(write_config(tmp_path / "b.yaml", cfg), capsys)
    assert rc == 2 and "hidden_states: needs a teacher, but teacher_model is null" in err


def test_layer_map_beyond_the_models_refused_before_loading(assets, tmp_path, capsys):
    cfg = _config(assets, tmp_path / "run")
    cfg["hidden_states"]["layer_map"] = ["0:0", "1:7"]
    rc, err = _validate(write_config(tmp_path / "cfg.yaml", cfg), capsys)
    assert rc == 2
    errors = [line for line in err.splitlines() if line.startswith("kd: error: ")]
    assert len(errors) == 1
    assert errors[0].startswith("kd: error: hidden_states.layer_map: '1:7' names teacher point '7'")


def test_kd_init_maps_a_pruned_student_to_its_kept_layers(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.conftest import TEACHER, write_hf_qwen2
    from tests.integration.test_scaffold_cli import write_hf_tokenizer

    teacher = write_hf_qwen2(tmp_path / "teacher", {**TEACHER, "layers": 4}, seed=2)
    write_hf_tokenizer(teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in (0, 1, 3))
    pruned = tmp_path / "pruned"
    model.save_pretrained(pruned)
    config = json.loads((pruned / "config.json").read_text())
    config["num_hidden_layers"] = 3
    if "layer_types" in config:
        config["layer_types"] = [config["layer_types"][i] for i in (0, 1, 3)]
    (pruned / "config.json").write_text(json.dumps(config))
    write_hf_tokenizer(pruned)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i} + {i} = {2 * i}"}) + "\n" for i in range(64)))

    def init(student: Path, name: str) -> str:
        argv = ["init", "--teacher", str(teacher), "--student", str(student), "--data", str(data)]
        argv += [
            "--output-dir",
            str(tmp_path / name),
            "--config-out",
            str(tmp_path / f"{name}.yaml"),
        ]
        assert cli.main([*argv, "--max-seq-len", "64", "--device", "cpu"]) == 0
        return (tmp_path / f"{name}.yaml").read_text()

    text = init(pruned, "p")
    assert "#   layer_map: ['embed:embed', '0:0', '1:1', '2:3', 'norm:norm']" in text
    assert "cut from the teacher" in text
    # Uncommented, the block is a valid config that kd validate accepts.
    on = text.replace("# hidden_states:", "hidden_states:").replace("#   layer_", "  layer_")
    on = on.replace("#   loss:", "  loss:").replace("#   weight:", "  weight:")
    assert yaml.safe_load(on)["hidden_states"]["loss"] == "cosine"
    (tmp_path / "on.yaml").write_text(on)
    assert cli.main(["validate", "--config", str(tmp_path / "on.yaml")]) == 0
    # A student not cut from the teacher (other weights): the uniform map.
    other = write_hf_qwen2(tmp_path / "other", {**TEACHER, "layers": 2}, seed=5)
    write_hf_tokenizer(other)
    assert "#   layer_map: ['embed:embed', '0:1', '1:3', 'norm:norm']" in init(other, "o")


def _short(assets, out: Path, **top) -> dict:
    return make_config(assets, out, hidden_states=dict(HIDDEN), max_steps_per_epoch=2, **top)


def test_both_backends_agree_and_lora_students_train(assets, tmp_path):
    """The same models on torchtune and transformers give the same hidden loss (the hooks find
    the embedding, the layers and the final norm of both), and LoRA students of both backends
    train with it (only the adapters and projections change)."""
    from tests.integration.test_hf_backend import hf_config

    tt_out, hf_out = tmp_path / "tt", tmp_path / "hf"
    cfg = hf_config(
        assets,
        tt_out,
        student="tt",
        teacher="tt",
        hidden_states=dict(HIDDEN),
        max_steps_per_epoch=2,
    )
    assert run_kd(write_config(tmp_path / "tt.yaml", cfg)) == 0
    cfg = hf_config(assets, hf_out, hidden_states=dict(HIDDEN), max_steps_per_epoch=2)
    assert run_kd(write_config(tmp_path / "hf.yaml", cfg)) == 0
    for a, b in zip(read_metrics(tt_out), read_metrics(hf_out), strict=True):
        for key in ("loss", "ce_loss", "kd_loss", "hidden_loss"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), (a["step"], key)
    for name, cfg in (
        ("tt_lora", _short(assets, tmp_path / "tt_lora", lora=True)),
        (
            "hf_lora",
            hf_config(
                assets,
                tmp_path / "hf_lora",
                lora=True,
                hidden_states=dict(HIDDEN),
                max_steps_per_epoch=2,
            ),
        ),
    ):
        assert run_kd(write_config(tmp_path / f"{name}.yaml", cfg)) == 0, name
        rows = read_metrics(tmp_path / name)
        assert all(0 < r["hidden_loss"] < 2 for r in rows if "loss" in r), name
        assert (tmp_path / name / "final" / "adapter").is_dir(), name
