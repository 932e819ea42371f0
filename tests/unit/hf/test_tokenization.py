"""kd.hf.tokenizer: a Hugging Face folder's tokenizer for torchtune's datasets and kd's data code.

The chat mask is checked against the chat template's own output (transformers'
``apply_chat_template``): tokens equal, and exactly the assistant replies with their end of turn
trained.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kd import _torchtune as tt
from kd.cli import main
from kd.config.instantiate import instantiate, locate_target
from kd.data import check_dataset, pad_id_of
from kd.errors import KDUserError
from kd.hf import tokenizer as build_tokenizer
from kd.hf.tokenization import HFTokenizer
from kd.models import checked_tokenizer, tokenizer_files, tokenizer_max_id
from kd.testing import (
    CHATML,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    TOKENIZER_VOCAB_SIZE,
    hf_tokenizer_node,
    tokenizer_node,
    write_hf_tokenizer,
    write_jsonl,
    write_tokenizer,
)
from tests.conftest import MAX_SEQ_LEN, make_config, write_config

Message = tt.Message
TEXTS = ["Hello, world! 1+2=3.", "caf\u00e9 na\u00efve \u65e5\u672c", "  two\n\nlines\t", ""]
# A template that renders the last message differently from earlier ones (as Qwen3's does with
# its <think> block): no prefix of a conversation renders as the start of the whole.
UNSPLITTABLE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if loop.last %}{{ 'final: ' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_tokenizer(tmp_path_factory.mktemp("hf_tok"))


@pytest.fixture(scope="module")
def tok(folder: Path) -> HFTokenizer:
    return build_tokenizer(str(folder))


def conversation() -> list[Message]:
    return [
        Message("system", "Be brief.", masked=True),
        Message("user", "Hi", masked=True),
        Message("assistant", "Hello!"),
        Message("user", "2+2?", masked=True),
        Message("assistant", "4"),
    ]


def chatml(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def expected(tok: HFTokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Tokens and mask of text pieces, each with its mask (the tiny tokenizer has no merges, so
    pieces tokenize independently)."""
    tokens: list[int] = []
    mask: list[bool] = []
    for text, masked in pieces:
        ids = tok.encode(text, add_bos=False, add_eos=False)
        tokens += ids
        mask += [masked] * len(ids)
    return tokens, mask


def hf_chat(messages: list[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text_content} for m in messages]


def trained_text(tok: HFTokenizer, tokens: list[int], mask: list[bool]) -> str:
    return tok.decode([t for t, m in zip(tokens, mask, strict=True) if not m], False)


# ----------------------------------------------------------------------------- the folder
def test_folder_has_the_ids_of_write_tokenizer(folder: Path, tmp_path: Path) -> None:
    reference = instantiate(tokenizer_node(write_tokenizer(tmp_path / "tt")), key="tokenizer")
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert len(hf) == TOKENIZER_VOCAB_SIZE
    special = "<|im_start|>user\nhi<|im_end|><|endoftext|>"
    for text in [*TEXTS, special]:
        assert hf.encode(text, add_special_tokens=False) == reference.encode(text, False, False)
    assert hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        ENDOFTEXT_ID,
        IM_START_ID,
        IM_END_ID,
    ]
    assert hf.chat_template == CHATML
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHATML


# --------------------------------------------------------------------------- plain text
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: HFTokenizer, text: str) -> None:
    ids = tok.encode(text, add_bos=False, add_eos=False)
    assert tok.decode(ids) == text
    assert ids == list(text.encode("utf-8"))  # one token per byte: ids 0..255 are the bytes


def test_decode_keeps_special_tokens_only_when_asked(tok: HFTokenizer) -> None:
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_bos=False, add_eos=False)
    assert ids == [IM_START_ID, *b"hi", IM_END_ID]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_add_bos_add_eos_without_a_bos_token(tok: HFTokenizer) -> None:
    assert tok.bos_id is None and tok.eos_id == IM_END_ID
    assert tok.encode("ab") == [*b"ab", IM_END_ID]
    assert tok.encode("ab", add_bos=True, add_eos=False) == list(b"ab")


