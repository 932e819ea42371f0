"""Self-distillation (``self_teacher:``) through ``kd run`` / ``kd validate`` on the tiny assets,
both backends: with an empty context the first step has exactly zero divergence, a LoRA
teacher is the base model (adapters off), the teacher's positions map onto the student's for
contexts of any length, padding and multi-turn chats, a resumed run is bit-identical, and the
mistakes are one line each (exit 2)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kd import cli, models
from kd.testing import hf_tokenizer_node, write_jsonl
from tests.conftest import (
    MAX_SEQ_LEN,
    make_config,
    read_metrics,
    run_kd,
    sigterm_at_step,
    write_config,
)

# One intra-op thread (tests/conftest.py): the same float reductions in every run.
pytestmark = pytest.mark.usefixtures("one_thread")

SEQ_LEN = 2 * MAX_SEQ_LEN  # room for the context
CONTEXT = "Reference answer: {reference}. Reply with it."


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    """48 additions with a reference field whose length varies from row to row."""
    rng = random.Random(5)
    rows = []
    for i in range(48):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(
            {"input": f"{a}+{b}", "output": str(a + b), "reference": "x" * (i % 7) + str(a + b)}
        )
    return write_jsonl(tmp_path_factory.mktemp("self") / "train.jsonl", rows)


def hf_node(folder: Path, *, lora: bool) -> dict:
    node = {
        "_component_": "kd.hf.lora_causal_lm" if lora else "kd.hf.causal_lm",
        "path": str(folder),
    }
    if lora:
        node.update(
            lora_attn_modules=["q_proj", "v_proj"],
            apply_lora_to_mlp=True,
            lora_rank=4,
            lora_alpha=8,
        )
    return node


def self_config(
    assets: dict, out: Path, data: Path, *, backend: str = "hf", lora: bool = True, **top
) -> dict:
    """A self-distillation config: the student alone, the chat-template tokenizer, rows with a
    ``reference`` field."""
    cfg = make_config(assets, out, lora=lora and backend == "tt", **top)
    cfg["tokenizer"] = hf_tokenizer_node(assets["tokenizer"], SEQ_LEN)
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    if backend == "hf":
        cfg["model"] = hf_node(assets["student"], lora=lora)
        del cfg["checkpointer"]
    cfg["dataset"]["data_files"] = str(data)
    cfg.setdefault("self_teacher", {"context": CONTEXT})
    return cfg


BACKENDS = [("hf", True), ("hf", False), ("tt", True), ("tt", False)]
IDS = ["hf-lora", "hf-full", "tt-lora", "tt-full"]


@pytest.mark.parametrize(("backend", "lora"), BACKENDS, ids=IDS)
def test_empty_context_is_zero_divergence_at_step_1(assets, rows_file, tmp_path, backend, lora):
    cfg = self_config(
        assets,
        tmp_path / "o",
        rows_file,
        backend=backend,
        lora=lora,
        self_teacher={"context": ""},
        max_steps_per_epoch=2,
    )
    assert run_kd(cfg, tmp_path / "c.yaml") == 0
    rows = read_metrics(tmp_path / "o")
    assert rows[0]["kd_loss"] == 0.0
    assert rows[1]["kd_loss"] > 0  # the student moved; the teacher did not


def loaded(cfg: dict, tmp_path: Path, name: str):
    """A recipe of ``cfg`` after preload() and load() (the models loaded, nothing trained)."""
    from kd.config import load_config, validate_config
    from kd.config.run import run_config
    from kd.recipes.kd import KDRecipe
    from kd.runtime.distributed import WorldInfo

    loaded_cfg = load_config(str(write_config(tmp_path / f"{name}.yaml", cfg)), [])
    validate_config(loaded_cfg)
    recipe = KDRecipe(run_config(loaded_cfg), world=WorldInfo(world_size=1, rank=0, local_rank=0))
    recipe.preload()
    recipe.load()
    return recipe


def first_batch(recipe):
    from kd.teachers import TeacherInput

    batch = next(iter(recipe.loader))
    return TeacherInput(batch["tokens"], labels=batch["labels"], rows=batch["rows"].tolist())


@pytest.mark.parametrize("backend", ["hf", "tt"])
def test_lora_teacher_is_the_base_model(assets, rows_file, tmp_path, backend):
    """Adapters off, the LoRA student's forward equals a separately loaded base model to 1e-6
    at every position (its adapters made non-zero first, so they would show)."""
    lora = loaded(
        self_config(
            assets, tmp_path / "a", rows_file, backend=backend, self_teacher={"context": ""}
        ),
        tmp_path,
        "lora",
    )
    base = loaded(
        self_config(
            assets,
            tmp_path / "b",
            rows_file,
            backend=backend,
            lora=False,
            self_teacher={"context": "", "weights": "live"},
        ),
        tmp_path,
        "base",
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lora.student.named_parameters():
            if "lora" in name.lower():
                p.normal_(0, 0.2)
    batch = first_batch(lora)
    signal = lora.teacher.signal(batch)  # [b, s, d] on the student's positions
    with torch.no_grad():
        want = base.student.eval()(batch.tokens)
        adapted = lora.student(batch.tokens)
    shifted = torch.cat([batch.labels[:, 1:], torch.full_like(batch.labels[:, :1], -100)], 1)
    at = shifted != -100  # the predicting positions the loss reads
    assert at.sum() > 10
    diff = (signal.hidden[at] - want[at]).abs().amax(dim=-1)
    assert float(diff.max()) <= 1e-6, diff.max()
    assert float((adapted[at] - want[at]).abs().max()) > 1e-3  # the adapters are on otherwise
    with torch.no_grad():
        t_logits = signal.logits(signal.labelled_hidden(at.reshape(-1).nonzero().squeeze(1)))
        b_logits = models.logits_from_hidden(base.student, want[at])
    assert float((t_logits - b_logits).abs().max()) <= 1e-5
    lora.cleanup()
    base.cleanup()


@pytest.mark.parametrize("backend", ["hf", "tt"])
def test_context_changes_the_teacher_and_the_plan_knows(assets, rows_file, tmp_path, backend):
    out = tmp_path / "o"
    cfg = self_config(assets, out, rows_file, backend=backend, max_steps_per_epoch=2)
    assert run_kd(cfg, tmp_path / "c.yaml") == 0
    rows = read_metrics(out)
    assert rows[0]["kd_loss"] > 0  # the context changes the teacher's distribution
    assert (out / "final" / "adapter" / "adapter_model.safetensors").exists()


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """Multi-turn chats (two assistant replies, some with a system message) with a ``hint``
    whose length varies from row to row."""
    rng = random.Random(7)
    rows = []
    for i in range(16):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        messages = [
            {"role": "user", "content": f"{a}+{b}"},
            {"role": "assistant", "content": str(a + b)},
            {"role": "user", "content": f"and {a}-{b}?"},
            {"role": "assistant", "content": str(a - b)},
        ]
        if i % 2:
            messages.insert(0, {"role": "system", "content": "Be brief."})
        rows.append({"messages": messages, "hint": "h" * (3 * i % 11)})
    return write_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl", rows)


def chat_dataset(path: Path) -> dict:
    return {
        "_component_": "torchtune.datasets.chat_dataset",
        "source": "json",
        "data_files": str(path),
        "split": "train",
        "conversation_column": "messages",
        "conversation_style": "openai",
    }


def padded(examples: list[dict], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(e["tokens"]) for e in examples)
    tokens = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["tokens"])
        at = slice(0, n) if side == "right" else slice(width - n, width)
        tokens[i, at] = torch.tensor(e["tokens"])
        labels[i, at] = torch.tensor(e["labels"])
    return tokens, labels


@pytest.mark.parametrize("place", ["system", "user"])
def test_positions_map_for_any_context_padding_and_turns(assets, chat_file, tmp_path, place):
    """Rows whose contexts differ in length, multi-turn (every reply labelled), the student's
    batch padded left or right: each labelled student token gets the teacher's prediction of the
    same token, as the teacher computes it on that row alone."""
    from kd.teachers import TeacherInput

    cfg = self_config(
        assets,
        tmp_path / "o",
        chat_file,
        dataset=chat_dataset(chat_file),
        self_teacher={"context": "Hint: {hint}\n", "place": place},
    )
    recipe = loaded(cfg, tmp_path, "chat")
    teacher, dataset = recipe.teacher, recipe.dataset
    rows = [0, 1, 2, 3, 4]
    examples = [dataset[r] for r in rows]
    rendered = [teacher.privileged.render(r) for r in rows]
    assert (
        len({len(t.tokens) - len(e["tokens"]) for t, e in zip(rendered, examples, strict=True)}) > 1
    )
    for side in ("right", "left"):
        tokens, labels = padded(examples, side)
        signal = teacher.signal(TeacherInput(tokens, labels=labels, rows=rows))
        for i, row in enumerate(rendered):
            s_pos = [j for j in range(tokens.shape[1]) if labels[i, j] != -100]
            assert len(s_pos) == len(row.labelled) > 4  # two replies, each labelled
            assert [int(tokens[i, p]) for p in s_pos] == [row.tokens[q] for q in row.labelled]
            with teacher._as_teacher(recipe.student):
                alone = recipe.student(torch.tensor([row.tokens]))[0]  # [s_t, d]
            for p, q in zip(s_pos, row.labelled, strict=True):
                torch.testing.assert_close(signal.hidden[i, p - 1], alone[q - 1], atol=1e-5, rtol=0)
    recipe.cleanup()


def test_on_policy_empty_context_is_zero_then_context_teaches(assets, rows_file, tmp_path):
    """OPSD: the student's own completions scored by the teacher with the context; without a
    context the first step's divergence is exactly zero."""
    op = {"lmbda": 1.0, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "seq_kd": False}
    for context, name in (("", "empty"), (CONTEXT, "ctx")):
        cfg = self_config(
            assets,
            tmp_path / name,
            rows_file,
            on_policy=op,
            self_teacher={"context": context},
            max_steps_per_epoch=2,
        )
        assert run_kd(cfg, tmp_path / f"{name}.yaml") == 0
        rows = read_metrics(tmp_path / name)
        assert rows[0]["sampled_batches_student"] == 2
        assert (rows[0]["kd_loss"] == 0.0) == (context == "")
        assert all(math.isfinite(r["kd_loss"]) for r in rows)


