"""``kd init`` end to end: tiny Hugging Face folders (config.json, safetensors, tokenizer files) in,
a config that ``kd validate`` accepts and ``kd run kd`` trains out; and its one-line refusals."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kd import cli
from kd.config import load_config, validate_config
from kd.folders import read_config_json
from kd.scaffold.render import GLIBC_MMAP_THRESHOLD_MAX, cpu_loss_chunk_size
from kd.testing import write_tiny_model
from tests.conftest import STUDENT, TEACHER, read_metrics, tiny_model, write_hf_qwen2

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_hf_tokenizer(
    dest: Path,
    *,
    merges: bool = False,
    extra_special: str | None = None,
    eos_token: str = "<|im_end|>",
) -> Path:
    """A byte-level BPE tokenizer folder with kd.testing.write_tokenizer's ids (0..255 the bytes,
    256 <|endoftext|>, 257 <|im_start|>, 258 <|im_end|>) and a ChatML template.

    ``merges`` adds the merge ``H e`` (id 256, specials shifted by one); ``extra_special`` adds one
    more special token after the three; ``eos_token`` picks the eos (a base model's is
    ``<|endoftext|>``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from kd import _torchtune as tt

    dest.mkdir(parents=True, exist_ok=True)
    b2u = tt.bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merge_list: list[tuple[str, str]] = []
    if merges:
        vocab["He"] = 256
        merge_list = [("H", "e")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merge_list))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = [*SPECIALS, *([extra_special] if extra_special else [])]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    tok.save(str(dest / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return dest


def write_qwen3(dest: Path, spec: dict[str, Any], seed: int) -> Path:
    """A Qwen3 folder (an architecture torchtune 0.6.1 lacks) written by transformers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["inter"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["hidden"] // spec["heads"],
        max_position_embeddings=256,
        tie_word_embeddings=spec["tied"],
        bos_token_id=256,
        eos_token_id=258,
    )
    Qwen3ForCausalLM(config).save_pretrained(dest)
    return dest


def _rows(kind: str, n: int = 40) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        a, b = i % 10, (3 * i) % 10
        if kind == "chat":
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": f"{a}+{b}"},
                        {"role": "assistant", "content": str(a + b)},
                    ]
                }
            )
        elif kind == "instruct":
            out.append({"instruction": f"Add {a} and {b}.", "output": str(a + b)})
        elif kind == "alpaca":
            out.append(
                {"instruction": "Add the numbers.", "input": f"{a} {b}", "output": str(a + b)}
            )
        elif kind == "text":
            out.append({"text": f"{a} plus {b} is {a + b}."})
        else:
            out.append({"question": f"{a}+{b}", "answer": str(a + b)})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("init")
    out = {
        "teacher": write_hf_qwen2(root / "teacher", TEACHER, seed=2),
        "student": write_hf_qwen2(root / "student", STUDENT, seed=1),
        "qwen3": write_qwen3(root / "qwen3", STUDENT, seed=3),
        "llama": write_tiny_model(
            root / "llama",
            replace(tiny_model(STUDENT), family="llama", tie_word_embeddings=False),
            seed=4,
            writer="transformers",
        ),
    }
    for folder in out.values():
        write_hf_tokenizer(folder)
    # Folders with a config.json and tokenizer files but no weights (still downloading).
    for name, tokenizer in (
        ("pending", {}),
        ("merged", {"merges": True}),
        ("extra", {"extra_special": "<|tool|>"}),
        ("base_eos", {"eos_token": "<|endoftext|>"}),
    ):
        folder = root / name
        folder.mkdir()
        shutil.copyfile(out["teacher"] / "config.json", folder / "config.json")
        write_hf_tokenizer(folder, **tokenizer)
        out[name] = folder
    small = root / "small_vocab"
    small.mkdir()
    config = json.loads((out["student"] / "config.json").read_text())
    config["vocab_size"] = 200
    (small / "config.json").write_text(json.dumps(config))
    write_hf_tokenizer(small)
    out["small_vocab"] = small
    bare = root / "no_tokenizer"
    bare.mkdir()
    shutil.copyfile(out["student"] / "config.json", bare / "config.json")
    out["no_tokenizer"] = bare
    for kind in ("chat", "instruct", "alpaca", "text", "unknown"):
        path = root / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _rows(kind)))
        out[kind] = path
    return out


def _init(folders: dict[str, Path], tmp_path: Path, *extra: str, **names: str) -> list[str]:
    """The ``kd init`` argv (teacher, student and data given by their fixture names)."""
    return [
        "init",
        "--teacher",
        str(folders[names.get("teacher", "teacher")]),
        "--student",
        str(folders[names.get("student", "student")]),
        "--data",
        str(folders[names.get("data", "chat")]),
        "--output-dir",
        str(tmp_path / "out"),
        "--config-out",
        str(tmp_path / "kd.yaml"),
        "--max-seq-len",
        "64",
        "--device",
        "cpu",
        *extra,
    ]


def _written(tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "kd.yaml"
    # As kd run reads it: loads, and passes the schema and file checks.
    validate_config(load_config(str(path), []), check_paths=True, check_components=False)
    return yaml.safe_load(path.read_text())


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("kd: error: ")
    return err[0]


def _dims(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "vocab_size": spec["vocab"],
        "num_layers": spec["layers"],
        "num_heads": spec["heads"],
        "num_kv_heads": spec["kv_heads"],
        "embed_dim": spec["hidden"],
        "intermediate_dim": spec["inter"],
        "max_seq_len": 256,
        "tie_word_embeddings": spec["tied"],
    }


def test_torchtune_backend_chat_data(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path)) == 0
    out = capsys.readouterr().out
    cfg = _written(tmp_path)
    model, teacher = cfg["model"], cfg["teacher_model"]
    assert model["_component_"] == teacher["_component_"] == "torchtune.models.qwen2.qwen2"
    assert {k: model[k] for k in _dims(STUDENT)} == _dims(STUDENT)
    assert {k: teacher[k] for k in _dims(TEACHER)} == _dims(TEACHER)
    for key, folder in (("checkpointer", "student"), ("teacher_checkpointer", "teacher")):
        assert cfg[key]["checkpoint_dir"] == str(folders[folder])
        assert cfg[key]["checkpoint_files"] == ["model.safetensors"]
        assert cfg[key]["model_type"] == "QWEN2"
    assert cfg["tokenizer"] == {
        "_component_": "kd.hf.tokenizer",
        "path": str(folders["student"]),
        "max_seq_len": 64,
    }
    assert cfg["dataset"]["_component_"] == "torchtune.datasets.chat_dataset"
    assert cfg["dataset"]["conversation_column"] == "messages"
    assert cfg["dataset"]["conversation_style"] == "openai"
    assert cfg["dataset"]["data_files"] == str(folders["chat"])
    assert (cfg["device"], cfg["dtype"], cfg["memory"]["budget_gib"]) == ("cpu", "fp32", None)
    assert cfg["output_dir"] == str(tmp_path / "out")
    assert "memory plan (one device)" in out
    assert "fits" in out
    assert out.strip().splitlines()[-1] == f"next: kd run kd --config {tmp_path / 'kd.yaml'}"


def test_optimizer_is_fused_adamw(folders, tmp_path):
    # As the templates: one kernel per step (torch's CPU default is otherwise the for-loop
    # AdamW, 8x slower on a 99M-parameter student, docs/step_efficiency.md).
    assert cli.main(_init(folders, tmp_path)) == 0
    assert _written(tmp_path)["optimizer"] == {
        "_component_": "torch.optim.AdamW",
        "lr": 2e-05,
        "weight_decay": 0.01,
        "fused": True,
    }


def test_cpu_loss_chunk_size_keeps_loss_buffers_under_the_mmap_threshold(folders, tmp_path):
    # On a CPU each [chunk, vocab] fp32 buffer of the fused loss stays under glibc's 32 MiB mmap
    # threshold (docs/step_efficiency.md); the tiny fixtures' vocabulary keeps the default 1024.
    assert cli.main(_init(folders, tmp_path)) == 0
    written = _written(tmp_path)
    vocab = read_config_json(folders["student"], key="--student")["vocab_size"]
    assert written["loss_chunk_size"] == cpu_loss_chunk_size(vocab) == 1024
    sizes = {v: cpu_loss_chunk_size(v) for v in (32000, 49152, 128256, 151936)}
    assert sizes == {32000: 256, 49152: 128, 128256: 64, 151936: 32}
    for vocab, chunk in sizes.items():
        assert chunk * vocab * 4 <= GLIBC_MMAP_THRESHOLD_MAX < 2 * chunk * vocab * 4


def test_torchtune_backend_validates_and_trains(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path)) == 0
    config = str(tmp_path / "kd.yaml")
    assert cli.main(["validate", "--config", config]) == 0
    assert "config OK" in capsys.readouterr().out
    assert cli.main(["run", "kd", "--config", config, "max_steps_per_epoch=1"]) == 0
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 1 and rows[0]["kd_loss"] > 0
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


def test_transformers_backend_lora_student(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, "--lora", student="qwen3", data="instruct")) == 0
    out = capsys.readouterr().out
    cfg = _written(tmp_path)
    assert cfg["model"] == {
        "_component_": "kd.hf.lora_causal_lm",
        "path": str(folders["qwen3"]),
        "lora_attn_modules": ["q_proj", "v_proj"],
        "apply_lora_to_mlp": True,
        "lora_rank": 16,
        "lora_alpha": 32,
    }
    assert "checkpointer" not in cfg  # a Hugging Face folder is its own checkpoint
    assert cfg["teacher_model"]["_component_"] == "torchtune.models.qwen2.qwen2"
    assert cfg["optimizer"]["lr"] == pytest.approx(3e-4)
    assert "torchtune 0.6.1 has no qwen3 builder" in out


def test_transformers_backend_trains(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, "--lora", student="qwen3", data="instruct")) == 0
    config = str(tmp_path / "kd.yaml")
    assert cli.main(["validate", "--config", config]) == 0
    assert cli.main(["run", "kd_single_device", "--config", config, "max_steps_per_epoch=1"]) == 0
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 1 and rows[0]["kd_loss"] > 0
    assert (tmp_path / "out" / "final" / "config.json").is_file()


def test_backend_transformers_for_both(folders, tmp_path):
    assert cli.main(_init(folders, tmp_path, "--backend", "transformers", data="text")) == 0
    cfg = _written(tmp_path)
    assert cfg["model"] == {"_component_": "kd.hf.causal_lm", "path": str(folders["student"])}
    assert cfg["teacher_model"] == {
        "_component_": "kd.hf.causal_lm",
        "path": str(folders["teacher"]),
    }
    assert "checkpointer" not in cfg and "teacher_checkpointer" not in cfg
    assert cfg["dataset"]["_component_"] == "torchtune.datasets.text_completion_dataset"


@pytest.mark.parametrize(
    ("data", "component", "extra"),
    [
        (
            "instruct",
            "instruct_dataset",
            {"column_map": {"input": "instruction", "output": "output"}},
        ),
        ("alpaca", "alpaca_dataset", {"train_on_input": False}),
        ("text", "text_completion_dataset", {}),
    ],
)
def test_data_formats(folders, tmp_path, data, component, extra):
    assert cli.main(_init(folders, tmp_path, data=data)) == 0
    node = _written(tmp_path)["dataset"]
    assert node["_component_"] == f"torchtune.datasets.{component}"
    assert (node["source"], node["data_files"], node["split"]) == (
        "json",
        str(folders[data]),
        "train",
    )
    assert {k: node[k] for k in extra} == extra


def test_weights_not_downloaded_yet(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, teacher="pending")) == 0
    out = capsys.readouterr().out
    # kd init checks everything but the weight files the checkpointer will read.
    cfg = yaml.safe_load((tmp_path / "kd.yaml").read_text())
    assert cfg["teacher_checkpointer"]["checkpoint_files"] == ["model.safetensors"]
    assert "weights not downloaded yet" in (tmp_path / "kd.yaml").read_text()
    assert f"{folders['pending']} holds no *.safetensors yet" in out


def test_tokenizer_mismatch_refused(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, teacher="merged")) == 2
    line = _error_line(capsys)
    assert "tokenizers differ" in line
    assert str(folders["merged"]) in line and str(folders["student"]) in line
    assert "teacher id 256, student id 72" in line
    # The way out that works is named: kd init --cross-tokenizer.
    assert "or pass --cross-tokenizer to distil across tokenizers" in line
    assert "docs/multi_teacher.md" in line
    assert not (tmp_path / "kd.yaml").exists()


def test_special_token_mismatch_refused(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, teacher="extra")) == 2
    line = _error_line(capsys)
    assert "special token '<|tool|>'" in line and "teacher 259, student None" in line


def test_other_eos_choice_is_a_note(folders, tmp_path, capsys):
    # A base teacher beside an instruct student: every token has the same id in both.
    assert cli.main(_init(folders, tmp_path, teacher="base_eos")) == 0
    out = capsys.readouterr().out
    assert "note: the teacher's eos token is '<|endoftext|>' and the student's '<|im_end|>'" in out


def test_vocab_too_small_refused(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, student="small_vocab")) == 2
    line = _error_line(capsys)
    assert "token ids go up to 258" in line and "vocab_size 200" in line


def test_folder_without_tokenizer_refused(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, student="no_tokenizer")) == 2
    line = _error_line(capsys)
    assert line.startswith("kd: error: --student: ") and "has no tokenizer files" in line


def test_unknown_data_format_refused(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, data="unknown")) == 2
    line = _error_line(capsys)
    assert line.startswith("kd: error: --data: ")
    assert "(question, answer)" in line and "messages" in line and "text" in line


def test_config_out_exists_refused(folders, tmp_path, capsys):
    (tmp_path / "kd.yaml").write_text("keep: me\n")
    assert cli.main(_init(folders, tmp_path)) == 2
    line = _error_line(capsys)
    assert "already exists" in line and "--force" in line
    assert (tmp_path / "kd.yaml").read_text() == "keep: me\n"
    assert cli.main(_init(folders, tmp_path, "--force")) == 0
    assert _written(tmp_path)["model"]["_component_"] == "torchtune.models.qwen2.qwen2"


def test_a_flag_read_only_beside_another_is_refused_without_it(folders, tmp_path, capsys):
    """``--context`` is the self teacher's: without ``--self`` it is refused, not ignored (a
    config with a teacher and no context would be written); ``--cross-tokenizer`` with
    ``--self`` likewise. Nothing is written."""
    assert cli.main(_init(folders, tmp_path, "--context", "Reference: {reference}")) == 2
    line = _error_line(capsys)
    assert line == (
        "kd: error: --context: only read with --self (the self teacher's privileged context); "
        "add --self (and drop --teacher) for self-distillation, or drop --context"
    )
    argv = [a for a in _init(folders, tmp_path) if a not in ("--teacher", str(folders["teacher"]))]
    assert cli.main([*argv, "--self", "--cross-tokenizer"]) == 2
    assert _error_line(capsys).startswith("kd: error: --cross-tokenizer: not with --self")
    assert not (tmp_path / "kd.yaml").exists()


def test_backend_torchtune_refused_for_unsupported_model(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, "--backend", "torchtune", student="qwen3")) == 2
    line = _error_line(capsys)
    assert "--backend torchtune" in line and "no qwen3 builder" in line
    assert str(folders["qwen3"]) in line and "--backend auto" in line


def test_torchtune_families_of_other_token_ids_are_not_mixed(folders, tmp_path, capsys):
    # kd's config check refuses a torchtune qwen2 teacher beside a torchtune llama student (their
    # packages' tokenizers differ); these two share one tokenizer, so the teacher uses transformers.
    assert cli.main(_init(folders, tmp_path, student="llama")) == 0
    cfg = _written(tmp_path)
    assert cfg["model"]["_component_"] == "torchtune.models.llama3.llama3"
    assert cfg["checkpointer"]["model_type"] == "LLAMA3"
    assert cfg["teacher_model"] == {
        "_component_": "kd.hf.causal_lm",
        "path": str(folders["teacher"]),
    }
    assert "teacher_checkpointer" not in cfg
    capsys.readouterr()
    assert (
        cli.main(_init(folders, tmp_path, "--backend", "torchtune", "--force", student="llama"))
        == 2
    )
    assert "pass --backend auto" in _error_line(capsys)


def test_output_dir_inside_a_model_folder_refused(folders, tmp_path, capsys):
    argv = _init(folders, tmp_path)
    argv[argv.index("--output-dir") + 1] = str(folders["student"] / "run")
    assert cli.main(argv) == 2
    assert "is inside the student folder" in _error_line(capsys)


def test_max_seq_len_beyond_the_models_refused(folders, tmp_path, capsys):
    argv = _init(folders, tmp_path)
    argv[argv.index("--max-seq-len") + 1] = "4096"
    assert cli.main(argv) == 2
    assert "max_position_embeddings (256)" in _error_line(capsys)


def test_plan_over_budget_still_writes_the_config(folders, tmp_path, capsys):
    assert cli.main(_init(folders, tmp_path, "--budget-gib", "0.5")) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert _written(tmp_path)["memory"]["budget_gib"] == 0.5
    assert out[-1].startswith("the plan does not fit this device")


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {"tie_word_embeddings": True}),  # SmolLM2: llama3_2 with scale_factor 1
        ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE}),  # Llama 3.2
        ("llama", {"rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}}),  # Llama 3.1
        ("qwen2", {"tie_word_embeddings": True}),
    ],
)
def test_chosen_torchtune_builder_matches_transformers(tmp_path, model_type, extra):
    """The builder and checkpointer kd init writes give transformers' logits for the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kd import _torchtune as tt
    from kd.config.instantiate import locate_target
    from kd.scaffold.inspection import choose_model

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=384,
        rope_theta=500_000.0,
        **extra,
    )
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in hf.parameters():  # norms and biases away from 1 and 0 too
            param.add_(0.05 * torch.randn_like(param))
    hf.save_pretrained(tmp_path / "model")
    choice = choose_model(tmp_path / "model", role="student", flag="--student", backend="auto")
    node = choice.model_node(lora=False)
    builder, reason = locate_target(node.pop("_component_"), key="model", trust=False)
    assert reason is None
    model = builder(**node)
    ckpt = {**choice.checkpointer_node(), "output_dir": str(tmp_path / "out")}
    checkpointer, _ = locate_target(ckpt.pop("_component_"), key="checkpointer", trust=False)
    model.load_state_dict(checkpointer(**ckpt).load_checkpoint()[tt.MODEL_KEY])
    tokens = torch.randint(0, 96, (2, 320))
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(tokens), hf.eval()(tokens).logits, atol=1e-4, rtol=1e-4
        )


