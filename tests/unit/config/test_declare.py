"""kd.config.declare: a config key is one declaration; the schema tables and the RunConfig are
derived from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kd.config import load_config, schema, validate_config
from kd.config.declare import (
    MAY_CHANGE,
    MISSING,
    Key,
    build,
    declared_keys,
    derived,
    group,
    setting,
    settings,
)
from kd.config.on_policy_settings import OnPolicySettings
from kd.config.parse import fill_defaults
from kd.config.run import LossSettings, RunConfig, run_config
from kd.config.teacher_kinds.store import TeacherLogitsSettings
from tests.unit.test_config import tiny_config, write


def test_each_declared_key_is_in_the_schema_tables():
    for dotted, key in declared_keys(RunConfig).items():
        head, _, sub = dotted.partition(".")
        if not sub:
            found = schema.TOP_LEVEL[dotted]
        elif head in schema.SECTIONS:
            found = schema.SECTIONS[head][sub]
        else:
            found = schema.COMPONENT_ARGS[dotted]
        assert found == key, dotted


def test_types_and_nullability_come_from_the_annotation():
    assert schema.TOP_LEVEL["kd_ratio"].types == (int, float)
    assert schema.TOP_LEVEL["batch_size"].types == (int,)
    assert schema.TOP_LEVEL["seed"].nullable and not schema.TOP_LEVEL["batch_size"].nullable
    assert schema.SECTIONS["teacher_logits"]["path"].types == (str,)  # a Path field reads a string
    assert schema.COMPONENT_ARGS["model.lora_attn_modules"].types == (list,)
    # required inside its section, None in the RunConfig without the section
    assert not schema.EARLY_STOPPING["patience"].nullable
    assert schema.EARLY_STOPPING["patience"].default is MISSING


def test_section_defaults_are_their_keys_defaults():
    """A section's default (merged when the YAML leaves it out) is built from its keys."""
    assert schema.TOP_LEVEL["kd_loss"].default == {
        "divergence": "forward_kl",
        "beta": 0.5,
        "skew_alpha": 0.1,
    }
    assert schema.TOP_LEVEL["memory"].default == {
        k: key.default for k, key in schema.MEMORY.items()
    }
    assert schema.TOP_LEVEL["validation"].default is None


def test_dataclass_defaults_are_the_key_defaults():
    """LossSettings() and OnPolicySettings() (tests and tracers build them by hand) have the
    config's defaults: one place."""
    loss = LossSettings()
    assert loss.kd_ratio == schema.TOP_LEVEL["kd_ratio"].default
    assert loss.divergence == schema.KD_LOSS["divergence"].default
    assert loss.chunk_size == schema.TOP_LEVEL["loss_chunk_size"].default
    assert loss.topk_tail == schema.SECTIONS["teacher_logits"]["tail"].default
    on_policy = OnPolicySettings()
    for name, key in schema.ON_POLICY.items():
        assert getattr(on_policy, name) == key.default


def test_run_config_reads_each_declared_key(tmp_path: Path):
    cfg = load_config(
        write(tmp_path / "c.yaml", tiny_config(tmp_path)),
        [
            "kd_ratio=0.25",
            "kd_loss.divergence=jsd",
            "loss_chunk_size=7",
            "gradient_accumulation_steps=3",
            "enable_activation_checkpointing=true",
            "memory.seq_len=16",
            "fsdp.reduce_dtype=bf16",
            "validation.dataset=${dataset}",
            "validation.every_n_steps=2",
            "keep_best={metric: val_top1_agreement}",
            "early_stopping={patience: 3}",
            "on_policy={lmbda: 1, max_new_tokens: 8}",
        ],
    )
    validate_config(cfg, check_components=False)
    run = run_config(cfg)
    assert run.loss.kd_ratio == 0.25 and isinstance(run.loss.kd_ratio, float)
    assert run.loss.divergence == "jsd" and run.loss.chunk_size == 7
    assert run.optimizer.grad_accum == 3 and run.activation_checkpointing is True
    assert (run.memory.seq_len, run.memory.seq_len_source) == (16, "memory.seq_len")
    assert run.fsdp.reduce_dtype == "bf16"
    assert run.validation is not None
    assert (run.validation.every_n_steps, run.validation.batch_size) == (2, run.batch_size)
    assert (run.validation.metric, run.validation.mode) == ("val_top1_agreement", "max")
    assert run.validation.keep_best and run.validation.patience == 3
    assert run.on_policy == OnPolicySettings(lmbda=1.0, max_new_tokens=8)
    assert run.teacher_logits is None and run.lora is None
    assert run.checkpoint.output_dir == tmp_path / "out"


def test_a_lora_builder_without_its_optional_arguments_uses_the_defaults(tmp_path: Path):
    """A lora_* builder's rank and alpha default as torchtune's builders do (no crash)."""
    cfg = OmegaConf.create({"model": {"_component_": "kd.hf.lora_causal_lm", "path": "x"}})
    fill_defaults(cfg)
    lora = run_config(cfg).lora
    assert lora is not None
    assert (lora.rank, lora.alpha, lora.attn_modules) == (8, 16.0, ("q_proj", "v_proj"))


@settings
class _Extra:
    """Some feature."""

    knob: float = setting("extra.knob", 0.5, "a knob", min=0.0, max=1.0, resume=MAY_CHANGE)
    label: str = derived(lambda cfg: "x")


@settings
class _Holder:
    """Holds _Extra."""

    extra: _Extra | None = group(lambda cfg: cfg.get("extra") is not None)


def test_adding_a_key_is_one_declaration():
    """A field declared with setting() is a checked key and a typed attribute at once."""
    keys = declared_keys(_Holder)
    assert keys == {
        "extra.knob": Key(0.5, (int, float), "a knob", min=0.0, max=1.0, resume=MAY_CHANGE)
    }
    built = build(_Holder, OmegaConf.create({"extra": {"knob": 1}}))
    assert built.extra == _Extra(knob=1.0, label="x") and isinstance(built.extra.knob, float)
    assert build(_Holder, OmegaConf.create({"extra": None})).extra is None
    assert "``extra.knob``: a knob" in (_Extra.__doc__ or "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        _Extra(label="y").knob = 2.0  # type: ignore[misc]


def test_divergences_are_one_list():
    import kd.losses

    assert kd.losses.DIVERGENCES is schema.DIVERGENCES
    assert schema.KD_LOSS["divergence"].choices == schema.DIVERGENCES


def test_teacher_logits_settings_keep_their_fields():
    fields = [f.name for f in dataclasses.fields(TeacherLogitsSettings)]
    assert fields == [
        "path",
        "k",
        "tail",
        "format",
        "source_temperature",
        "alignment",
        "rows_per_shard",
    ]