@pytest.mark.parametrize(
    ("backend", "lora"), [("hf", True), ("tt", False)], ids=["hf-lora", "tt-full"]
)
def test_sigterm_then_resume_is_bit_identical(
    assets, rows_file, tmp_path, monkeypatch, backend, lora
):
    top = dict(
        shuffle=True,
        epochs=2,
        max_steps_per_epoch=3,
        save_every_n_steps=2,
        metric_logger={"_component_": "kd.metrics.StdoutLogger"},
    )
    ref = tmp_path / "ref"
    assert (
        run_kd(
            self_config(assets, ref, rows_file, backend=backend, lora=lora, **top),
            tmp_path / "r.yaml",
        )
        == 0
    )
    out = tmp_path / "run"
    cfg = self_config(assets, out, rows_file, backend=backend, lora=lora, **top)
    with monkeypatch.context() as m:
        sigterm_at_step(m, 4)
        assert run_kd(cfg, tmp_path / "c.yaml") == 0
    assert not (out / "final").exists()
    assert run_kd(cfg, tmp_path / "c.yaml", "resume_from_checkpoint=true") == 0
    a, b = (
        load_file(ref / "final" / "model.safetensors"),
        load_file(out / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keep = lambda rows: [{k: r[k] for k in ("step", "loss", "kd_loss", "ce_loss")} for r in rows]  # noqa: E731
    assert keep(read_metrics(ref)) == keep(read_metrics(out))


def error_lines(capsys, *argv: str) -> list[str]:
    capsys.readouterr()
    assert cli.main(list(argv)) == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("kd: error")]


def test_mistakes_are_one_line_each(assets, rows_file, tmp_path, capsys):
    def validate(cfg: dict, name: str) -> list[str]:
        return error_lines(capsys, "validate", "--config", str(write_config(tmp_path / name, cfg)))

    # A context field that a row lacks: the row number.
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    del rows[2]["reference"]
    holed = write_jsonl(tmp_path / "holed.jsonl", rows)
    lines = validate(self_config(assets, tmp_path / "o1", holed), "a.yaml")
    assert len(lines) == 1, lines
    # The datasets library fills the row's missing field with null: the line names the fields
    # the row fills, not its keys (which include the missing one).
    assert "row 3 of dataset has no value in field 'reference'" in lines[0]
    assert "(the row fills: input, output); give every row a reference" in lines[0], lines[0]
    # A teacher model named beside the self teacher.
    cfg = self_config(assets, tmp_path / "o2", rows_file)
    cfg["teacher_model"] = hf_node(assets["teacher"], lora=False)
    lines = validate(cfg, "b.yaml")
    assert len(lines) == 1 and "teacher_model" in lines[0] and "self_teacher" in lines[0]
    # A template that does not render.
    for bad in ("Ref: {reference", "Ref: {reference.upper}", "Ref: {}"):
        cfg = self_config(assets, tmp_path / "o3", rows_file, self_teacher={"context": bad})
        lines = validate(cfg, "c.yaml")
        assert (
            len(lines) == 1 and "self_teacher.context" in lines[0] and "does not render" in lines[0]
        )
    # A row whose teacher input is over tokenizer.max_seq_len: the row number and the fix.
    cfg = self_config(assets, tmp_path / "o4", rows_file)
    cfg["tokenizer"]["max_seq_len"] = 60
    lines = validate(cfg, "d.yaml")
    assert (
        len(lines) == 1
        and "row 1 of dataset" in lines[0]
        and "raise tokenizer.max_seq_len" in lines[0]
    )
    # Data kd cannot render with a context (already tokenized).
    ids = write_jsonl(
        tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}] * 8
    )
    cfg = self_config(assets, tmp_path / "o5", rows_file)
    cfg["dataset"] = {"_component_": "kd.data.pretokenized_dataset", "data_files": str(ids)}
    lines = validate(cfg, "e.yaml")
    assert len(lines) == 1 and "PretokenizedDataset" in lines[0] and "instruct_dataset" in lines[0]
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