def test_bos_is_added_once_when_the_post_processor_adds_it(tmp_path: Path) -> None:
    folder = write_hf_tokenizer(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "bos_token": "<|endoftext|>"})
    )
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {
                "id": "<|endoftext|>",
                "ids": [ENDOFTEXT_ID],
                "tokens": ["<|endoftext|>"],
            }
        },
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tok = build_tokenizer(str(folder))
    assert tok._hf.encode("ab") == [ENDOFTEXT_ID, *b"ab"]  # the folder's own post-processor
    assert tok.bos_id == ENDOFTEXT_ID
    assert tok.encode("ab") == [ENDOFTEXT_ID, *b"ab", IM_END_ID]
    assert tok.encode("ab", add_bos=False, add_eos=False) == list(b"ab")
    assert tok.encode("ab", add_bos=True, add_eos=False) == [ENDOFTEXT_ID, *b"ab"]


def test_sizes_and_ids_for_kd_checks(tok: HFTokenizer, folder: Path) -> None:
    assert tok.vocab_size == TOKENIZER_VOCAB_SIZE == len(AutoTokenizer.from_pretrained(folder))
    assert tokenizer_max_id(tok) == TOKENIZER_VOCAB_SIZE - 1
    assert tok.pad_id == ENDOFTEXT_ID and pad_id_of(tok) == ENDOFTEXT_ID
    assert tok.special_tokens["<|im_end|>"] == IM_END_ID and len(tok.special_tokens) == 22
    assert tok.chat_template == CHATML


# ------------------------------------------------------------------------------- chat mask
def test_chat_mask_against_the_templates_own_output(tok: HFTokenizer) -> None:
    messages = conversation()
    tokens, mask = tok.tokenize_messages(messages)
    ids = tok._hf.apply_chat_template(hf_chat(messages), tokenize=True, return_dict=False)
    assert tokens == ids
    assert trained_text(tok, tokens, mask) == "Hello!<|im_end|>\n4<|im_end|>\n"
    assert (tokens, mask) == expected(
        tok,
        [
            (chatml("system", "Be brief.") + chatml("user", "Hi"), True),
            ("<|im_start|>assistant\n", True),  # the generation prompt: never trained
            ("Hello!<|im_end|>\n", False),
            (chatml("user", "2+2?") + "<|im_start|>assistant\n", True),
            ("4<|im_end|>\n", False),
        ],
    )


def test_masked_assistant_and_train_on_input(tok: HFTokenizer) -> None:
    user = Message("user", "Hi", masked=False)  # train_on_input=True
    tokens, mask = tok.tokenize_messages([user, Message("assistant", "Yo", masked=True)])
    assert len(tokens) == len(mask) and trained_text(tok, tokens, mask) == chatml("user", "Hi")
    tokens, mask = tok.tokenize_messages([user, Message("assistant", "Yo")])
    assert (tokens, mask) == expected(
        tok,
        [
            (chatml("user", "Hi"), False),
            ("<|im_start|>assistant\n", True),
            ("Yo<|im_end|>\n", False),
        ],
    )


def test_inference_ends_with_the_generation_prompt_or_an_open_reply(tok: HFTokenizer) -> None:
    prompt = {"messages": [Message("user", "Hi", masked=True)], "id": 7}
    out = tok(prompt, inference=True)
    assert out["id"] == 7 and "messages" not in out and all(out["mask"])
    assert tok.decode(out["tokens"], False) == chatml("user", "Hi") + "<|im_start|>assistant\n"
    tokens, mask = tok.tokenize_messages(
        [Message("user", "Hi", masked=True), Message("assistant", "Yo")], add_end_tokens=False
    )
    assert tok.decode(tokens, False) == chatml("user", "Hi") + "<|im_start|>assistant\nYo"
    assert trained_text(tok, tokens, mask) == "Yo"


