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

A template that fails to render (invalid Jinja, a sandbox violation, its own ``raise_exception``,
or no result within :data:`TEMPLATE_TIME_LIMIT_S`) is one line blaming the template
(:func:`render_chat_template`). Messages of roles other than :data:`CHAT_ROLES` are refused
(:func:`check_roles`; ``kd.data`` adds the row number).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kd import folders
from kd.errors import KDUserError, brief, one_line

if TYPE_CHECKING:
    from torchtune.data import Message

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TRUNCATION_TYPES = ("right", "left")
# torchtune's roles -> the roles chat templates know (torchtune calls tool results "ipython").
_HF_ROLES = {"ipython": "tool"}
# The roles of chat data kd renders (and torchtune's "ipython", its name for "tool").
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
# Seconds one conversation's chat-template renderings may take (a real template takes
# milliseconds); past it the rendering is stopped (:func:`render_chat_template`).
TEMPLATE_TIME_LIMIT_S = 10.0
_T = TypeVar("_T")


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
            ChatRoleError: a message's role is not one of :data:`CHAT_ROLES` (the data
                pipeline adds the row number).
            KDUserError: a message holds non-text content, the chat template fails to render
                (:func:`render_chat_template`), or it cannot be split per message (a turn
                renders differently depending on what follows it).
        """
        if not messages:
            return [], []
        check_roles([m.role for m in messages])
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
        where = f"dataset: the chat template of tokenizer.path ({one_line(str(self.path))})"
        return render_chat_template(self._hf, conversations, where=where, **kwargs)

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


# --------------------------------------------------------------------------- roles
class ChatRoleError(KDUserError):
    """A chat message whose role kd does not render.

    Attributes:
        role: the role.
        message: the message's position in its conversation (1-based).
        row: the data row (1-based) once known (:meth:`at_row`), else None.
    """

    def __init__(self, role: str, message: int, *, row: int | None = None, key: str = "dataset"):
        self.role, self.message, self.row, self.key = role, message, row, key
        where = f"row {row}, " if row is not None else ""
        super().__init__(
            f"{key}: {where}message {message} has role {one_line(repr(role))}, which kd does not "
            f"render; use {', '.join(CHAT_ROLES)} (rename or drop that message of the row)"
        )

    def at_row(self, row: int, *, key: str | None = None) -> ChatRoleError:
        """The same error naming the data row (1-based) and the config key or flag."""
        return ChatRoleError(self.role, self.message, row=row, key=key or self.key)


def check_roles(roles: Sequence[Any], *, row: int | None = None, key: str = "dataset") -> None:
    """Refuse a conversation with a role other than :data:`CHAT_ROLES` (and torchtune's
    ``ipython``, its name for ``tool``): a chat template renders other roles unpredictably (most
    drop them or treat them as the user's), so the trained text would not be what the data says.

    Used by ``kd run``'s tokenizer (:meth:`HFTokenizer.tokenize_messages`; the data pipeline adds
    the row) and by ``kd init``'s data detection (which knows the row).

    Raises:
        ChatRoleError: the first such message, with ``row`` (1-based) when given.
    """
    for i, role in enumerate(roles):
        if role not in CHAT_ROLES and role not in _HF_ROLES:
            raise ChatRoleError(str(role), i + 1, row=row, key=key)


# ---------------------------------------------------------------- template rendering
class _TemplateTimeout(BaseException):
    """Raised inside a rendering thread past :data:`TEMPLATE_TIME_LIMIT_S`. A BaseException, so
    no ``except Exception`` of jinja2 or transformers swallows it."""


class _Watchdog:
    """One daemon thread per process that stops renderings past their deadline.

    NOTE: why an asynchronous exception. A Python thread cannot be killed, so a render timed out
    in a helper thread would keep a core busy until the process ends (and forever in a test
    process). A child process per render costs a fork per data row and a copy of the tokenizer.
    SIGALRM works in the main thread only. jinja2's sandbox bounds ``range()`` (100,000 items)
    but not nested loops, whose product can be 10^10 iterations and more. So the rendering runs in
    the caller's thread and this watchdog raises :class:`_TemplateTimeout` in it with CPython's
    ``PyThreadState_SetAsyncExc``: the template's compiled Python loop stops at its next
    bytecode. One long-lived thread (restarted in a forked child, e.g. a dataloader worker) costs
    a lock per render instead of a thread start (about 0.25 ms, as much as tokenizing a row).
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active: dict[int, tuple[float, int]] = {}  # token -> (deadline, thread id)
        self._fired: set[int] = set()
        self._next = 0
        self._wake_at = math.inf  # when the thread wakes next (inf: not started)
        self._thread: threading.Thread | None = None

    def start(self, seconds: float) -> int:
        """Watch the calling thread for ``seconds``; the token for :meth:`stop`."""
        deadline = time.monotonic() + seconds
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kd-chat-template-limit", daemon=True
                )
                self._thread.start()
            token = self._next
            self._next += 1
            self._active[token] = (deadline, threading.get_ident())
            if deadline < self._wake_at:
                self._cond.notify()
            return token

    def stop(self, token: int) -> None:
        """Stop watching; an exception fired as the render ended is dropped if not yet raised."""
        with self._cond:
            self._active.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(threading.get_ident()), None
                )

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for token, (deadline, thread_id) in list(self._active.items()):
                    if deadline <= now:
                        del self._active[token]
                        self._fired.add(token)
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(thread_id), ctypes.py_object(_TemplateTimeout)
                        )
                wait = min((d for d, _ in self._active.values()), default=now + 60.0) - now
                self._wake_at = now + wait
                self._cond.wait(wait)


