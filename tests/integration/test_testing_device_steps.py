"""Every kind of step ``kd run kd`` takes on a GPU, run on the fake accelerator in CI.

Each case writes a real config (``device: cuda``, bf16) and runs the recipe's own preload, load,
one optimizer step (two micro-batches: forward, loss, backward; clip, optimizer step, scheduler)
and, with validation, one validation pass on :mod:`kd.memory.fake_device`
(:func:`kd.testing_device.fake_device_step`): a tensor left on the CPU where the device needed it
raises ``FakeTensorDeviceMismatchError`` and fails the case.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kd.memory.fake_device import FAKE_DEVICE
from kd.testing import hf_tokenizer_node, write_jsonl
from kd.testing_device import fake_device_step
from kd.testing_server import TeacherTestServer
from tests.conftest import (
    FAKE_ACCELERATOR,
    MAX_SEQ_LEN,
    TEACHER,
    builder,
    checkpointer_node,
    make_config,
    write_config,
    write_hf_qwen2,
)
from tests.integration.teachers.test_cross_run import letter_data, other_tok_teacher  # noqa: F401 (fixtures)
from tests.integration.teachers.test_foreign_store_run import T_GEN, K, foreign, kd_store  # noqa: F401 (fixtures)
from tests.integration.teachers.test_served_teacher import teacher_fn, tokenizer  # noqa: F401 (fixtures)

pytestmark = FAKE_ACCELERATOR

COSINE = {
    "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "num_warmup_steps": 1,
}
LORA = dict(
    lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8
)


def gpu_config(assets: dict, out: Path, *, lora: bool = False, **top: Any) -> dict:
    """The tiny run as on a GPU: cuda, bf16, clipped, a cosine schedule, 2 micro-batches of 2."""
    settings: dict[str, Any] = dict(
        device="cuda",
        dtype="bf16",
        batch_size=2,
        gradient_accumulation_steps=2,
        clip_grad_norm=1.0,
        lr_scheduler=COSINE,
        max_steps_per_epoch=2,
    )
    settings.update(top)
    return make_config(assets, out, lora=lora, **settings)


def hf_node(folder: Path, *, lora: bool = False) -> dict:
    """A transformers-backend model node (``kd.hf``)."""
    if not lora:
        return {"_component_": "kd.hf.causal_lm", "path": str(folder)}
    return {"_component_": "kd.hf.lora_causal_lm", "path": str(folder), **LORA}


def on_transformers(cfg: dict, assets: dict, *, student: bool, teacher: bool, lora: bool) -> dict:
    """``cfg`` with the student and/or teacher on the transformers backend."""
    cfg["tokenizer"] = hf_tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN)
    if student:
        cfg["model"] = hf_node(assets["student"], lora=lora)
        del cfg["checkpointer"]
    if teacher:
        cfg["teacher_model"] = hf_node(assets["teacher"])
        del cfg["teacher_checkpointer"]
    return cfg


def no_teacher_nodes(cfg: dict) -> dict:
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    return cfg


def step(cfg: dict, tmp: Path, *overrides: str, world_size: int = 1):
    """The recipe's step of ``cfg`` on the fake accelerator; checks where everything trained."""
    result = fake_device_step(write_config(tmp / "c.yaml", cfg), overrides, world_size=world_size)
    for kind, types in result.devices.items():
        assert types == {FAKE_DEVICE}, (kind, types)
    assert result.stats.stepped
    assert result.dtypes == {torch.bfloat16}
    return result


def heldout(assets: dict) -> dict:
    return {
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": str(assets["data"]),
            "split": "train",
        },
        "every_n_steps": 1,
        "max_batches": 2,
        "batch_size": 2,
    }


# ------------------------------------------------------------------------- a teacher model
@pytest.mark.parametrize(
    "lora, ac, fused",
    [(False, False, True), (True, True, True), (False, True, False), (True, False, False)],
    ids=["full", "lora-ac", "full-ac-unfused", "lora-unfused"],
)
def test_torchtune_teacher_model(assets, tmp_path, lora, ac, fused):
    cfg = gpu_config(
        assets,
        tmp_path / "out",
        lora=lora,
        enable_activation_checkpointing=ac,
        fused_loss=fused,
        validation=heldout(assets),
    )
    assert step(cfg, tmp_path).validated


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_transformers_teacher_model(assets, tmp_path, lora):
    cfg = gpu_config(assets, tmp_path / "out", enable_activation_checkpointing=lora)
    step(on_transformers(cfg, assets, student=True, teacher=True, lora=lora), tmp_path)


def test_int8_teacher(assets, tmp_path):
    step(gpu_config(assets, tmp_path / "out", teacher_quantization="int8"), tmp_path)


# ------------------------------------------------------------------------- teacher files
def test_kd_store(assets, kd_store, tmp_path):  # noqa: F811
    cfg = gpu_config(assets, tmp_path / "out", teacher_logits={"path": str(kd_store), "k": K})
    step(no_teacher_nodes(cfg), tmp_path)


@pytest.mark.parametrize("fmt", ["axolotl", "distillkit"])
def test_foreign_file(assets, foreign, tmp_path, fmt):  # noqa: F811
    path = str(foreign[fmt])
    settings: dict[str, Any] = {"path": path, "k": K, "tail": "renorm", "format": fmt}
    if fmt == "axolotl":
        settings.update(source_temperature=T_GEN, alignment="next")
    cfg = gpu_config(
        assets,
        tmp_path / "out",
        teacher_logits=settings,
        dataset={"_component_": "kd.data.pretokenized_dataset", "data_files": path},
    )
    step(no_teacher_nodes(cfg), tmp_path)