def test_truncation(folder: Path, tok: HFTokenizer) -> None:
    messages = conversation()
    full, full_mask = tok.tokenize_messages(messages)
    right = build_tokenizer(str(folder), max_seq_len=40)
    tokens, mask = right.tokenize_messages(messages)
    assert len(tokens) == len(mask) == 40
    assert tokens[:-1] == full[:39] and mask[:-1] == full_mask[:39]
    assert tokens[-1] == IM_END_ID and mask[-1] is True  # torchtune's truncate: eos, masked
    left = build_tokenizer(str(folder), max_seq_len=40, truncation_type="left")
    assert left.tokenize_messages(messages) == (full[-40:], full_mask[-40:])
    long_enough = build_tokenizer(str(folder), max_seq_len=len(full))
    assert long_enough.tokenize_messages(messages) == (full, full_mask)  # nothing replaced
    sample = right({"messages": messages})
    assert len(sample["tokens"]) == len(sample["mask"]) == 40
    with pytest.raises(KDUserError, match=r"^tokenizer\.truncation_type: 'middle'"):
        build_tokenizer(str(folder), truncation_type="middle")


def test_without_a_chat_template_contents_are_concatenated(tmp_path: Path) -> None:
    tok = build_tokenizer(str(write_hf_tokenizer(tmp_path, chat_template=None)))
    assert tok.chat_template is None
    tokens, mask = tok.tokenize_messages(conversation())
    assert (tokens, mask) == expected(
        tok,
        [
            ("Be brief.Hi", True),
            ("Hello!<|im_end|>", False),
            ("2+2?", True),
            ("4<|im_end|>", False),
        ],
    )


def test_an_unsplittable_template_is_refused(tmp_path: Path) -> None:
    tok = build_tokenizer(str(write_hf_tokenizer(tmp_path, chat_template=UNSPLITTABLE)))
    with pytest.raises(KDUserError) as err:
        tok.tokenize_messages(conversation())
    message = str(err.value)
    assert message.startswith(f"tokenizer.path: the chat template of {tmp_path} cannot be split")
    assert "\n" not in message
    # kd's data check passes it on as is (it names its own key).
    rows = write_jsonl(tmp_path / "chat.jsonl", [{"messages": hf_chat(conversation()[1:3])}])
    with pytest.raises(
        KDUserError, match=r"^tokenizer\.path: the chat template .* cannot be split"
    ):
        check_dataset(_chat_dataset(tok, rows), max_seq_len=None)


def test_a_template_error_names_the_tokenizer(tmp_path: Path) -> None:
    refusing = "{{ raise_exception('roles must alternate') }}"
    tok = build_tokenizer(str(write_hf_tokenizer(tmp_path, chat_template=refusing)))
    with pytest.raises(
        KDUserError, match=r"^dataset: the chat template of tokenizer\.path .*alternate"
    ):
        tok.tokenize_messages(conversation())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    system=st.none() | st.text(max_size=8),
    turns=st.lists(
        st.tuples(st.text(max_size=12), st.text(max_size=12), st.booleans(), st.booleans()),
        min_size=1,
        max_size=4,
    ),
    max_seq_len=st.none() | st.integers(1, 80),
)
def test_random_conversations(tok: HFTokenizer, system, turns, max_seq_len) -> None:
    messages = [] if system is None else [Message("system", system, masked=True)]
    pieces = [] if system is None else [(chatml("system", system), True)]
    for user, reply, train_on_input, reply_masked in turns:
        messages += [
            Message("user", user, masked=not train_on_input),
            Message("assistant", reply, masked=reply_masked),
        ]
        pieces += [
            (chatml("user", user), not train_on_input),
            ("<|im_start|>assistant\n", True),
            (reply + "<|im_end|>\n", reply_masked),
        ]
    tokens, mask = tok.tokenize_messages(messages)
    ids = tok._hf.apply_chat_template(hf_chat(messages), tokenize=True, return_dict=False)
    assert tokens == ids
    assert (tokens, mask) == expected(tok, pieces)
    tok.max_seq_len = max_seq_len
    try:
        cut, cut_mask = tok.tokenize_messages(messages)
    finally:
        tok.max_seq_len = None
    if max_seq_len is None or len(tokens) <= max_seq_len:
        assert (cut, cut_mask) == (tokens, mask)
    else:
        assert len(cut) == len(cut_mask) == max_seq_len
        assert cut[:-1] == tokens[: max_seq_len - 1]
        assert cut_mask[:-1] == mask[: max_seq_len - 1]
        assert (cut[-1], cut_mask[-1]) == (IM_END_ID, True)