@pytest.mark.parametrize("token", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
def test_a_control_token_in_a_context_field_is_refused(assets, rows_file, tmp_path, capsys, token):
    """A row's field that the tokenizer would read as one of its special tokens (a turn's end or
    start) would become a real control token in the teacher's prompt: refused with the row, the
    field and the token, before anything is written; the text of such a token that this
    tokenizer does not have is plain text and trains."""
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    rows[4]["reference"] = f"42{token} or so"
    data = write_jsonl(tmp_path / "tokens.jsonl", rows)
    cfg = self_config(assets, tmp_path / "o", data)
    lines = error_lines(capsys, "validate", "--config", str(write_config(tmp_path / "a.yaml", cfg)))
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"kd: error: self_teacher.context: row 5 of dataset: field 'reference' holds '{token}', "
        "which the tokenizer reads as its control token"
    ), lines[0]
    assert "remove or reword it in the row" in lines[0]
    assert not (tmp_path / "o").exists()


def test_text_like_a_token_the_tokenizer_lacks_is_text(assets, rows_file, tmp_path):
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    rows[4]["reference"] = "42<|eot_id|> <|im_end"  # not special tokens of this tokenizer
    data = write_jsonl(tmp_path / "text.jsonl", rows)
    cfg = self_config(assets, tmp_path / "o", data)
    assert cli.main(["validate", "--config", str(write_config(tmp_path / "a.yaml", cfg))]) == 0


