"""A local teacher with another tokenizer (``cross_tokenizer:``): GOLD's aligned hybrid loss.

Each training row's student tokens are decoded token by token into the row's text and their
character spans; the teacher's own tokenizer (a fast Hugging Face tokenizer from the teacher's
folder) tokenizes that text with offsets, the teacher scores it, and
:func:`kd.cross_tokenizer.sequence_loss` aligns the labelled tokens of both sides by their spans
and takes the hybrid loss. The teacher's labelled tokens are those that start inside the
student's labelled text. The signal reports both parts as extra terms (``kd_loss/matched``,
``kd_loss/unmatched``). Costs: the student's full logits over each row's labelled positions (no
fused head), the teacher's forward on its own tokens, and a Python walk over each row's spans.

Chat rows with a ``kd.hf.tokenizer`` student and a teacher folder with a chat template are
rendered by the teacher's own template instead (:mod:`kd.teachers.cross_chat`). The teacher's
rows can be stored (:meth:`CrossTokenizerTeacher.store_rows`, ``kd run teacher_logits``) and
trained from without it (:mod:`kd.teachers.cross_stored`).

Limits: decoding token by token, a token that splits a multi-byte character shifts the offsets
after it (the alignment then merges larger groups); validation, served teachers and on-policy
sampling are refused by the config checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kd import losses, models
from kd.config.run import LossSettings, RunConfig
from kd.cross_tokenizer import VocabMatch, sequence_loss, vocab_match
from kd.errors import KDUserError, one_line
from kd.runtime import distributed
from kd.runtime.prepare import prepare_teacher
from kd.teachers.base import Teacher, TeacherInput
from kd.teachers.cross_chat import ChatRows, chat_rows_of

__all__ = [
    "CrossTokenizerSignal",
    "CrossTokenizerSource",
    "CrossTokenizerTeacher",
    "StudentSide",
    "student_side",
    "student_size",
    "token_spans",
]

TERMS = ("kd_loss/matched", "kd_loss/unmatched")


def vocab_of(tokenizer: Any) -> dict[str, int]:
    """String -> id of a tokenizer: a transformers one (or kd's wrapper of it), or torchtune's
    BPE tokenizers (``encoder`` + ``special_tokens``)."""
    hf = getattr(tokenizer, "_hf", tokenizer)
    if hasattr(hf, "get_vocab"):
        return dict(hf.get_vocab())
    table = dict(getattr(tokenizer, "encoder", {}) or {})
    table.update(getattr(tokenizer, "special_tokens", {}) or {})
    if not table:
        raise KDUserError(
            "cross_tokenizer: the run's tokenizer lists no vocabulary (get_vocab or encoder); "
            "use kd.hf.tokenizer"
        )
    return table


def token_spans(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text of ``ids`` and each token's ``[start, end)`` in it, decoding token by token."""
    spans, pos, pieces = [], 0, []
    for i in ids:
        piece = tokenizer.decode([int(i)], skip_special_tokens=False)
        pieces.append(piece)
        spans.append((pos, pos + len(piece)))
        pos += len(piece)
    return "".join(pieces), spans


class CrossTokenizerSource:
    """``teacher_model`` (``kd.hf.*``) + ``cross_tokenizer:``: the teacher's folder holds its own
    tokenizer."""

    reads: tuple[str, ...] = ()  # its tokenizer differs: RunContext must not compare it
    needs_rows = False
    route_field: str | None = None

    def __init__(self, run: RunConfig):
        assert run.cross_tokenizer is not None
        self.run = run
        self.source: models.WeightsSource | None = None
        self.student_size = self.teacher_size = 0
        self.teacher_tokenizer: Any = None
        self.match: VocabMatch | None = None
        self.chat: ChatRows | None = None

    def check(self, ctx: Any, facts: Any, dataset: Sequence[Any]) -> None:
        """The teacher's weights source and fast tokenizer, and the shared token strings."""
        from kd.hf.tokenization import tokenizer as hf_tokenizer

        with torch.device("meta"):
            teacher = ctx.build("teacher_model", fix="fix the builder's arguments")
        self.source = ctx.weights_source("teacher_model", teacher)
        folder = Path(str(ctx.node("teacher_model")["path"])).expanduser()
        wrapped = hf_tokenizer(str(folder))
        hf = wrapped._hf
        if not getattr(hf, "is_fast", False):
            raise KDUserError(
                f"cross_tokenizer: the teacher's tokenizer in {folder} gives no character "
                "offsets (a slow tokenizer); add its tokenizer.json"
            )
        self.teacher_tokenizer = hf
        # Chat rows: the teacher renders each conversation with its own template.
        self.chat = chat_rows_of(dataset, ctx.tokenizer(), wrapped)
        self.needs_rows = self.chat is not None
        # Rows past a tokenizer's ids (padded embeddings) are never targets: each side's
        # distribution is over its tokenizer's ids (docs/multi_teacher.md).
        self.student_size = student_size(ctx, facts)
        self.teacher_size = min(models.vocab_size(teacher), len(hf))
        student_vocab = {
            s: i for s, i in vocab_of(ctx.tokenizer()).items() if i < self.student_size
        }
        self.match = vocab_match(student_vocab, hf.get_vocab(), teacher_size=self.teacher_size)
        check_pair(hf, self.match, folder)

    def load(
        self, ctx: Any, facts: Any, *, run_dir: Any = None, compile: bool | None = None
    ) -> CrossTokenizerTeacher:
        assert self.source is not None and self.match is not None, "check() runs first"
        model = ctx.load_model(
            "teacher_model",
            self.source,
            lambda m, shard: prepare_teacher(m, shard=shard),
            run_dir=run_dir,
            compile=compile,
        )
        settings = self.run.cross_tokenizer
        assert settings is not None
        return CrossTokenizerTeacher(
            model,
            student_tokenizer=ctx.tokenizer(),
            teacher_tokenizer=self.teacher_tokenizer,
            match=self.match,
            sizes=(self.student_size, self.teacher_size),
            matched_weight=settings.matched_weight,
            ignore_index=self.run.loss.ignore_index,
            chat=self.chat,
            folder=self.source.folder,
        )


def check_pair(teacher_tokenizer: Any, match: VocabMatch, folder: Path) -> None:
    """The teacher's tokenizer encodes text, and its vocabulary shares token strings with the
    student's (a pair sharing none compares nothing token by token: the folder's tokenizer files
    are not the teacher's own, or transformers read them as another kind of tokenizer).

    Raises:
        KDUserError: the teacher's tokenizer encodes a plain line to no tokens, or the two
            vocabularies share no token string.
    """
    from kd.hf.tokenizer_compare import TOKENIZER_PROBE

    where = f"cross_tokenizer: the teacher's tokenizer in {one_line(str(folder))}"
    fix = (
        f"check that {one_line(str(folder))} holds the teacher's own tokenizer files "
        "(tokenizer.json, tokenizer_config.json) and that transformers' AutoTokenizer loads them "
        "as that tokenizer"
    )
    if not teacher_tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]:
        raise KDUserError(f"{where} encodes {TOKENIZER_PROBE!r} to no tokens; {fix}")
    if match.teacher.numel() == 0:
        raise KDUserError(
            f"{where} shares no token string with the student's (tokenizer.path), so no token "
            f"of the two can be compared; {fix}"
        )