# ------------------------------------------------------------------- torchtune's datasets
def _chat_dataset(tok: HFTokenizer, rows: Path):
    from torchtune.datasets import chat_dataset

    return chat_dataset(
        tok,
        source="json",
        data_files=str(rows),
        conversation_column="messages",
        conversation_style="openai",
        split="train",
    )


def labelled_text(tok: HFTokenizer, example: dict) -> str:
    labels = [int(x) for x in example["labels"]]
    assert len(labels) == len(example["tokens"])
    for label, token in zip(labels, example["tokens"], strict=True):
        assert label in (-100, token)
    return tok.decode([x for x in labels if x != -100], skip_special_tokens=False)


def test_instruct_dataset(tok: HFTokenizer, tmp_path: Path) -> None:
    from torchtune.datasets import instruct_dataset

    rows = write_jsonl(
        tmp_path / "d.jsonl", [{"input": "1+1", "output": "2"}, {"input": "a", "output": "bc"}]
    )
    dataset = instruct_dataset(tok, source="json", data_files=str(rows), split="train")
    assert [labelled_text(tok, dataset[i]) for i in range(2)] == ["2<|im_end|>\n", "bc<|im_end|>\n"]
    assert tok.decode(dataset[0]["tokens"], False) == chatml("user", "1+1") + chatml(
        "assistant", "2"
    )
    assert check_dataset(dataset, max_seq_len=None) == (0, 2)


def test_chat_dataset_openai_messages(tok: HFTokenizer, tmp_path: Path) -> None:
    rows = write_jsonl(tmp_path / "c.jsonl", [{"messages": hf_chat(conversation())}])
    example = _chat_dataset(tok, rows)[0]
    assert labelled_text(tok, example) == "Hello!<|im_end|>\n4<|im_end|>\n"
    ids = tok._hf.apply_chat_template(hf_chat(conversation()), tokenize=True, return_dict=False)
    assert example["tokens"] == ids


def test_text_completion_dataset(tok: HFTokenizer, tmp_path: Path) -> None:
    from torchtune.datasets import text_completion_dataset

    rows = write_jsonl(tmp_path / "t.jsonl", [{"text": "Once upon a time"}])
    example = text_completion_dataset(tok, source="json", data_files=str(rows), split="train")[0]
    assert example["tokens"] == [*b"Once upon a time", IM_END_ID] == example["labels"]


# ---------------------------------------------------------------- config, errors, pickling
def test_config_node_builds_through_the_allow_list(folder: Path) -> None:
    node = hf_tokenizer_node(folder, max_seq_len=32)
    assert node["_component_"] == "kd.hf.tokenizer"
    assert locate_target("kd.hf.tokenizer", key="tokenizer", trust=False) == (build_tokenizer, None)
    tok = checked_tokenizer(lambda: instantiate(node, key="tokenizer"), tokenizer_files(node))
    assert isinstance(tok, HFTokenizer) and tok.max_seq_len == 32


