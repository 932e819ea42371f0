"""The memory planner's cross-tokenizer loss (``cross_tokenizer:``): GOLD's aligned hybrid loss
on the student's full logits, not the fused head. The estimate (:func:`kd.memory.loss_head.
cross_loss_bytes`) against the real loss traced under FakeTensorMode (``kd plan --trace``:
:class:`kd.memory.fake_cross.FakeCrossTeacher` runs :class:`kd.teachers.cross.CrossTokenizerSignal`
on the planner's rows), on tiny transformers pairs whose vocabularies differ both ways."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kd.memory import loss_head
from kd.memory.estimate import estimate

SMALL = dict(  # Qwen3, vocabulary 1000
    vocab_size=1000,
    hidden_size=96,
    intermediate_size=224,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=40,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
LARGE = dict(  # Llama, vocabulary 1500
    vocab_size=1500,
    hidden_size=120,
    intermediate_size=224,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    import transformers

    root = tmp_path_factory.mktemp("cross_configs")
    transformers.Qwen3Config(**SMALL).save_pretrained(root / "small")
    transformers.LlamaConfig(**LARGE).save_pretrained(root / "large")
    return {"small": root / "small", "large": root / "large"}


def _cfg(student: Path, teacher: Path, **over):
    from kd.config.parse import fill_defaults

    cfg = OmegaConf.create(
        {
            "model": {"_component_": "kd.hf.causal_lm", "path": str(student)},
            "teacher_model": {"_component_": "kd.hf.causal_lm", "path": str(teacher)},
            "cross_tokenizer": {"matched_weight": None},
            "kd_ratio": 0.5,
            "tokenizer": {"max_seq_len": 48},
            "batch_size": 3,
            "gradient_accumulation_steps": 1,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
            "enable_activation_checkpointing": False,
        }
    )
    for key, value in over.items():
        cfg[key] = value
    fill_defaults(cfg)
    return cfg


def _compare(cfg) -> dict[str, float]:
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    run = run_config(cfg)
    traced = trace_run(run).phase_peaks
    inputs = inputs_from_run(run)
    est = estimate(inputs.student, inputs.teacher, replace(inputs.knobs, select_labelled=False))
    assert any("cross_tokenizer: planned with" in n for n in est.notes)
    return {p: est.allocated(p) / traced[p] for p in ("forward", "backward", "optimizer_step")}


@pytest.mark.parametrize(
    "student,teacher,divergence,lora",
    [
        ("small", "large", "forward_kl", False),
        ("large", "small", "jsd", False),
        ("small", "large", "skew_reverse_kl", True),
    ],
)
def test_cross_loss_estimate_within_3_percent_of_trace(pair, student, teacher, divergence, lora):
    """The planner's own choice of the shared vocabulary, both directions of vocabulary size,
    full and LoRA students."""
    over: dict = {"kd_loss": {"divergence": divergence}}
    if lora:
        over["model"] = {
            "_component_": "kd.hf.lora_causal_lm",
            "path": str(pair[student]),
            "lora_attn_modules": ["q_proj", "v_proj"],
            "lora_rank": 8,
            "lora_alpha": 16,
        }
    ratios = _compare(_cfg(pair[student], pair[teacher], **over))
    for phase, ratio in ratios.items():
        assert ratio == pytest.approx(1.0, abs=0.03), (phase, ratios)


@pytest.mark.parametrize(
    "end,divergence",
    [("none", "forward_kl")] + [("all", d) for d in sorted(loss_head._CROSS_MATCHED)],
)
def test_each_end_of_the_shared_vocabulary(pair, monkeypatch, end, divergence):
    """Both ends the planner weighs (no token string shared: ULD's sorted distance alone,
    whatever the divergence; the smaller vocabulary shared: each divergence alone), traced with
    the same count."""
    monkeypatch.setattr(loss_head, "cross_matched", lambda s, t, k: 0 if end == "none" else 1000)
    cfg = _cfg(pair["small"], pair["large"], kd_loss={"divergence": divergence}, dtype="fp32")
    ratios = _compare(cfg)
    for phase, ratio in ratios.items():
        assert ratio == pytest.approx(1.0, abs=0.03), (phase, ratios)


def test_cross_loss_costs_more_than_the_fused_head(pair):
    """The same pair without cross_tokenizer plans the fused head: the cross run's forward and
    backward are larger by the full logits the hybrid loss keeps."""
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run

    def allocated(cfg) -> dict[str, int]:
        inputs = inputs_from_run(run_config(cfg))
        est = estimate(inputs.student, inputs.teacher, inputs.knobs)
        return {p: est.allocated(p) for p in ("forward", "backward")}

    cross = allocated(_cfg(pair["small"], pair["large"]))
    plain = _cfg(pair["small"], pair["large"])
    del plain["cross_tokenizer"]
    fused = allocated(plain)
    n, vs = 3 * 48, 1000
    for phase in ("forward", "backward"):
        assert cross[phase] - fused[phase] > 8 * n * vs, phase  # >= two fp32 [N, Vs] kept


def test_kd_plan_trace_of_a_cross_config(pair, tmp_path, capsys):
    """Through the CLI: ``kd plan --trace --json`` of a cross-tokenizer config."""
    from kd import cli
    from kd.testing import hf_tokenizer_node, write_hf_tokenizer, write_jsonl

    cfg = _cfg(pair["small"], pair["large"])
    cfg.tokenizer = hf_tokenizer_node(write_hf_tokenizer(tmp_path / "tok"), 48)
    cfg.output_dir = str(tmp_path / "out")
    data = write_jsonl(tmp_path / "train.jsonl", [{"input": "1+1", "output": "2"}] * 4)
    cfg.dataset = {
        "_component_": "torchtune.datasets.instruct_dataset",
        "source": "json",
        "data_files": str(data),
        "split": "train",
    }
    path = tmp_path / "cross.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    assert cli.main(["plan", "--config", str(path), "--json", "--trace"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["traced_peak_gib"] == pytest.approx(out["peak_gib"], rel=0.03)
    assert any("cross_tokenizer" in note for note in out["notes"]), out["notes"]


@pytest.mark.slow
def test_real_size_cross_pair_within_3_percent(tmp_path):
    """Qwen3-8B teaching Llama-3.2-1B (vocabularies 151936 and 128256) at published sizes, 4096
    tokens with checkpointing: the estimate within 3% of the traced step, every phase."""
    from kd.memory.hf_accuracy import Setting, compare

    row = compare(
        "Qwen3-8B",
        "Llama-3.2-1B",
        Setting(lora=False, ac=True, batch_size=1, seq_len=4096),
        root=tmp_path,
        cross=True,
    )
    for phase in row.trace:
        assert row.phase_ratio(phase) == pytest.approx(1.0, abs=0.03), phase


def _members(cfg, members: list[dict]):
    """``cfg`` with ``teachers: {combine: weights}`` in place of its one-teacher keys."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    for key in ("teacher_model", "cross_tokenizer"):
        cfg.pop(key, None)
    cfg.teachers = {"combine": "weights", "members": members}
    return cfg