_WATCHDOG = _Watchdog()


def _with_time_limit(fn: Callable[[], _T], seconds: float) -> _T:
    """``fn()`` in this thread, stopped with :class:`_TemplateTimeout` after ``seconds``
    (:class:`_Watchdog`)."""
    token = _WATCHDOG.start(seconds)
    try:
        return fn()
    finally:
        _WATCHDOG.stop(token)


def render_chat_template(
    hf: Any,
    conversations: list[list[dict[str, str]]],
    *,
    where: str,
    **kwargs: Any,
) -> list[str]:
    """Render conversations with a tokenizer's chat template, within the time limit.

    Args:
        hf: a transformers tokenizer with a chat template.
        conversations: lists of ``{role, content}`` messages.
        where: the start of an error: the config key or flag, then the template and its folder
            (``"--student: the chat template of DIR"``).
        **kwargs: ``apply_chat_template`` options (``add_generation_prompt``...).

    Returns:
        One text per conversation.

    Raises:
        KDUserError: one line blaming the template: invalid Jinja, an operation jinja2's sandbox
            forbids, the template's own ``raise_exception``, any other failure, or no result
            within :data:`TEMPLATE_TIME_LIMIT_S` seconds.
    """
    limit = TEMPLATE_TIME_LIMIT_S
    try:
        return _with_time_limit(
            lambda: list(hf.apply_chat_template(conversations, tokenize=False, **kwargs)), limit
        )
    except _TemplateTimeout:
        raise KDUserError(
            f"{where} did not finish "
            f"rendering one conversation in {limit:g} s (an endless or huge loop); fix or "
            "replace the folder's chat_template (tokenizer_config.json or chat_template.jinja)"
        ) from None
    except Exception as e:  # noqa: BLE001 - templates raise what they like
        raise KDUserError(_template_error(e, where)) from e


def _template_error(e: Exception, where: str) -> str:
    """One line for a chat template that failed: what went wrong, blaming the template."""
    import jinja2
    from jinja2.sandbox import SecurityError

    fix = "fix or replace the folder's chat_template (tokenizer_config.json or chat_template.jinja)"
    if isinstance(e, jinja2.TemplateSyntaxError):
        return f"{where} is not valid Jinja (line {e.lineno}: {brief(e)}); {fix}"
    if isinstance(e, SecurityError):
        return (
            f"{where} does something jinja2's sandbox forbids ({brief(e)}), so it is not run; {fix}"
        )
    if type(e) is jinja2.TemplateError:  # the template's own raise_exception(...)
        return (
            f"{where} stopped with its own error ({brief(e)}); {fix}, or give it the "
            "conversations it expects"
        )
    return f"{where} failed to render ({brief(e)}); {fix}"
