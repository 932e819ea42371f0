"""A teacher with another tokenizer through ``kd run`` (``cross_tokenizer:``): with the student's
own tokenizer it trains as the one-tokenizer run does; with a tokenizer that merges letter pairs
it aligns by character spans and logs both parts of GOLD's hybrid loss; bad input, one line."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from kd import cli
from kd.testing import write_hf_tokenizer, write_jsonl
from tests.conftest import (
    STUDENT,
    TEACHER,
    make_config,
    read_metrics,
    run_kd,
    write_config,
    write_hf_qwen2,
)

LETTERS = "abcdefghij"


@pytest.fixture(scope="module")
def same_tok_teacher(assets, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("same") / "teacher"
    shutil.copytree(assets["teacher"], dest)
    return write_hf_tokenizer(dest)


@pytest.fixture(scope="module")
def unpadded(tmp_path_factory) -> dict[str, Path]:
    """Student and teacher whose vocabularies are the tokenizer's 278 ids (no padded rows), the
    teacher's folder holding that tokenizer."""
    root = tmp_path_factory.mktemp("unpadded")
    student = write_hf_qwen2(root / "student", dict(STUDENT, vocab=278), seed=1)
    teacher = write_hf_qwen2(root / "teacher", dict(TEACHER, vocab=278), seed=2)
    write_hf_tokenizer(teacher)
    return {"student": student, "teacher": teacher}


@pytest.fixture(scope="module")
def other_tok_teacher(tmp_path_factory) -> Path:
    """A teacher whose tokenizer merges every pair of the letters a-j (ids 278..377) and lacks
    the student's ``~`` and backtick tokens (their ids hold other strings): both vocabularies
    have strings the other lacks."""
    dest = write_hf_qwen2(tmp_path_factory.mktemp("other") / "teacher", dict(TEACHER, vocab=384), 9)
    write_hf_tokenizer(dest)
    path = dest / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    for byte in ("~", "`"):
        vocab[byte + "x"] = vocab.pop(byte)
    next_id = 278
    for x in LETTERS:
        for y in LETTERS:
            vocab[x + y] = next_id
            merges.append([x, y] if merges and isinstance(merges[0], list) else f"{x} {y}")
            next_id += 1
    path.write_text(json.dumps(spec))
    return dest


@pytest.fixture(scope="module")
def letter_data(tmp_path_factory) -> Path:
    rng = random.Random(2)
    rows = []
    for _ in range(64):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"input": f"{a}+{b}", "output": "".join(LETTERS[int(c)] for c in str(a + b))})
    return write_jsonl(tmp_path_factory.mktemp("letters") / "train.jsonl", rows)


def _cfg(assets, out: Path, teacher: Path, **top) -> dict:
    cfg = make_config(
        assets, out, teacher_model={"_component_": "kd.hf.causal_lm", "path": str(teacher)}, **top
    )
    del cfg["teacher_checkpointer"]
    return cfg


def _steps(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r and "step" in r]


def test_same_tokenizer_trains_as_the_one_tokenizer_run(assets, unpadded, tmp_path):
    one, cross = tmp_path / "one", tmp_path / "cross"
    student = {"model": {"_component_": "kd.hf.causal_lm", "path": str(unpadded["student"])}}
    cfg = _cfg(assets, one, unpadded["teacher"], **student)
    del cfg["checkpointer"]
    assert run_kd(cfg, tmp_path / "one.yaml") == 0
    cfg = dict(cfg, output_dir=str(cross), cross_tokenizer={"matched_weight": None})
    assert run_kd(cfg, tmp_path / "cross.yaml") == 0
    a, b = _steps(one), _steps(cross)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce_loss", "kd_loss"):
            # the same numbers up to fp32 summation order (fused vs per-row loss, the teacher
            # on unpadded rows)
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), key
        assert rb["kd_loss/unmatched"] == 0
        assert rb["kd_loss/matched"] == pytest.approx(rb["kd_loss"], rel=1e-6)


def test_other_tokenizer_aligns_and_logs_both_parts(
    assets, other_tok_teacher, letter_data, tmp_path
):
    out = tmp_path / "run"
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(letter_data))
    cfg = _cfg(assets, out, other_tok_teacher, cross_tokenizer={}, dataset=dataset)
    assert run_kd(cfg, tmp_path / "cfg.yaml") == 0
    rows = _steps(out)
    assert len(rows) == 3
    for r in rows:
        assert r["kd_loss/matched"] > 0 and r["kd_loss/unmatched"] > 0
        assert r["kd_loss"] > 0


def test_teacher_alignment_merges_letter_pairs(assets, other_tok_teacher):
    from transformers import AutoTokenizer

    from kd.teachers.cross import token_spans

    student = AutoTokenizer.from_pretrained(str(other_tok_teacher), trust_remote_code=False)
    teacher = AutoTokenizer.from_pretrained(str(other_tok_teacher), trust_remote_code=False)
    # the student tokenizer without merges: bytes only (write_hf_tokenizer's ids)
    ids = [ord(c) for c in "abcd"]
    text, spans = token_spans(student, ids)
    assert text == "abcd" and spans == [(0, 1), (1, 2), (2, 3), (3, 4)]
    enc = teacher(text, add_special_tokens=False, return_offsets_mapping=True)
    assert [tuple(o) for o in enc["offset_mapping"]] == [(0, 2), (2, 4)]