def _member(name: str, folder: Path, cross: bool) -> dict:
    entry: dict = {"name": name, "teacher_model": {"_component_": "kd.hf.causal_lm"}}
    entry["teacher_model"]["path"] = str(folder)
    if cross:
        entry["cross_tokenizer"] = {"matched_weight": None}
    return entry


def _planned(cfg):
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run

    inputs = inputs_from_run(run_config(cfg))
    return inputs, estimate(inputs.student, inputs.teacher, inputs.knobs)


def test_a_cross_member_plans_as_the_one_teacher_cross_run(pair):
    """``teachers:`` with one member that has another tokenizer plans every phase exactly as the
    one-teacher cross-tokenizer config."""
    one = _planned(_cfg(pair["small"], pair["large"]))[1]
    inputs, member = _planned(
        _members(_cfg(pair["small"], pair["large"]), [_member("llama", pair["large"], True)])
    )
    assert inputs.knobs.cross_tokenizer and inputs.knobs.cross_vocab is None
    for phase in ("forward", "backward", "optimizer_step"):
        assert member.allocated(phase) == one.allocated(phase), phase


def test_a_smaller_cross_member_beside_a_larger_teacher(pair, tmp_path):
    """A larger same-tokenizer member is planned as the teacher (its forward, its weights) and the
    smaller member's cross-tokenizer loss (its 1500 ids) as the loss head: the plan is the one
    of the larger teacher with cross_tokenizer over 1500 ids plus the cross member's weights."""
    import transformers

    big = tmp_path / "big"
    transformers.Qwen3Config(
        **{**SMALL, "num_hidden_layers": 6, "hidden_size": 192}
    ).save_pretrained(big)
    cfg = _cfg(pair["small"], big)
    members = [_member("qwen", big, False), _member("llama", pair["large"], True)]
    inputs, est = _planned(_members(cfg, members))
    assert inputs.teacher.vocab_size == 1000 and inputs.knobs.cross_vocab == 1500
    assert any("teachers llama: its cross-tokenizer loss (1500 ids)" in n for n in inputs.notes)
    # the reference: the big teacher alone, its loss head built over the cross member's vocabulary
    ref_teacher = replace(inputs.teacher, vocab_size=1500)
    ref_knobs = replace(inputs.knobs, cross_vocab=None)
    head = loss_head.loss_head(inputs.student, ref_teacher, ref_knobs, output_grad=0)
    assert head == loss_head.loss_head(inputs.student, inputs.teacher, inputs.knobs, output_grad=0)
    assert any("cross_tokenizer: planned" in n for n in head.notes)
    without = _planned(
        _members(cfg, [_member("qwen", big, False), _member("llama", pair["large"], False)])
    )
    for phase in ("forward", "backward"):
        assert est.allocated(phase) > without[1].allocated(phase), phase
    assert inputs.knobs.other_teacher_params == without[0].knobs.other_teacher_params > 0


