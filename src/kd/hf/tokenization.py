"""Tokenizers of local Hugging Face folders for torchtune's datasets and kd's data code.

``_component_: kd.hf.tokenizer`` with ``path`` (a folder holding ``tokenizer.json`` and/or
``tokenizer_config.json``, e.g. a model folder) loads the folder with transformers'
``AutoTokenizer`` (never downloading) and wraps it as :class:`HFTokenizer`, which speaks torchtune
0.6.1's tokenizer protocols: ``encode``/``decode`` for ``text_completion_dataset`` and
``tokenize_messages``/``__call__`` for ``instruct_dataset`` and ``chat_dataset``.

Conversations are rendered by the tokenizer's own chat template, so the student trains on exactly
the text the model sees at inference. The loss mask comes from prefix rendering: rendering the
first ``k`` messages gives the tokens up to the end of message ``k``, and rendering them with
``add_generation_prompt`` gives the assistant header that opens message ``k + 1``. Only the
assistant messages' own tokens (content and the template's end of turn, e.g. ``<|im_end|>\\n``)
are trained; the other roles' tokens follow their message's ``masked`` flag (torchtune's
``train_on_input``) and assistant headers are always masked. The tokens are exactly
``apply_chat_template(messages, tokenize=True)``'s: no eos is appended, the template's end of turn
ends each reply. A template that renders a turn differently depending on what follows it (e.g.
the last reply unlike earlier ones) cannot be split per message and is refused, naming the folder.
A folder without a chat template falls back to plain concatenation (see :class:`HFTokenizer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kd import folders
from kd.errors import KDUserError, brief, one_line

if TYPE_CHECKING:
    from torchtune.data import Message

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TRUNCATION_TYPES = ("right", "left")
# torchtune's roles -> the roles chat templates know (torchtune calls tool results "ipython").
_HF_ROLES = {"ipython": "tool"}


def tokenizer(
    path: str, max_seq_len: int | None = None, truncation_type: str = "right"
) -> HFTokenizer:
    """Build the tokenizer of a local Hugging Face folder (the ``tokenizer:`` config builder).

    Args:
        path: folder holding ``tokenizer.json`` and/or ``tokenizer_config.json`` (a model folder).
        max_seq_len: truncate every example to this many tokens (None: no truncation).
        truncation_type: ``"right"`` keeps the start of a long example, ``"left"`` its end.

    Returns:
        The tokenizer.

    Raises:
        KDUserError: the folder or its tokenizer files are missing, transformers cannot load
            them, or ``truncation_type`` is neither ``right`` nor ``left``.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise KDUserError(
            f"tokenizer.path: {folder} {what}; point it at the model folder that holds "
            "tokenizer.json / tokenizer_config.json"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise KDUserError(
            f"tokenizer.path: {folder} has neither tokenizer.json nor tokenizer_config.json; "
            "copy the model's tokenizer files into it or point tokenizer.path at the model folder"
        )
    if truncation_type not in TRUNCATION_TYPES:
        raise KDUserError(
            f"tokenizer.truncation_type: {truncation_type!r} is not allowed; set it to right or left"
        )
    folders.check_folder(folder, key="tokenizer.path")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # noqa: BLE001 - a damaged folder raises anything
        raise KDUserError(
            f"tokenizer.path: transformers cannot load the tokenizer in {folder} ({brief(e)}); "
            "restore its tokenizer files from the model's source"
        ) from e
    return HFTokenizer(hf, folder, max_seq_len=max_seq_len, truncation_type=truncation_type)


class HFTokenizer:
    """A transformers tokenizer as a torchtune ``ModelTokenizer`` and ``Transform``.

    With a chat template, :meth:`tokenize_messages` renders the conversation with it (the tokens
    equal ``apply_chat_template(messages, tokenize=True)``); without one it concatenates the
    encoded message contents, with ``bos`` first and ``eos`` after each assistant message.

    Attributes:
        max_seq_len: truncation length of :meth:`tokenize_messages` (None: none).
        truncation_type: ``"right"`` or ``"left"``.
        bos_id: the beginning-of-sequence id, None when the tokenizer has none (Qwen).
        eos_id: the end-of-sequence id (None when the tokenizer has none).
        pad_id: the padding id (the eos id when the tokenizer has no pad token, else 0).
        vocab_size: ``len(tokenizer)``: highest id + 1, added tokens included.
        special_tokens: ``{text: id}`` of the special added tokens.
        chat_template: the Jinja chat template, None when the folder has none.
        path: the folder it was loaded from.
    """

    def __init__(
        self,
        hf: Any,
        path: Path,
        *,
        max_seq_len: int | None = None,
        truncation_type: str = "right",
    ) -> None:
        """Wrap a loaded transformers tokenizer (use :func:`tokenizer` to load a folder).

        Args:
            hf: a transformers tokenizer (``AutoTokenizer.from_pretrained``).
            path: the folder it came from, named in errors.
            max_seq_len: truncation length (None: none).
            truncation_type: ``"right"`` or ``"left"``.
        """
        self._hf = hf
        self.path = path
        self.max_seq_len = max_seq_len
        self.truncation_type = truncation_type
        self.bos_id: int | None = hf.bos_token_id
        self.eos_id: int | None = hf.eos_token_id
        pad = hf.pad_token_id if hf.pad_token_id is not None else self.eos_id
        self.pad_id: int = pad if pad is not None else 0
        self.vocab_size: int = len(hf)
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in hf.added_tokens_decoder.items() if t.special
        }
        template = hf.chat_template
        if isinstance(template, Mapping):  # several named templates: the one transformers uses
            template = template.get("default")
        self.chat_template: str | None = template

    # ----------------------------------------------------------------------------- plain text
    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Token ids of ``text``, with the tokenizer's bos / eos when asked for and it has them.

        The folder's own post-processor (which may add a BOS) is bypassed, so the BOS is never
        doubled.
        """
        ids = list(self._hf.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (special tokens dropped unless ``skip_special_tokens`` is
        False)."""
        return self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------------ messages
    def tokenize_messages(
        self, messages: Sequence[Message], *, add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Tokens of a conversation and its mask (True: not trained, torchtune's convention).

        Args:
            messages: torchtune messages (text content only).
            add_end_tokens: end the last message as in training data; False is for generation:
                a last assistant message is left open (no end of turn) and after any other last
                message the template's generation prompt (the assistant header) is added.

        Returns:
            ``(tokens, mask)`` of equal length, truncated to ``max_seq_len``: on right truncation
            the last token becomes ``eos_id`` (masked) when ``add_end_tokens``, as torchtune does.

        Raises:
            KDUserError: a message holds non-text content, the chat template refuses the
                conversation, or it cannot be split per message (a turn renders differently
                depending on what follows it).
        """
        if not messages:
            return [], []
        if self.chat_template is None:
            tokens, mask = self._concatenate(messages, add_end_tokens)
        else:
            tokens, mask = self._render(messages, add_end_tokens)
        return self._truncate(tokens, mask, add_end_tokens)

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> dict[str, Any]:
        """Replace ``sample["messages"]`` by ``tokens`` and ``mask`` (torchtune's model transform).

        Args:
            sample: a row with a ``messages`` list (from a torchtune message transform).
            inference: leave the conversation open for generation (``add_end_tokens=False``).
        """
        out = dict(sample)
        tokens, mask = self.tokenize_messages(out.pop("messages"), add_end_tokens=not inference)
        out["tokens"], out["mask"] = tokens, mask
        return out

    def _concatenate(
        self, messages: Sequence[Message], add_end_tokens: bool
    ) -> tuple[list[int], list[bool]]:
        """No chat template: bos, the contents one after another, eos after assistant turns."""
        tokens: list[int] = [] if self.bos_id is None else [self.bos_id]
        mask = [True] * len(tokens)
        last = len(messages) - 1
        for i, message in enumerate(messages):
            ids = self.encode(_text(message), add_bos=False, add_eos=False)
            if message.role == "assistant" and self.eos_id is not None:
                if i < last or add_end_tokens:
                    ids.append(self.eos_id)
            tokens += ids
            mask += [message.masked] * len(ids)
        return tokens, mask

    def _render(
        self, messages: Sequence[Message], add_end_tokens: bool
    ) -> tuple[list[int], list[bool]]:
        """The chat template's tokens, split per message by prefix rendering."""
        chat = [{"role": _HF_ROLES.get(m.role, m.role), "content": _text(m)} for m in messages]
        n = len(chat)
        last_open = not add_end_tokens and messages[-1].role == "assistant"
        ends = [chat[:k] for k in range(1, n + 1 - last_open)]  # to the end of message k - 1
        heads = [i for i, m in enumerate(messages) if m.role == "assistant" and i > 0]
        texts = self._apply(ends, add_generation_prompt=False)
        texts += self._apply([chat[:i] for i in heads], add_generation_prompt=True)
        if last_open:
            texts += self._apply([chat], continue_final_message=True)
        elif not add_end_tokens:
            texts += self._apply([chat], add_generation_prompt=True)
        ids = self._hf(texts, add_special_tokens=False)["input_ids"]
        end_ids = ids[: len(ends)]
        head_ids = dict(zip(heads, ids[len(ends) : len(ends) + len(heads)], strict=True))
        tail_ids = ids[len(ends) + len(heads) :]  # the open reply, or the generation prompt
        tokens: list[int] = []
        mask: list[bool] = []
        for i, message in enumerate(messages):
            if i in head_ids:  # the assistant header: never trained
                mask += [True] * self._extend(tokens, head_ids[i], i)
            rendered = end_ids[i] if i < len(end_ids) else tail_ids[0]
            mask += [message.masked] * self._extend(tokens, rendered, i + 1)
        if tail_ids and not last_open:  # the generation prompt: never trained
            mask += [True] * self._extend(tokens, tail_ids[0], n)
        return tokens, mask

    def _apply(self, conversations: list[list[dict[str, str]]], **kwargs: Any) -> list[str]:
        if not conversations:
            return []
        try:
            return list(self._hf.apply_chat_template(conversations, tokenize=False, **kwargs))
        except Exception as e:  # noqa: BLE001 - templates raise what they like (raise_exception)
            raise KDUserError(
                f"dataset: the chat template of tokenizer.path ({self.path}) refused a "
                f"conversation ({brief(e)}); fix the data's roles or order for this template"
            ) from e

    def _extend(self, tokens: list[int], rendered: list[int], count: int) -> int:
        """Append to ``tokens`` what ``rendered`` (the rendering of the first ``count`` messages,
        which must start with ``tokens``) adds; return how many tokens that is."""
        if rendered[: len(tokens)] != tokens:
            raise KDUserError(
                f"tokenizer.path: the chat template of {self.path} cannot be split per message "
                f"(rendering {count} messages does not start with the tokens of the messages "
                "before), so kd cannot tell the assistant's tokens from the prompt's; use a "
                "folder whose chat_template renders each turn the same whatever follows it"
            )
        added = rendered[len(tokens) :]
        tokens += added
        return len(added)

    def _truncate(
        self, tokens: list[int], mask: list[bool], add_end_tokens: bool
    ) -> tuple[list[int], list[bool]]:
        """Cut to ``max_seq_len`` as torchtune's tokenizers do."""
        if self.max_seq_len is None or len(tokens) <= self.max_seq_len:
            return tokens, mask
        if self.truncation_type == "left":
            return tokens[-self.max_seq_len :], mask[-self.max_seq_len :]
        tokens, mask = tokens[: self.max_seq_len], mask[: self.max_seq_len]
        if add_end_tokens and self.eos_id is not None:
            tokens[-1], mask[-1] = self.eos_id, True
        return tokens, mask


def _text(message: Message) -> str:
    """The text of a torchtune message (its content parts joined)."""
    parts = []
    for item in message.content:
        if item["type"] != "text":
            raise KDUserError(
                f"dataset: a {message.role} message holds {item['type']} content, which "
                "kd.hf.tokenizer cannot tokenize; use text-only data"
            )
        parts.append(item["content"])
    return "".join(parts)


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
@dataclass(frozen=True)
class TokenizerCheck:
    """What :func:`compare_tokenizers` found.

    Attributes:
        probes: the texts both tokenizers encoded to the same ids.
        size: token ids the tokenizers use (the largest id + 1).
        chat_template: the student's tokenizer has a chat template.
        notes: differences that do not change any id (e.g. a different eos choice).
    """

    probes: tuple[str, ...]
    size: int
    chat_template: bool
    notes: tuple[str, ...] = field(default_factory=tuple)


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


def _chat_probe(tokenizer: Any) -> str:
    """A short conversation rendered by ``tokenizer``'s chat template (ChatML when it has none)."""
    messages = [
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42."},
    ]
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            if isinstance(text, str) and text:
                return text
        except Exception:  # noqa: BLE001, S110 - a template that refuses these roles: use ChatML
            pass
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

    Both encode the same probes (:data:`TOKENIZER_PROBE`, a non-ASCII line and a
    conversation rendered by the student's chat template) to the same ids, and every special token
    of either (bos/eos/pad/unk and the added special tokens) has the same id in both. A different
    choice of eos or pad token between two tokenizers that map every token alike (a base and an
    instruct model) changes no id: it is reported as a note (the data uses the student's).

    Args:
        teacher: the teacher's folder.
        student: the student's folder.
        teacher_vocab: the teacher's ``vocab_size`` (embedding rows).
        student_vocab: the student's ``vocab_size``.

    Raises:
        KDUserError: a folder without a loadable tokenizer, the first difference between the two
            (one line naming both folders), or token ids beyond a model's vocab_size.
    """
    t_tok = load_hf_tokenizer(teacher, flag="--teacher")
    s_tok = load_hf_tokenizer(student, flag="--student")
    pair = f"the teacher {one_line(str(teacher))} and the student {one_line(str(student))}"
    fix = "KD compares the two models token id by token id: pick models that share one tokenizer"
    probes = (TOKENIZER_PROBE, "Grüße, 世界! naïve café ½ → 🙂", _chat_probe(s_tok))
    for text in probes:
        t_ids = t_tok.encode(text, add_special_tokens=False)
        s_ids = s_tok.encode(text, add_special_tokens=False)
        if t_ids != s_ids:
            i = next(
                (k for k, (a, b) in enumerate(zip(t_ids, s_ids, strict=False)) if a != b),
                min(len(t_ids), len(s_ids)),
            )
            t_at = t_ids[i] if i < len(t_ids) else "end"
            s_at = s_ids[i] if i < len(s_ids) else "end"
            raise KDUserError(
                f"tokenizers differ: {pair} encode {text[:40]!r} differently (token {i}: teacher "
                f"id {t_at}, student id {s_at}); {fix}"
            )
    t_vocab, s_vocab = t_tok.get_vocab(), s_tok.get_vocab()
    for name in sorted(
        _special_tokens(t_tok) | _special_tokens(s_tok),
        key=lambda n: (min(t_vocab.get(n, math.inf), s_vocab.get(n, math.inf)), n),
    ):
        t_id, s_id = t_vocab.get(name), s_vocab.get(name)
        if t_id != s_id:
            raise KDUserError(
                f"tokenizers differ: {pair} give the special token {name!r} different ids "
                f"(teacher {t_id}, student {s_id}); {fix}"
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
    return TokenizerCheck(
        probes=probes,
        size=size,
        chat_template=bool(getattr(s_tok, "chat_template", None)),
        notes=tuple(notes),
    )
