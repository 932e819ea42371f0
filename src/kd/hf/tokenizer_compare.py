"""Two tokenizers compared: a teacher's against the student's (``kd run``'s checks, ``kd init``'s
pairing): the probe text's encodings, the special tokens and the whole vocabularies
(:func:`compare_tokenizers`); a tokenizer folder loaded by transformers (:func:`load_hf_tokenizer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kd import folders
from kd.errors import KDUserError, brief, one_line
from kd.hf.tokenization import render_chat_template

# Plain ASCII that every real vocabulary covers (byte-level BPE, tiktoken, sentencepiece): the
# probe of a tokenizer's files (kd.models) and of two tokenizers' agreement.
TOKENIZER_PROBE = "Hello, world! 1+2=3."

# Files a Hugging Face tokenizer is loaded from (any one of them makes a tokenizer folder).
HF_TOKENIZER_FOLDER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


# ------------------------------------------------------------ two folders, one tokenizer?
class TokenizersDiffer(KDUserError):
    """Two tokenizers that do not map every text to the same ids (:func:`compare_tokenizers`);
    ``kd init`` then writes a cross-tokenizer config (:mod:`kd.teachers.cross`)."""


@dataclass(frozen=True)
class TokenizerCheck:
    """What :func:`compare_tokenizers` found.

    Attributes:
        probes: the texts both tokenizers encoded to the same ids.
        size: token ids the tokenizers use (the largest id + 1); every one maps to the same token
            in both.
        chat_template: the student's tokenizer has a chat template (it rendered the probe).
        notes: differences that do not change any id (e.g. a different eos choice).
    """

    probes: tuple[str, ...]
    size: int
    chat_template: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def summary(self) -> str:
        """What was compared, for ``kd init``'s output."""
        return (
            f"{self.size} token ids, each the same token in both, the same special tokens; the "
            f"same ids on {len(self.probes)} probes"
        )


def load_hf_tokenizer(folder: Path, *, flag: str) -> Any:
    """The tokenizer of a model folder, loaded offline with ``AutoTokenizer``.

    Raises:
        KDUserError: the folder holds no tokenizer files, or transformers cannot load them.
    """
    if not any((folder / name).is_file() for name in HF_TOKENIZER_FOLDER_FILES):
        raise KDUserError(
            f"{flag}: {one_line(str(folder))} has no tokenizer files (tokenizer.json / "
            "tokenizer_config.json); download them from the model's source into that folder"
        )
    folders.check_folder(folder, key=flag)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # noqa: BLE001 - a damaged folder raises anything
        raise KDUserError(
            f"{flag}: transformers cannot load the tokenizer in {one_line(str(folder))} "
            f"({brief(e)}); restore its tokenizer files from the model's source"
        ) from e


def _chat_probe(tokenizer: Any, folder: Path) -> str:
    """A short conversation rendered by ``tokenizer``'s chat template (ChatML when it has none).

    Raises:
        KDUserError: the template fails to render it (:func:`render_chat_template`, blaming the
            student's template: ``kd run`` would fail on the same rendering).
    """
    messages = [
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42."},
    ]
    if getattr(tokenizer, "chat_template", None):
        where = f"--student: the chat template of {one_line(str(folder))}"
        return render_chat_template(tokenizer, [messages], where=where)[0]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _special_tokens(tokenizer: Any) -> set[str]:
    """Special tokens of a tokenizer: bos/eos/pad/unk and the added special tokens."""
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return names | {str(t) for t in decoder.values() if getattr(t, "special", False)}


