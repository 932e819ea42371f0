"""A row's prompt and the batch its completion makes (the on-policy rows' mechanics).

:func:`prompts_of` cuts each row of a collated batch to its prompt (the tokens before its last
labelled span, left-padded; :func:`prompt_starts`, :func:`check_prompts`); :func:`training_batch`
joins prompt and completion into a right-padded ``(tokens, labels)`` batch labelled on the
completion only; :func:`select_rows`, :func:`concat_prompts`, :func:`merge_completions` and
:func:`with_dataset_rows` split a micro-batch between samplers and put it back together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kd.errors import KDUserError
from kd.rollouts.base import Completions, Prompts

__all__ = [
    "IGNORE_INDEX",
    "check_prompts",
    "concat_prompts",
    "merge_completions",
    "prompt_starts",
    "prompts_of",
    "select_rows",
    "training_batch",
    "with_dataset_rows",
]

IGNORE_INDEX = -100


def prompt_starts(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Where each row's last labelled span starts: its prompt length. ``[b, s] -> [b]``.

    ``labels`` are the dataset's (not shifted): label ``j`` is token ``j``. A row without a label
    gives its full length; a row labelled from its first token gives 0 (no prompt).
    """
    labelled = labels != ignore_index
    b, s = labels.shape
    before = torch.cat([torch.zeros_like(labelled[:, :1]), labelled[:, :-1]], dim=1)
    starts = labelled & ~before
    index = torch.arange(s, device=labels.device).expand(b, s)
    last = torch.where(starts, index, torch.full_like(index, -1)).amax(dim=1)
    return torch.where(last < 0, torch.full_like(last, s), last)


def check_prompts(dataset: Sequence[dict], *, key: str = "dataset", sample: int = 32) -> None:
    """Refuse, before any weight loads, a dataset whose rows have no prompt to complete (every
    token labelled: ``train_on_input``); ``sample`` rows spread over it are checked.

    Raises:
        KDUserError: a checked row is labelled from its first token.
    """
    n = len(dataset)
    k = min(n, sample)
    for i in sorted({round(j * (n - 1) / max(k - 1, 1)) for j in range(k)}):
        labels = torch.as_tensor(list(dataset[i]["labels"]))[None]
        if int(prompt_starts(labels)[0]) == 0:
            raise KDUserError(
                f"{key}: row {i} has no prompt (every token is labelled), and on_policy samples "
                f"completions of each row's prompt; mask the prompt ({key}.train_on_input: "
                "false), or remove on_policy"
            )


def prompts_of(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    pad_id: int,
    max_len: int | None,
    rows: Sequence[int],
    header: Sequence[int] = (),
    key: str = "dataset",
    ignore_index: int = IGNORE_INDEX,
) -> Prompts:
    """The prompts of a collated (right-padded) batch, left-padded for generation.

    A row's prompt is its tokens before its last labelled span, plus ``header`` when that span
    starts with it (:func:`kd.models.assistant_header`).

    Args:
        tokens: ``[b, s]`` ids of the batch.
        labels: ``[b, s]`` its labels (not shifted).
        pad_id: the tokenizer's padding id.
        max_len: the most tokens a prompt keeps (its last ones), so that prompt + completion fit
            ``tokenizer.max_seq_len``; None = no limit.
        rows: the dataset index of each row (named in errors).
        header: the assistant turn's header tokens, part of the prompt when labelled.
        key: the dataset's config key (named in errors).
        ignore_index: label value of unlabelled positions.

    Raises:
        KDUserError: a row with no prompt (labelled from its first token).
    """
    starts = prompt_starts(labels, ignore_index).tolist()
    kept: list[torch.Tensor] = []
    truncated = 0
    for i, start in enumerate(starts):
        if start == 0:
            raise KDUserError(
                f"{key}: row {int(rows[i])} has no prompt (every token is labelled), and "
                "on_policy samples completions of each row's prompt; mask the prompt "
                f"({key}.train_on_input: false), or remove on_policy"
            )
        if start == tokens.shape[1]:
            # No label at all (truncation ate the answer): the row's tokens without the batch's
            # right padding.
            real = (tokens[i] != pad_id).nonzero()
            start = int(real[-1]) + 1 if real.numel() else 1
        elif header and tokens[i, start : start + len(header)].tolist() == list(header):
            start += len(header)
        prompt = tokens[i, :start]
        if max_len is not None and start > max_len:
            prompt, truncated = prompt[start - max_len :], truncated + 1
        kept.append(prompt)
    width = max(int(p.numel()) for p in kept)
    out = torch.full((len(kept), width), pad_id, dtype=tokens.dtype, device=tokens.device)
    mask = torch.zeros((len(kept), width), dtype=torch.bool, device=tokens.device)
    for i, prompt in enumerate(kept):
        out[i, width - prompt.numel() :] = prompt
        mask[i, width - prompt.numel() :] = True
    lengths = torch.tensor([p.numel() for p in kept], device=tokens.device)
    return Prompts(tokens=out, mask=mask, lengths=lengths, truncated=truncated)