def test_validate_reports_the_longest_teacher_input(
    assets, rows_file, tmp_path, capsys, monkeypatch, request
):
    import logging

    kd_logger = logging.getLogger("kd")  # as in a fresh `kd validate` process: no handler
    monkeypatch.setattr(kd_logger, "handlers", [])
    request.addfinalizer(lambda level=kd_logger.level: kd_logger.setLevel(level))
    kd_logger.setLevel(logging.NOTSET)
    cfg = self_config(assets, tmp_path / "o", rows_file)
    capsys.readouterr()
    assert cli.main(["validate", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 0
    # On stderr, where the user reads it (issue 42: it was logged and never shown).
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "longest teacher input" in line]
    assert len(said) == 1 and said[0].startswith("kd: self_teacher: the longest teacher input")
    assert f"within tokenizer.max_seq_len {SEQ_LEN}" in said[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_plan_counts_no_teacher_weights_for_lora_and_the_copy_otherwise(
    assets, rows_file, tmp_path, capsys, lora
):
    cfg = self_config(assets, tmp_path / "o", rows_file, lora=lora)
    path = str(write_config(tmp_path / "c.yaml", cfg))
    capsys.readouterr()
    assert cli.main(["plan", "--config", path, "--json", "memory.reserve_gib=0"]) == 0
    plan = json.loads(capsys.readouterr().out)
    parts = plan["phase_components"]["forward"]
    assert parts["teacher_forward"] > 0  # the teacher's own no-grad forward is planned
    if lora:
        assert parts["teacher_weights"] == 0
    else:
        assert parts["teacher_weights"] == parts["student_weights"] > 0
        budget = f"{0.97 * plan['peak_gib']:.6f}"
        assert (
            cli.main(
                ["plan", "--config", path, "--fit", "--budget-gib", budget, "memory.reserve_gib=0"]
            )
            == 1  # does not fit: the options follow
        )
        out = capsys.readouterr().out
        assert "a frozen copy of the student's initial weights" in out
        assert "a LoRA student" in out and "no frozen copy for the self teacher" in out


def test_kd_init_self_writes_a_config_that_runs(assets, rows_file, tmp_path, capsys):
    """``kd init --self`` on one Hugging Face folder: the reference field becomes the context,
    and ``kd run kd`` trains the written config unchanged."""
    import shutil

    from kd.testing import write_hf_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(assets["student"], folder)
    write_hf_tokenizer(folder)
    config = tmp_path / "self.yaml"
    argv = ["init", "--self", "--student", str(folder), "--data", str(rows_file)]
    argv += ["--output-dir", str(tmp_path / "out"), "--config-out", str(config), "--lora"]
    assert cli.main([*argv, "--device", "cpu", "--max-seq-len", "128"]) == 0
    assert "teacher: the student itself" in capsys.readouterr().out
    written = config.read_text()
    assert "teacher_model" not in written
    assert 'context: "Reference: {reference}\\n"' in written
    assert (
        cli.main(["run", "kd", "--config", str(config), "max_steps_per_epoch=1", "batch_size=2"])
        == 0
    )
    assert read_metrics(tmp_path / "out")[0]["kd_loss"] > 0
    # --teacher beside --self, a context naming no field of the rows: one line each.
    lines = error_lines(capsys, *argv, "--force", "--teacher", str(folder))
    assert len(lines) == 1 and "--teacher: not with --self" in lines[0]
    lines = error_lines(capsys, *argv, "--force", "--context", "{missing}")
    assert len(lines) == 1 and "--context" in lines[0] and "'missing'" in lines[0]
    # Rows with no reference-like field: the empty context is said, with the rows' fields.
    plain = write_jsonl(
        tmp_path / "plain.jsonl", [{"input": f"{i}+1", "output": str(i + 1)} for i in range(8)]
    )
    argv[argv.index(str(rows_file))] = str(plain)
    assert cli.main([*argv, "--force", "--device", "cpu", "--max-seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert 'context: ""' in config.read_text()
    note = [line for line in out.splitlines() if "self_teacher.context is empty" in line]
    assert len(note) == 1 and "its base model" in note[0] and "(input, output)" in note[0]


def test_torchtune_tokenizer_renders_the_same_completion(assets, rows_file, tmp_path):
    """torchtune's own tokenizer (qwen2_5_tokenizer, no chat template): the context's system
    message leaves the completion's labels as the student's (its final eos stays masked as in
    the student's rows), and an empty context is still exactly zero divergence."""
    from kd.testing import tokenizer_node

    for context, name in (("", "empty"), (CONTEXT, "ctx")):
        cfg = self_config(
            assets, tmp_path / name, rows_file, backend="tt", self_teacher={"context": context}
        )
        cfg["tokenizer"] = tokenizer_node(assets["tokenizer"], SEQ_LEN)
        assert run_kd(cfg, tmp_path / f"{name}.yaml", "max_steps_per_epoch=1") == 0
        assert (read_metrics(tmp_path / name)[0]["kd_loss"] == 0.0) == (context == "")