def student_size(ctx: Any, facts: Any) -> int:
    """The student's distribution size: its output rows up to its tokenizer's last id (padded
    embedding rows are never targets; docs/multi_teacher.md)."""
    return min(facts.student_vocab, models.tokenizer_max_id(ctx.tokenizer()) + 1)


@dataclass
class StudentSide:
    """One row's student side: its text, labelled positions, their target tokens and spans.

    Attributes:
        text: the row's text (its tokens decoded one by one, up to the last labelled one).
        rows: ``[n]`` positions whose shifted label is set.
        ids: ``[n]`` their target tokens.
        spans: each target token's ``[start, end)`` in ``text``.
    """

    text: str
    rows: torch.Tensor
    ids: torch.Tensor
    spans: list[tuple[int, int]]

    @property
    def start(self) -> int:
        """Where the labelled text starts (the text's end when nothing is labelled)."""
        return self.spans[0][0] if self.spans else len(self.text)


def student_side(
    tokenizer: Any, tokens: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> StudentSide:
    """The student side of one row (``tokens``, unshifted ``labels``: ``[s]``, on the CPU)."""
    shifted = torch.cat([labels[1:], labels.new_full((1,), ignore_index)])
    rows = (shifted != ignore_index).nonzero().squeeze(1)
    n = int(rows[-1]) + 2 if rows.numel() else 1
    text, spans = token_spans(tokenizer, tokens[:n].tolist())
    return StudentSide(text, rows, shifted[rows], [spans[int(i) + 1] for i in rows])


@dataclass
class _Row:
    """One row: the student's labelled positions, their tokens and spans; the teacher's (its
    states at its labelled positions, or a stored teacher's log-probs there)."""

    s_rows: torch.Tensor
    s_ids: torch.Tensor
    s_spans: list[tuple[int, int]]
    t_hidden: torch.Tensor | None
    t_ids: torch.Tensor
    t_spans: list[tuple[int, int]]
    t_logp: torch.Tensor | None = None


class CrossTokenizerTeacher(Teacher):
    """A teacher model with its own tokenizer (see the module docstring)."""

    terms = TERMS

    def __init__(
        self,
        model: nn.Module,
        *,
        student_tokenizer: Any,
        teacher_tokenizer: Any,
        match: VocabMatch,
        sizes: tuple[int, int],
        matched_weight: float | None,
        ignore_index: int = -100,
        chat: ChatRows | None = None,
        folder: Path | None = None,
    ):
        self.model = model
        self.folder = folder  # where its weights were read from (named when they hold NaN)
        self.chat = chat
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizer = teacher_tokenizer
        self.match = match
        self.sizes = sizes
        self.matched_weight = matched_weight
        self.ignore_index = ignore_index
        self.generator: nn.Module | None = None

    def _row(
        self, tokens: torch.Tensor, labels: torch.Tensor, index: int | None
    ) -> tuple[list[int], dict]:
        """The teacher's token ids of one row and what the loss needs of both sides."""
        if self.chat is not None:  # the teacher's own rendering of the row's messages
            assert index is not None, "chat rows need the batch's dataset rows"
            shifted = torch.cat([labels[1:], labels.new_full((1,), self.ignore_index)])
            rows = (shifted != self.ignore_index).nonzero().squeeze(1)
            t_all, made = self.chat.row(
                index, self.student_tokenizer, (rows + 1).tolist(), shifted[rows].tolist()
            )
            return t_all, {"s_rows": rows, "s_ids": shifted[rows], **made}
        side = student_side(self.student_tokenizer, tokens, labels, self.ignore_index)
        enc = self.teacher_tokenizer(
            side.text, add_special_tokens=False, return_offsets_mapping=True
        )
        t_all, offsets = enc["input_ids"], enc["offset_mapping"]
        picked = [j for j in range(1, len(t_all)) if offsets[j][0] >= side.start]
        return t_all, {
            "s_rows": side.rows,
            "s_ids": side.ids,
            "s_spans": side.spans,
            "t_rows": [j - 1 for j in picked],
            "t_ids": torch.tensor([t_all[j] for j in picked], dtype=torch.long),
            "t_spans": [tuple(offsets[j]) for j in picked],
        }

    def _rows(self, batch: TeacherInput) -> list[_Row]:
        """Each row of the batch, the teacher run on its own tokens (no grad)."""
        if batch.labels is None:
            raise ValueError("a cross-tokenizer teacher needs the batch's labels")
        # The model's device: the batch's tokens arrive as the loader made them (on the CPU).
        device = next(self.model.parameters()).device
        indices = batch.rows if batch.rows is not None else [None] * len(batch.tokens)
        made = [
            self._row(t.cpu(), lab.cpu(), None if i is None else int(i))
            for t, lab, i in zip(batch.tokens, batch.labels, indices, strict=True)
        ]
        width = max(len(t_all) for t_all, _ in made)
        ids = torch.zeros(len(made), width, dtype=torch.long)
        for b, (t_all, _) in enumerate(made):
            ids[b, : len(t_all)] = torch.tensor(t_all, dtype=torch.long)
        with torch.no_grad():
            hidden = self.model(ids.to(device))  # [b, n_t, d_t]; causal: padding after is inert
        return [
            _Row(
                s_rows=m["s_rows"].to(device),
                s_ids=m["s_ids"].to(device),
                s_spans=m["s_spans"],
                t_hidden=hidden[b, torch.tensor(m["t_rows"], dtype=torch.long, device=device)],
                t_ids=m["t_ids"].to(device),
                t_spans=m["t_spans"],
            )
            for b, (_, m) in enumerate(made)
        ]

    def signal(self, batch: TeacherInput) -> CrossTokenizerSignal:
        return CrossTokenizerSignal(self, self._rows(batch))

    def teacher_logp(self, row: _Row, temperature: float) -> torch.Tensor:
        """``log_softmax(z_t / T)`` over the teacher's ids at ``row``'s labelled tokens."""
        assert row.t_hidden is not None
        with torch.no_grad():
            logits = models.logits_from_hidden(self.model, row.t_hidden)[:, : self.sizes[1]]
            return torch.log_softmax(logits.float() / temperature, -1)

    @torch.no_grad()
    def store_rows(
        self, batch: TeacherInput, *, k: int, temperature: float, chunk: int
    ) -> list[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]]:
        """What a cross-tokenizer store keeps of each row of ``batch``
        (:func:`kd.teachers.store_writer.write_shard`): the top-``k`` ids and float32
        log-probs at the teacher's labelled tokens, and those tokens, their spans, each one's
        own log-prob, and the student's labelled tokens' spans (the alignment's coordinate)."""
        out = []
        for row in self._rows(batch):
            ids, lps, own = [], [], []
            assert row.t_hidden is not None
            for start in range(0, row.t_ids.numel(), chunk):
                part = _Row(
                    row.s_rows,
                    row.s_ids,
                    row.s_spans,
                    row.t_hidden[start : start + chunk],
                    row.t_ids[start : start + chunk],
                    [],
                )
                logp = self.teacher_logp(part, temperature)
                values, top = torch.topk(logp, k, dim=-1, sorted=True)
                ids.append(top.to(torch.int32).cpu())
                lps.append(values.cpu())
                own.append(logp.gather(1, part.t_ids[:, None]).squeeze(1).cpu())
            flat = [torch.cat(x).flatten() if x else torch.zeros(0) for x in (ids, lps, own)]
            spans = np.asarray(row.t_spans, dtype=np.int32).reshape(-1)
            s_spans = np.asarray(row.s_spans, dtype=np.int32).reshape(-1)
            out.append(
                (
                    flat[0].numpy().astype(np.int32),
                    flat[1].numpy().astype(np.float32),
                    (row.t_ids.cpu().numpy().astype(np.int32), spans, flat[2].numpy(), s_spans),
                )
            )
        self.release()
        return out

    def release(self) -> None:
        distributed.reshard(self.model)

    def check_loaded(self) -> None:
        from kd.runtime.checkpoints import check_loaded_weights_finite

        check_loaded_weights_finite({"teacher_model": (self.model, self.folder or Path())})