def training_batch(
    prompts: Prompts,
    completions: Completions,
    *,
    pad_id: int,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + completion of each row as a right-padded training batch.

    Returns:
        ``(tokens, labels)`` ``[b, L]``, ``L`` the longest prompt + completion; labels (not
        shifted) hold the completion's tokens (its stop token included) and ``ignore_index`` on
        the prompt and the padding.
    """
    b = prompts.tokens.shape[0]
    width = prompts.tokens.shape[1]
    p_len = prompts.lengths.tolist()
    c_len = completions.lengths.tolist()
    length = max(p + c for p, c in zip(p_len, c_len, strict=True))
    device = prompts.tokens.device
    tokens = torch.full((b, length), pad_id, dtype=torch.long, device=device)
    labels = torch.full((b, length), ignore_index, dtype=torch.long, device=device)
    for i in range(b):
        p, c = p_len[i], c_len[i]
        tokens[i, :p] = prompts.tokens[i, width - p :]
        tokens[i, p : p + c] = completions.tokens[i, :c]
        labels[i, p : p + c] = completions.tokens[i, :c]
    return tokens, labels


def select_rows(prompts: Prompts, sel: Sequence[int]) -> Prompts:
    """The prompts of rows ``sel``, their common left padding removed."""
    index = torch.tensor(list(sel), dtype=torch.long)
    lengths = prompts.lengths.index_select(0, index.to(prompts.lengths.device))
    width = int(lengths.max())
    index = index.to(prompts.tokens.device)
    return Prompts(
        tokens=prompts.tokens.index_select(0, index)[:, -width:],
        mask=prompts.mask.index_select(0, index)[:, -width:],
        lengths=lengths,
        truncated=prompts.truncated,
    )


def concat_prompts(parts: Sequence[Prompts], *, pad_id: int) -> Prompts:
    """Several batches of prompts as one, left-padded to the widest."""
    width = max(p.tokens.shape[1] for p in parts)

    def left(x: torch.Tensor, fill: int | bool) -> torch.Tensor:
        pad = x.new_full((x.shape[0], width - x.shape[1]), fill)
        return torch.cat([pad, x], dim=1)

    return Prompts(
        tokens=torch.cat([left(p.tokens, pad_id) for p in parts]),
        mask=torch.cat([left(p.mask, False) for p in parts]),
        lengths=torch.cat([p.lengths for p in parts]),
        truncated=sum(p.truncated for p in parts),
    )


def merge_completions(
    parts: Sequence[tuple[Sequence[int], Completions]],
    b: int,
    *,
    width: int,
    pad_id: int,
    drop: Sequence[int] = (),
) -> Completions:
    """The completions of ``b`` rows from those of subsets of them (rows in none, and rows
    ``drop``, get an empty completion)."""
    if len(parts) == 1 and len(parts[0][0]) == b and not drop:
        return parts[0][1]
    device = parts[0][1].tokens.device if parts else torch.device("cpu")
    tokens = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    for sel, done in parts:
        index = torch.tensor(list(sel), dtype=torch.long, device=device)
        tokens.index_copy_(0, index, done.tokens)
        lengths.index_copy_(0, index, done.lengths)
    if drop:
        index = torch.tensor(list(drop), dtype=torch.long, device=device)
        tokens.index_fill_(0, index, pad_id)
        lengths.index_fill_(0, index, 0)
    return Completions(
        tokens=tokens, lengths=lengths, steps=max((d.steps for _, d in parts), default=0)
    )


def with_dataset_rows(
    made: tuple[torch.Tensor, torch.Tensor],
    batch: dict[str, torch.Tensor],
    keep: Sequence[int],
    *,
    pad_id: int,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``made`` with rows ``keep`` replaced by the dataset's own tokens and labels (rows that
    name no teacher learn from CE on their data, as off-policy), each cut after its last
    label (the tokens after it teach nothing)."""
    tokens, labels = made
    data_tokens = batch["tokens"].to(tokens.device)
    data_labels = batch["labels"].to(tokens.device)
    index = torch.arange(data_labels.shape[1], device=tokens.device) + 1
    ends = torch.where(data_labels != ignore_index, index, 0).amax(dim=1).tolist()
    width = max([tokens.shape[1], *(ends[i] for i in keep)])
    b = tokens.shape[0]
    out_t = torch.full((b, width), pad_id, dtype=tokens.dtype, device=tokens.device)
    out_l = torch.full((b, width), ignore_index, dtype=labels.dtype, device=tokens.device)
    out_t[:, : tokens.shape[1]] = tokens
    out_l[:, : labels.shape[1]] = labels
    for i in keep:
        end = ends[i]
        out_t[i] = pad_id
        out_l[i] = ignore_index
        out_t[i, :end] = data_tokens[i, :end]
        out_l[i, :end] = data_labels[i, :end]
    return out_t, out_l