def compare_tokenizers(
    teacher: Path, student: Path, *, teacher_vocab: int, student_vocab: int
) -> TokenizerCheck:
    """Check that teacher and student tokenize alike, so KD can compare them id by id.

    The student's chat template must render a conversation (:func:`render_chat_template`). Then
    both tokenizers must (1) encode the same probes (:data:`TOKENIZER_PROBE`, a non-ASCII line
    and that conversation) to the same ids: this tests the encoding rules (merges, normalizer,
    pre-tokenizer) that a vocabulary alone does not fix; (2) give every special token of either
    (bos/eos/pad/unk and the added special tokens) the same id; (3) hold the same whole
    vocabulary: every id maps to the same token in both (two tokenizers with two ids swapped
    differ). A different choice of eos or pad token between two tokenizers that map every token
    alike (a base and an instruct model) changes no id: it is reported as a note (the data uses
    the student's).

    Args:
        teacher: the teacher's folder.
        student: the student's folder.
        teacher_vocab: the teacher's ``vocab_size`` (embedding rows).
        student_vocab: the student's ``vocab_size``.

    Raises:
        KDUserError: a folder without a loadable tokenizer, a student chat template that cannot
            render, the first difference between the two (one line naming both folders), or
            token ids beyond a model's vocab_size.
    """
    t_tok = load_hf_tokenizer(teacher, flag="--teacher")
    s_tok = load_hf_tokenizer(student, flag="--student")
    pair = f"the teacher {one_line(str(teacher))} and the student {one_line(str(student))}"
    probes = (TOKENIZER_PROBE, "Grüße, 世界! naïve café ½ → 🙂", _chat_probe(s_tok, student))
    for text in probes:
        _compare_encodings(t_tok, s_tok, text, pair)
    t_vocab, s_vocab = t_tok.get_vocab(), s_tok.get_vocab()
    _compare_special_tokens(t_tok, s_tok, t_vocab, s_vocab, pair)
    _compare_vocabularies(t_vocab, s_vocab, pair)
    size = max(max(t_vocab.values(), default=-1), max(s_vocab.values(), default=-1)) + 1
    for role, folder, rows in (
        ("teacher", teacher, teacher_vocab),
        ("student", student, student_vocab),
    ):
        if size > rows:
            raise KDUserError(
                f"tokenizers: token ids go up to {size - 1} but the {role} "
                f"{one_line(str(folder))} has vocab_size {rows} (embedding rows); KD needs every "
                "token id in both models: use the tokenizer files that came with the models"
            )
    notes = []
    for role in ("bos", "eos", "pad"):
        t_name = getattr(t_tok, f"{role}_token", None)
        s_name = getattr(s_tok, f"{role}_token", None)
        if t_name != s_name:
            notes.append(
                f"the teacher's {role} token is {t_name!r} and the student's {s_name!r} (same ids "
                "in both); the data is tokenized with the student's"
            )
    return TokenizerCheck(
        probes=probes,
        size=size,
        chat_template=bool(getattr(s_tok, "chat_template", None)),
        notes=tuple(notes),
    )


_SAME_TOKENIZER_FIX = (
    "KD compares the two models token id by token id: pick models that share one tokenizer"
)


def _compare_encodings(t_tok: Any, s_tok: Any, text: str, pair: str) -> None:
    t_ids = t_tok.encode(text, add_special_tokens=False)
    s_ids = s_tok.encode(text, add_special_tokens=False)
    if t_ids == s_ids:
        return
    i = next(
        (k for k, (a, b) in enumerate(zip(t_ids, s_ids, strict=False)) if a != b),
        min(len(t_ids), len(s_ids)),
    )
    t_at = t_ids[i] if i < len(t_ids) else "end"
    s_at = s_ids[i] if i < len(s_ids) else "end"
    raise TokenizersDiffer(
        f"tokenizers differ: {pair} encode {text[:40]!r} differently (token {i}: teacher "
        f"id {t_at}, student id {s_at}); {_SAME_TOKENIZER_FIX}"
    )


def _compare_special_tokens(
    t_tok: Any, s_tok: Any, t_vocab: Mapping[str, int], s_vocab: Mapping[str, int], pair: str
) -> None:
    for name in sorted(
        _special_tokens(t_tok) | _special_tokens(s_tok),
        key=lambda n: (min(t_vocab.get(n, math.inf), s_vocab.get(n, math.inf)), n),
    ):
        t_id, s_id = t_vocab.get(name), s_vocab.get(name)
        if t_id != s_id:
            raise TokenizersDiffer(
                f"tokenizers differ: {pair} give the special token {name!r} different ids "
                f"(teacher {t_id}, student {s_id}); {_SAME_TOKENIZER_FIX}"
            )


def _compare_vocabularies(
    t_vocab: Mapping[str, int], s_vocab: Mapping[str, int], pair: str
) -> None:
    """Every id names the same token in both vocabularies (added tokens included)."""
    if t_vocab == s_vocab:
        return
    t_tokens = {i: t for t, i in t_vocab.items()}
    s_tokens = {i: t for t, i in s_vocab.items()}
    i = min(k for k in t_tokens.keys() | s_tokens.keys() if t_tokens.get(k) != s_tokens.get(k))
    t_at, s_at = t_tokens.get(i), s_tokens.get(i)
    raise TokenizersDiffer(
        f"tokenizers differ: {pair} map token id {i} to different tokens (teacher "
        f"{one_line(repr(t_at)) if t_at is not None else 'none'}, student "
        f"{one_line(repr(s_at)) if s_at is not None else 'none'}); {_SAME_TOKENIZER_FIX}"
    )