class _Owner(Protocol):
    """What :class:`CrossTokenizerSignal` asks of its teacher (a model or a store)."""

    sizes: tuple[int, int]
    match: VocabMatch
    matched_weight: float | None

    def teacher_logp(self, row: _Row, temperature: float) -> torch.Tensor: ...


@dataclass
class CrossTokenizerSignal:
    """The teacher's states over its own tokens, per row, and the alignment inputs."""

    owner: _Owner
    rows: list[_Row]
    terms: dict[str, torch.Tensor] = field(default_factory=dict)

    def loss(
        self,
        student: nn.Module,
        student_hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        settings: LossSettings,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        owner, t = self.owner, settings.temperature
        zero = student_hidden.sum() * 0.0
        ce_sum, kd_sum, matched, unmatched, groups = zero, zero, zero, zero, 0
        n_lab = 0
        for b, row in enumerate(self.rows):
            if row.s_rows.numel() == 0:
                continue
            z = models.logits_from_hidden(student, student_hidden[b].index_select(0, row.s_rows))
            ce_sum = ce_sum + F.cross_entropy(z.float(), row.s_ids, reduction="sum")
            z = z[:, : owner.sizes[0]]
            n_lab += row.s_rows.numel()
            if row.t_ids.numel() == 0:
                continue
            t_logp = owner.teacher_logp(row, t)
            out = sequence_loss(
                torch.log_softmax(z.float() / t, -1),
                row.s_ids,
                row.s_spans,
                t_logp,
                row.t_ids,
                row.t_spans,
                owner.match,
                divergence=settings.divergence,
                beta=settings.beta,
                skew_alpha=settings.skew_alpha,
                matched_weight=owner.matched_weight,
            )
            kd_sum = kd_sum + out.loss * out.groups
            matched = matched + out.matched.detach() * out.groups
            unmatched = unmatched + out.unmatched.detach() * out.groups
            groups += out.groups
        ce = ce_sum / max(n_lab, 1)
        scale = t * t / max(groups, 1)
        kd = kd_sum * scale
        self.terms = {"kd_loss/matched": matched * scale, "kd_loss/unmatched": unmatched * scale}
        loss = losses.mix_ce_kd(ce, kd, settings.kd_ratio)
        return loss, ce.detach(), kd.detach()

    def labelled_hidden(self, index: torch.Tensor | None) -> torch.Tensor:
        raise ValueError("a cross-tokenizer teacher has no per-position distribution to evaluate")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("a cross-tokenizer teacher has no per-position distribution to evaluate")