# ---------------------------------------- whole vocabularies, chat templates, roles, options
def _tokenizer_variant(folders: dict[str, Path], dest: Path, **tokenizer: Any) -> Path:
    """A folder with the student's config.json and write_hf_tokenizer's files (no weights)."""
    dest.mkdir()
    shutil.copyfile(folders["student"] / "config.json", dest / "config.json")
    return write_hf_tokenizer(dest, **tokenizer)


def test_two_swapped_token_ids_are_refused(folders, tmp_path, capsys):
    # Ids 1 and 2 (bytes \x01 and \x02) swapped: no probe text holds them, every special token
    # keeps its id, yet the teacher's id 1 is the student's id 2.
    swapped = _tokenizer_variant(folders, tmp_path / "swapped")
    path = swapped / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    one, two = (next(t for t, i in vocab.items() if i == k) for k in (1, 2))
    vocab[one], vocab[two] = 2, 1
    path.write_text(json.dumps(data))
    folders = {**folders, "swapped": swapped}
    assert cli.main(_init(folders, tmp_path, teacher="swapped")) == 2
    line = _error_line(capsys)
    assert "tokenizers differ" in line and str(swapped) in line and str(folders["student"]) in line
    assert f"map token id 1 to different tokens (teacher {two!r}, student {one!r})" in line
    assert not (tmp_path / "kd.yaml").exists()