# ------------------------------------------------------------------------- a served teacher
@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_served_teacher(assets, teacher_fn, tokenizer, tmp_path, api):  # noqa: F811
    with TeacherTestServer(teacher_fn, api=api, decode=lambda t: tokenizer.decode([t])) as server:
        section = {
            "url": server.url,
            "api": api,
            "model": "tiny-teacher",
            "top_k": K,
            "timeout": 5,
            "backoff": 0,
        }
        cfg = gpu_config(assets, tmp_path / "out", teacher_server=section)
        step(no_teacher_nodes(cfg), tmp_path)
        assert len(server.prompts) > 1  # the probe, then the step's rows


# ------------------------------------------------------------------------- several teachers
@pytest.fixture(scope="module")
def routed_data(tmp_path_factory) -> Path:
    rng = random.Random(5)
    rows = []
    for i in range(16):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"input": f"{a}+{b}", "output": str(a + b), "domain": "ab"[i % 2]})
    return write_jsonl(tmp_path_factory.mktemp("routed") / "train.jsonl", rows)


def two_model_members(assets, tmp_path: Path, out: Path) -> list[dict[str, Any]]:
    """Members ``a`` (the assets' teacher) and ``b`` (another of its shape), weight 1 each."""
    second = write_hf_qwen2(tmp_path / "teacher2", TEACHER, seed=7)
    return [
        {
            "name": name,
            "weight": 1.0,
            "teacher_model": builder(TEACHER),
            "teacher_checkpointer": checkpointer_node(folder, out / f"tt_{name}"),
        }
        for name, folder in (("a", assets["teacher"]), ("b", second))
    ]


@pytest.mark.parametrize("combine", ["weights", "mix", "route"])
def test_several_teachers(assets, routed_data, tmp_path, combine):
    out = tmp_path / "out"
    members = two_model_members(assets, tmp_path, out)
    teachers: dict[str, Any] = {"combine": combine, "members": members}
    top: dict[str, Any] = {"validation": heldout(assets)}
    if combine == "route":
        teachers["route_field"] = "domain"
        top["dataset"] = dict(make_config(assets, out)["dataset"], data_files=str(routed_data))
        top["validation"]["dataset"] = top["dataset"]
    cfg = no_teacher_nodes(gpu_config(assets, out, teachers=teachers, **top))
    assert step(cfg, tmp_path).validated


# ------------------------------------------------------------------------- other teachers
def test_other_tokenizer(assets, other_tok_teacher, letter_data, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(letter_data))
    cfg = gpu_config(
        assets,
        out,
        teacher_model={"_component_": "kd.hf.causal_lm", "path": str(other_tok_teacher)},
        cross_tokenizer={},
        dataset=dataset,
    )
    del cfg["teacher_checkpointer"]
    step(cfg, tmp_path)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_hidden_states(assets, tmp_path, lora):
    hidden = {"layer_map": ["embed:embed", "0:0", "1:1", "norm:norm"], "loss": "cosine"}
    cfg = gpu_config(
        assets, tmp_path / "out", lora=lora, hidden_states=hidden, validation=heldout(assets)
    )
    assert step(cfg, tmp_path).validated


@pytest.fixture(scope="module")
def reference_rows(tmp_path_factory) -> Path:
    rng = random.Random(5)
    rows = []
    for i in range(16):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"input": f"{a}+{b}", "output": str(a + b), "reference": "x" * (i % 3)})
    return write_jsonl(tmp_path_factory.mktemp("self") / "train.jsonl", rows)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_self_teacher(assets, reference_rows, tmp_path, lora):
    cfg = no_teacher_nodes(gpu_config(assets, tmp_path / "out"))
    cfg["tokenizer"] = hf_tokenizer_node(assets["tokenizer"], 2 * MAX_SEQ_LEN)
    cfg["model"] = hf_node(assets["student"], lora=lora)
    del cfg["checkpointer"]
    cfg["dataset"]["data_files"] = str(reference_rows)
    cfg["self_teacher"] = {"context": "Reference answer: {reference}. Reply with it."}
    step(cfg, tmp_path)


# ------------------------------------------------------------------------- on-policy
@pytest.mark.parametrize(
    "backend, seq_kd", [("torchtune", False), ("torchtune", True), ("transformers", False)]
)
def test_on_policy(assets, tmp_path, backend, seq_kd):
    node = {"lmbda": 1.0, "max_new_tokens": 4, "temperature": 1.0, "top_p": 0.95}
    if seq_kd:
        node.update(lmbda=0.0, seq_kd=True)
    cfg = gpu_config(assets, tmp_path / "out", on_policy=node)
    if backend == "transformers":
        on_transformers(cfg, assets, student=True, teacher=True, lora=False)
    result = step(cfg, tmp_path)
    sampler = "teacher" if seq_kd else "student"
    assert result.stats.sampled[sampler][0] == 2  # both micro-batches were sampled


# ------------------------------------------------------------------------- FSDP2
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_two_ranks(assets, tmp_path, lora):
    cfg = gpu_config(assets, tmp_path / "out", lora=lora, validation=heldout(assets))
    assert step(cfg, tmp_path, world_size=2).validated