def test_cross_tokenizer_with_validation_is_one_line(assets, same_tok_teacher, tmp_path, capsys):
    out = tmp_path / "run"
    val = {"dataset": make_config(assets, out)["dataset"]}
    cfg = _cfg(assets, out, same_tok_teacher, cross_tokenizer={}, validation=val)
    path = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "validation: cannot be used with cross_tokenizer" in err
    assert "Traceback" not in err


def test_nan_weights_of_a_teacher_with_another_tokenizer_name_its_folder(
    assets, same_tok_teacher, tmp_path, capsys
):
    """The first step's non-finite loss is blamed on the teacher's folder (it said 'as loaded
    from .', which names no folder, under teachers: neither member's)."""
    import safetensors.torch
    import torch

    bad = tmp_path / "nan_teacher"
    shutil.copytree(same_tok_teacher, bad)
    weights = safetensors.torch.load_file(bad / "model.safetensors")
    nan = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    safetensors.torch.save_file(nan, bad / "model.safetensors", metadata={"format": "pt"})
    cfg = _cfg(assets, tmp_path / "run", bad, cross_tokenizer={}, max_steps_per_epoch=1)
    assert run_kd(cfg, tmp_path / "cfg.yaml") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert line.startswith("kd: error: teacher_model: ") and f"as loaded from {bad}," in line, line


def test_kd_init_writes_the_cross_tokenizer_config(
    other_tok_teacher, letter_data, tmp_path, capsys
):
    import yaml

    student = write_hf_tokenizer(write_hf_qwen2(tmp_path / "student", STUDENT, seed=1))
    argv = [
        "init",
        "--teacher",
        str(other_tok_teacher),
        "--student",
        str(student),
        "--data",
        str(letter_data),
        "--output-dir",
        str(tmp_path / "out"),
        "--config-out",
        str(tmp_path / "kd.yaml"),
        "--max-seq-len",
        "64",
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 2  # refused without the flag, as before
    assert "tokenizers differ" in capsys.readouterr().err
    assert cli.main([*argv, "--cross-tokenizer"]) == 0
    assert "tokenizers differ: wrote cross_tokenizer" in capsys.readouterr().out
    text = (tmp_path / "kd.yaml").read_text()
    assert "It costs: the student's full logits" in text
    cfg = yaml.safe_load(text)
    assert cfg["cross_tokenizer"] == {"matched_weight": None}
    assert cfg["teacher_model"]["_component_"] == "kd.hf.causal_lm"
    overrides = ["max_steps_per_epoch=1", "batch_size=2", "gradient_accumulation_steps=1"]
    assert cli.main(["run", "kd", "--config", str(tmp_path / "kd.yaml"), *overrides]) == 0
    row = _steps(tmp_path / "out")[0]
    assert row["kd_loss/matched"] > 0 and row["kd_loss/unmatched"] > 0


def _disjoint_tokenizer():
    """A working fast tokenizer (WordPiece over ASCII characters) none of whose token strings is
    in the student's byte-level vocabulary (``▁x`` / ``##x`` pieces, ``<s>`` / ``</s>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for prefix in ("▁", "##"):
        for c in range(32, 127):
            vocab[prefix + chr(c)] = len(vocab)
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def test_a_teacher_tokenizer_sharing_no_token_is_one_line(assets, tmp_path, capsys):
    """A teacher folder whose tokenizer shares no token string with the student's: in a Qwen2
    folder transformers reads it as a byte-level tokenizer that encodes every text to nothing
    (the run used to end in an IndexError inside the teacher's forward)."""
    teacher = write_hf_qwen2(tmp_path / "teacher", TEACHER, seed=4)
    _disjoint_tokenizer().save(str(teacher / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]", "pad_token": "</s>"}
    (teacher / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    cfg = _cfg(assets, out, teacher, cross_tokenizer={})
    assert run_kd(cfg, tmp_path / "cfg.yaml") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert len(lines) == 1, err
    assert f"cross_tokenizer: the teacher's tokenizer in {teacher} encodes" in lines[0]
    assert f"check that {teacher} holds the teacher's own tokenizer files" in lines[0]
    assert not (out / "final").exists()


def test_a_working_teacher_tokenizer_sharing_no_token_is_refused(tmp_path):
    """The same vocabulary as a tokenizer that encodes (transformers' own fast class): the
    check the source runs refuses the pair, naming the folder."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from kd.cross_tokenizer import vocab_match
    from kd.errors import KDUserError
    from kd.teachers.cross import check_pair

    teacher = PreTrainedTokenizerFast(tokenizer_object=_disjoint_tokenizer())
    assert teacher("12+30", add_special_tokens=False)["input_ids"]
    student = AutoTokenizer.from_pretrained(write_hf_tokenizer(tmp_path / "s"))
    match = vocab_match(student.get_vocab(), teacher.get_vocab(), teacher_size=len(teacher))
    with pytest.raises(KDUserError) as err:
        check_pair(teacher, match, tmp_path / "t")
    assert str(err.value).startswith(
        f"cross_tokenizer: the teacher's tokenizer in {tmp_path / 't'} shares no token string "
        "with the student's"
    )