def _store_cfg(pair, folder: Path, **over):
    """A run from a cross-tokenizer store: ``teacher_logits`` (k 8) with ``cross_tokenizer``, the
    teacher named by ``teacher_model`` (its size read from its config; no weights loaded)."""
    cfg = _cfg(pair["small"], pair["large"], **over)
    cfg.teacher_logits = {"path": str(folder), "k": 8}
    return cfg


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_a_cross_tokenizer_store_within_3_percent_of_trace(pair, tmp_path, divergence):
    """Training from a cross-tokenizer store: no teacher forward, every row's dense fp32 log-probs
    over the teacher's 1500 ids made before the loss, not the plain store's top-k tensors."""
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run

    cfg = _store_cfg(pair, tmp_path / "store", kd_loss={"divergence": divergence})
    inputs = inputs_from_run(run_config(cfg))
    assert inputs.teacher is None and inputs.knobs.stored_topk == 8
    assert inputs.knobs.cross_tokenizer and inputs.knobs.cross_vocab == 1500
    ratios = _compare(cfg)
    for phase, ratio in ratios.items():
        assert ratio == pytest.approx(1.0, abs=0.03), (phase, ratios)
    live = _planned(_cfg(pair["small"], pair["large"], kd_loss={"divergence": divergence}))[1]
    stored = estimate(inputs.student, None, inputs.knobs)
    # the dense rows of the whole micro-batch, against the live teacher's one row at a time
    assert stored.allocated("forward") < live.allocated("forward")  # no teacher weights


def test_a_cross_store_reads_its_teacher_size_from_the_manifest(pair, tmp_path):
    """Without teacher_model the size comes from the store's manifest; with neither, the
    student's, with a note."""
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run

    folder = tmp_path / "store"
    cfg = _store_cfg(pair, folder)
    cfg.teacher_model = None
    inputs = inputs_from_run(run_config(cfg))
    assert inputs.knobs.cross_vocab == 1000
    assert any("holds no cross-tokenizer store yet" in n for n in inputs.notes)
    from kd.teachers import store_manifest, store_writer

    folder.mkdir()
    spec = store_manifest.StoreSpec(
        teacher={"component": "kd.hf.causal_lm", "folder": "t", "files": [], "config_sha256": None},
        config_sha256="0",
        tokenizer_sha256="0",
        temperature=1.0,
        k=8,
        vocab=1234,
        teacher_vocab=1234,
        max_seq_len=48,
        dataset_fingerprint="0",
        num_rows=4,
        world_size=1,
        rows_per_shard=4,
        cross_tokenizer={
            "teacher_size": 1234,
            "teacher_tokenizer_sha256": "0",
            "teacher_vocab": {},
        },
    )
    store_writer.write_manifest(folder, spec, None)  # as the precompute writes it at its start
    assert inputs_from_run(run_config(cfg)).knobs.cross_vocab == 1234


def test_kd_plan_trace_of_a_cross_store_config(pair, tmp_path, capsys):
    """Through the CLI: ``kd plan --trace --json`` of a run from a cross-tokenizer store plans the
    hybrid loss (its note) and matches its trace."""
    from kd import cli
    from kd.testing import hf_tokenizer_node, write_hf_tokenizer, write_jsonl

    cfg = _store_cfg(pair, tmp_path / "store")
    cfg.tokenizer = hf_tokenizer_node(write_hf_tokenizer(tmp_path / "tok"), 48)
    cfg.output_dir = str(tmp_path / "out")
    data = write_jsonl(tmp_path / "train.jsonl", [{"input": "1+1", "output": "2"}] * 4)
    cfg.dataset = {
        "_component_": "torchtune.datasets.instruct_dataset",
        "source": "json",
        "data_files": str(data),
        "split": "train",
    }
    path = tmp_path / "cross_store.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    assert cli.main(["plan", "--config", str(path), "--json", "--trace"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["traced_peak_gib"] == pytest.approx(out["peak_gib"], rel=0.03)
    assert any("cross_tokenizer: planned" in note for note in out["notes"]), out["notes"]