# The words of the one line for each broken student template (kd init's probe conversation).
BROKEN = {
    "syntax": ("{% for m in messages %}{{ m['content'] }}", "is not valid Jinja"),
    "sandbox": ("{{ ''.__class__.__mro__ }}", "does something jinja2's sandbox forbids"),
    "raise_exception": ("{{ raise_exception('no') }}", "stopped with its own error"),
    "endless": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "did not finish rendering one conversation in 0.5 s",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_student_template_that_cannot_render_is_refused(
    folders, tmp_path, capsys, monkeypatch, name
):
    from kd.hf import tokenization

    monkeypatch.setattr(tokenization, "TEMPLATE_TIME_LIMIT_S", 0.5)
    template, words = BROKEN[name]
    broken = _tokenizer_variant(folders, tmp_path / "broken")
    config = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert cli.main(_init({**folders, "broken": broken}, tmp_path, student="broken")) == 2
    line = _error_line(capsys)
    assert line.startswith(f"kd: error: --student: the chat template of {broken} ")
    assert words in line and "fix or replace the folder's chat_template" in line
    assert not (tmp_path / "kd.yaml").exists()


def test_a_template_that_fails_on_the_data_rows_is_refused(folders, tmp_path, capsys):
    # Renders the probe (user, assistant) but refuses the data's system messages.
    no_system = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    student = _tokenizer_variant(folders, tmp_path / "no_system")
    config = json.loads((student / "tokenizer_config.json").read_text())
    config["chat_template"] = no_system
    (student / "tokenizer_config.json").write_text(json.dumps(config))
    data = tmp_path / "system.jsonl"
    row = {
        "messages": [{"role": "system", "content": "Be brief."}, *_rows("chat", 1)[0]["messages"]]
    }
    data.write_text(json.dumps(row) + "\n")
    names = {**folders, "no_system": student, "system": data}
    assert cli.main(_init(names, tmp_path, student="no_system", data="system")) == 2
    line = _error_line(capsys)
    assert "the chat template of tokenizer.path" in line and str(student) in line
    assert "System role not supported" in line
    assert not (tmp_path / "kd.yaml").exists()


def test_a_chat_role_kd_does_not_render_is_refused_with_its_row(folders, tmp_path, capsys):
    rows = _rows("chat", 5)
    rows[3]["messages"].insert(1, {"role": "narrator", "content": "(pause)"})
    data = tmp_path / "roles.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(_init({**folders, "roles": data}, tmp_path, data="roles")) == 2
    line = _error_line(capsys)
    assert line.startswith("kd: error: --data: row 4, message 2 has role 'narrator'")
    assert not (tmp_path / "kd.yaml").exists()


def _uncommented(text: str, keys: tuple[str, ...]) -> str:
    """The config with the commented blocks of ``keys`` turned on (their ``# `` removed)."""
    out, inside = [], False
    for line in text.splitlines():
        body = line[2:] if line.startswith("# ") else None
        if body is not None and any(body.startswith(f"{k}:") for k in keys):
            inside = True
        elif body is None or not body.startswith("  "):
            inside = False
        out.append(body if inside and body is not None else line)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize(
    "keys",
    [
        ("validation", "keep_best", "early_stopping"),
        ("teacher_logits",),
        ("on_policy",),
        ("teacher_server",),
        ("eval",),
    ],
)
def test_optional_features_are_written_commented_and_validate_when_turned_on(
    folders, tmp_path, keys
):
    from kd.cli.features import doc_of

    assert cli.main(_init(folders, tmp_path)) == 0
    text = (tmp_path / "kd.yaml").read_text()
    assert all(f"\n# {key}:" in text for key in keys)
    assert all(doc_of(key) in text for key in keys)  # each block names its page
    assert not any(key in yaml.safe_load(text) for key in keys)  # off as written
    shutil.copyfile(folders["chat"], folders["chat"].with_name("val.jsonl"))
    turned_on = tmp_path / "on.yaml"
    on = yaml.safe_load(_uncommented(text, keys))
    if keys == ("teacher_server",):  # in place of the model teacher, as its comment says
        del on["teacher_model"], on["teacher_checkpointer"]
    turned_on.write_text(yaml.safe_dump(on))
    cfg = load_config(str(turned_on), [])
    for key in keys:
        assert cfg[key] is not None
    validate_config(cfg, check_paths=False, check_components=False)
    if keys[0] == "validation":
        assert cfg.validation.dataset.data_files == str(folders["chat"].with_name("val.jsonl"))
        validate_config(cfg, check_paths=True, check_components=False)


def test_the_config_points_to_every_other_kind_of_teacher(folders, tmp_path):
    from kd.cli.features import doc_of

    assert cli.main(_init(folders, tmp_path)) == 0
    text = (tmp_path / "kd.yaml").read_text()
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for section in ("teachers", "teacher_server", "self_teacher", "cross_tokenizer"):
        assert f"{section}:" in comments and doc_of(section) in comments, section


def test_a_terminal_is_told_what_kd_init_is_doing(folders, tmp_path, capsys, monkeypatch):
    """On a terminal, each long phase says so first (issue 42); piped, stderr stays empty (the
    other tests read kd init's one error line)."""
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(_init(folders, tmp_path)) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == [
        "kd: comparing the tokenizers (every token id) and rendering the data's first rows",
        "kd: reading both config.json files with transformers",
        f"kd: validating {tmp_path / 'kd.yaml'} as kd run will read it",
    ]