def test_kd_validate_accepts_it_for_a_torchtune_student(assets, tmp_path, capsys) -> None:
    """Allow-list, family check, file checks, vocab check and data check: the whole pre-load."""
    node = hf_tokenizer_node(write_hf_tokenizer(tmp_path / "tok"), MAX_SEQ_LEN)
    cfg = make_config(assets, tmp_path / "out", tokenizer=node)
    path = str(write_config(tmp_path / "c.yaml", cfg))
    assert main(["validate", "--config", path, "memory.check=off"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.splitlines() == ["config OK"]
    missing = f"tokenizer.path={tmp_path / 'nowhere'}"
    assert main(["validate", "--config", path, "memory.check=off", missing]) == 2
    assert "tokenizer.path" in capsys.readouterr().err


def test_missing_folder_or_files(tmp_path: Path) -> None:
    with pytest.raises(KDUserError, match=r"^tokenizer\.path: .*nowhere does not exist; point"):
        build_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(KDUserError, match=r"^tokenizer\.path: .* has neither tokenizer\.json"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(KDUserError, match=r"^tokenizer\.path: transformers cannot load"):
        build_tokenizer(str(tmp_path))


def test_pickles_for_dataloader_workers(tok: HFTokenizer) -> None:
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.tokenize_messages(conversation()) == tok.tokenize_messages(conversation())


def test_import_does_not_load_transformers() -> None:
    code = "import sys, kd.hf.tokenization; print('transformers' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip().splitlines()[-1] == "False", result.stderr


# ------------------------------------------------------- templates that fail, roles, rows
# Templates that cannot render any conversation, and the words of their one line.
BROKEN_TEMPLATES = {
    "syntax": ("{% for m in messages %}{{ m['content'] }}", "is not valid Jinja (line 1"),
    "sandbox": ("{{ ''.__class__.__mro__ }}", "does something jinja2's sandbox forbids"),
    "mutation": ("{{ messages.append(1) }}", "does something jinja2's sandbox forbids"),
    "raise_exception": (
        "{{ raise_exception('only user and assistant roles') }}",
        "stopped with its own error (TemplateError: only user and assistant roles)",
    ),
    "endless": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "did not finish rendering one conversation in 0.5 s",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN_TEMPLATES))
def test_a_template_that_cannot_render_is_blamed_in_one_line(
    name: str, tmp_path: Path, tok: HFTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kd.hf import tokenization

    monkeypatch.setattr(tokenization, "TEMPLATE_TIME_LIMIT_S", 0.5)
    template, words = BROKEN_TEMPLATES[name]
    broken = build_tokenizer(str(write_hf_tokenizer(tmp_path, chat_template=template)))
    with pytest.raises(KDUserError) as err:
        broken.tokenize_messages(conversation())
    message = str(err.value)
    assert message.startswith(f"dataset: the chat template of tokenizer.path ({tmp_path}) ")
    assert words in message and "\n" not in message
    assert "fix or replace the folder's chat_template" in message
    # Nothing is left behind: the next renderings (this thread, same process) are whole.
    for _ in range(3):
        assert tok.tokenize_messages(conversation()) == tok.tokenize_messages(conversation())


def test_the_time_limit_stops_a_template_in_any_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from kd.hf import tokenization

    monkeypatch.setattr(tokenization, "TEMPLATE_TIME_LIMIT_S", 0.3)
    template = BROKEN_TEMPLATES["endless"][0]
    broken = build_tokenizer(str(write_hf_tokenizer(tmp_path, chat_template=template)))
    errors: list[str] = []

    def render() -> None:
        try:
            broken.tokenize_messages(conversation())
        except KDUserError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=render) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all("did not finish rendering" in e for e in errors)


@pytest.mark.parametrize("role", ["narrator", "function", "developer", "User"])
def test_a_role_kd_does_not_render_is_refused(tok: HFTokenizer, role: str) -> None:
    messages = [*conversation()[:2], Message(role, "hm", masked=True), *conversation()[2:]]  # type: ignore[arg-type]
    with pytest.raises(KDUserError, match=rf"^dataset: message 3 has role '{role}', which kd"):
        tok.tokenize_messages(messages)
    # tool results (torchtune's "ipython", OpenAI's "tool") are rendered.
    tool = [*conversation()[:3], Message("ipython", "42", masked=True)]
    assert tok.tokenize_messages(tool)[0]


def test_kd_run_names_the_row_of_a_bad_role(tok: HFTokenizer, tmp_path: Path) -> None:
    good = {"messages": hf_chat(conversation()[1:3])}
    bad = {"messages": [*hf_chat(conversation()[1:3]), {"role": "narrator", "content": "x"}]}
    rows = write_jsonl(tmp_path / "chat.jsonl", [good, good, bad, good])
    dataset = _chat_dataset(tok, rows)
    line = r"^dataset: row 3, message 3 has role 'narrator', which kd does not render; use system"
    with pytest.raises(KDUserError, match=line):
        check_dataset(dataset, max_seq_len=None)  # kd validate / kd run before training
    from kd.data import build_dataloader, next_micro_batches

    loader, _ = build_dataloader(dataset, batch_size=1, shuffle=False, seed=0, pad_id=0)
    batches = iter(loader)
    next_micro_batches(batches, count=2, step=1)
    with pytest.raises(KDUserError, match=r"step 2 failed .*dataset: row 3, message 3 has role"):
        next_micro_batches(batches, count=2, step=2)  # during training
