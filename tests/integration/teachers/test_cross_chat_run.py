"""Chat rows with a teacher of another tokenizer (issue 26): each side renders the conversation
with its own chat template (two tiny Hugging Face tokenizer folders, ChatML and a Gemma-like
template whose tokenizer merges letter pairs), the trained spans are aligned, the stored
teacher logits of such rows train as the live teacher does, and with the same tokenizer and
template the loss is the one-tokenizer run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kd import cli
from kd.cross_tokenizer import align_spans
from kd.testing import hf_tokenizer_node, write_hf_tokenizer
from tests.conftest import STUDENT, TEACHER, make_config, read_metrics, write_config, write_hf_qwen2
from tests.integration.teachers.test_cross_run import letter_data, other_tok_teacher  # noqa: F401 - fixtures

GEMMA_LIKE = (
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>assistant\\n' }}{% endif %}"
)
TEACHER_SIZE = 378


@pytest.fixture(scope="module")
def folders(other_tok_teacher, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """A ChatML student (kd.hf tokenizer) and a teacher with letter pairs and its own template."""
    root = tmp_path_factory.mktemp("chat")
    student = write_hf_tokenizer(write_hf_qwen2(root / "student", dict(STUDENT, vocab=278), 1))
    teacher = root / "teacher"
    shutil.copytree(other_tok_teacher, teacher)
    config = json.loads((teacher / "tokenizer_config.json").read_text())
    (teacher / "tokenizer_config.json").write_text(
        json.dumps(dict(config, chat_template=GEMMA_LIKE))
    )
    return {"student": student, "teacher": teacher}


def _cfg(assets, out: Path, student: Path, teacher: Path, data: Path, **top) -> dict:
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(data))
    cfg = make_config(
        assets,
        out,
        model={"_component_": "kd.hf.causal_lm", "path": str(student)},
        tokenizer=hf_tokenizer_node(student, 64),
        teacher_model={"_component_": "kd.hf.causal_lm", "path": str(teacher)},
        dataset=dataset,
        **top,
    )
    del cfg["checkpointer"], cfg["teacher_checkpointer"]
    return cfg


def _run(*argv: str, cfg: dict, path: Path) -> int:
    return cli.main([*argv, "--config", str(write_config(path, cfg))])


def _steps(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r and "step" in r]


def test_teacher_renders_with_its_own_template_and_contents_align(folders, letter_data):  # noqa: F811
    import torch
    from torchtune.datasets import instruct_dataset
    from transformers import AutoTokenizer

    from kd.hf.tokenization import tokenizer
    from kd.teachers.cross_chat import ChatRows, runs_of

    student = tokenizer(str(folders["student"]), max_seq_len=64)
    teacher = tokenizer(str(folders["teacher"]))
    data = instruct_dataset(student, source="json", data_files=str(letter_data), split="train")
    chat = ChatRows(data, teacher)
    t_all, labelled = chat.render(0)
    row = json.loads(letter_data.read_text().splitlines()[0])
    messages = [
        {"role": "user", "content": row["input"]},
        {"role": "assistant", "content": row["output"]},
    ]
    hf = AutoTokenizer.from_pretrained(str(folders["teacher"]), trust_remote_code=False)
    rendered = hf.apply_chat_template(messages, tokenize=False)
    assert t_all == hf(rendered, add_special_tokens=False)["input_ids"]  # its own template
    text = hf.decode(t_all)
    assert "<start_of_turn>assistant" in text and "<|im_start|>" not in text
    assert hf.decode([t_all[j] for j in labelled]) == row["output"] + "<end_of_turn>\n"

    ex = data[0]
    labels = torch.tensor(ex["labels"])
    shifted = torch.cat([labels[1:], torch.tensor([-100])])
    rows = (shifted != -100).nonzero().squeeze(1)
    targets, ids = (rows + 1).tolist(), shifted[rows].tolist()
    _, made = chat.row(0, student, targets, ids)
    s_pieces = [student.decode([i], skip_special_tokens=False) for i in ids]
    t_pieces = [hf.decode([int(i)]) for i in made["t_ids"]]
    assert "".join(s_pieces) == row["output"] + "<|im_end|>\n"  # the student's ChatML turn
    s_groups, t_groups = align_spans(made["s_spans"], made["t_spans"])
    texts = [
        ("".join(s_pieces[i] for i in sg), "".join(t_pieces[j] for j in tg))
        for sg, tg in zip(s_groups, t_groups, strict=True)
    ]
    *content, (s_last, t_last) = texts
    assert all(s == t for s, t in content) and "".join(s for s, _ in content) == row["output"]
    assert len(content) < len(s_pieces) - 2  # letter pairs: groups of two student tokens
    # each template's own end of turn, compared merged
    assert (s_last, t_last) == ("<|im_end|>\n", "<end_of_turn>\n")
    assert len(runs_of(targets)) == 1


def test_chat_rows_train_and_their_store_equals_the_live_teacher(
    assets,
    folders,
    letter_data,  # noqa: F811
    tmp_path,
):
    paths = (folders["student"], folders["teacher"], letter_data)
    cfg = _cfg(assets, tmp_path / "live", *paths, cross_tokenizer={})
    assert _run("run", "kd", cfg=cfg, path=tmp_path / "live.yaml") == 0
    live = _steps(tmp_path / "live")
    assert len(live) == 3 and all(r["kd_loss/matched"] > 0 < r["kd_loss/unmatched"] for r in live)
    store = {"path": str(tmp_path / "logits"), "k": TEACHER_SIZE}
    cfg = _cfg(assets, tmp_path / "pre", *paths, cross_tokenizer={}, teacher_logits=store)
    assert _run("run", "teacher_logits", cfg=cfg, path=tmp_path / "pre.yaml") == 0
    cfg = dict(cfg, output_dir=str(tmp_path / "stored"))
    assert _run("run", "kd", cfg=cfg, path=tmp_path / "stored.yaml") == 0
    stored = _steps(tmp_path / "stored")
    for a, b in zip(live, stored, strict=True):
        for key in ("loss", "ce_loss", "kd_loss", "kd_loss/matched", "kd_loss/unmatched"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_same_tokenizer_and_template_is_the_one_tokenizer_run(assets, tmp_path_factory, tmp_path):
    root = tmp_path_factory.mktemp("same_chat")
    student = write_hf_tokenizer(write_hf_qwen2(root / "student", dict(STUDENT, vocab=278), 1))
    teacher = write_hf_tokenizer(write_hf_qwen2(root / "teacher", dict(TEACHER, vocab=278), 2))
    data = Path(make_config(assets, tmp_path)["dataset"]["data_files"])
    cfg = _cfg(assets, tmp_path / "one", student, teacher, data)
    assert _run("run", "kd", cfg=cfg, path=tmp_path / "one.yaml") == 0
    cfg = dict(cfg, output_dir=str(tmp_path / "cross"), cross_tokenizer={})
    assert _run("run", "kd", cfg=cfg, path=tmp_path / "cross.yaml") == 0
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "cross")
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce_loss", "kd_loss"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), key
        assert rb["kd_loss/unmatched"] == 0
