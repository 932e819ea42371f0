"""On-policy distillation (GKD): the student learns on its own completions, scored by the teacher.

Generalised Knowledge Distillation (Agarwal et al. 2024), with TRL ``GKDTrainer``'s knobs
(``on_policy:``, :class:`kd.config.run.OnPolicySettings`): for each micro-batch a coin with
probability ``lmbda`` decides whether the student samples completions of the batch's prompts; the
teacher then scores those sequences in the ordinary training step and the loss covers the sampled
tokens only. With ``seq_kd`` the other micro-batches train on the teacher's completions instead of
the dataset's. This module owns the mechanics, the recipe the order:

1. :func:`prompts_of`: the prompt part of each row of a collated batch (the tokens before the
   row's last labelled span: the whole conversation before the last answer, as TRL takes
   ``messages[:-1]``), left-padded.
2. :func:`rollout`: batched sampling with a KV cache, torchtune's (``local_kv_cache`` and its
   padding masks) for torchtune models, transformers' cache for the transformers backend, through
   the model's own ``__call__`` (FSDP2's hooks gather sharded weights). One sampler serves both:
   temperature, top-p, the shared vocabulary, one ``torch.Generator`` per dataset row.
3. :func:`training_batch`: prompt + completion (up to and including the first stop token) as a
   right-padded ``(tokens, labels)`` batch with labels on the completion only.

Determinism: the coin of micro-batch ``i`` of step ``s`` is drawn from ``(seed, s, i)`` (the same
on every rank, so all ranks generate or none), and row ``r``'s tokens in epoch ``e`` from
``(seed, e, r)``: a resumed run, or the same rows on another number of ranks, sample the same
tokens. Under FSDP2 every rank keeps stepping until the last rank's rows are done (each step runs
collectives).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from kd import models
from kd.backends import backend_of
from kd.config.run import OnPolicySettings
from kd.errors import KDUserError
from kd.metrics import PhaseTimer
from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo
from kd.teachers import Teacher

log = logging.getLogger("kd")

__all__ = [
    "Completions",
    "OnPolicyBatches",
    "Prompts",
    "check_prompts",
    "coin",
    "derive_seed",
    "prompt_starts",
    "prompts_of",
    "rollout",
    "row_generators",
    "sample_next",
    "stop_token_ids",
    "training_batch",
]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Prompts:
    """A batch of prompts, left-padded.

    Attributes:
        tokens: ``[b, P]`` ids, padding on the left.
        mask: ``[b, P]`` True on real tokens.
        lengths: ``[b]`` real tokens per prompt.
        truncated: prompts that lost their first tokens to fit ``max_len``.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    truncated: int = 0

    def to(self, device: torch.device) -> Prompts:
        """The prompts with ``tokens`` and ``mask`` (what the models read) on ``device``;
        ``lengths`` stay where they are (the host, where the training batch is assembled)."""
        return replace(self, tokens=self.tokens.to(device), mask=self.mask.to(device))


@dataclass(frozen=True)
class Completions:
    """Sampled continuations of :class:`Prompts`.

    Attributes:
        tokens: ``[b, N]`` sampled ids; positions after a row's end hold the pad id.
        lengths: ``[b]`` tokens of each completion, its stop token included.
        steps: decoding steps run (the longest completion over all ranks).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    steps: int


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (a hash: nearby inputs give unrelated seeds)."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def coin(seed: int, step: int, micro: int, p: float) -> bool:
    """Whether micro-batch ``micro`` of optimizer step ``step`` comes out true with probability
    ``p``: the same answer on every rank, in a resumed run, and for any world size."""
    if p <= 0.0:
        return False
    if p >= 1.0:
        return True
    gen = torch.Generator().manual_seed(derive_seed(seed, step, micro, 0x6B64))
    return bool(torch.rand((), generator=gen) < p)


def row_generators(
    seed: int, epoch: int, rows: Sequence[int], *, device: torch.device
) -> list[torch.Generator]:
    """One generator per dataset row: a row samples the same tokens whatever batch, rank or
    resumed run it lands in."""
    return [
        torch.Generator(device=device).manual_seed(derive_seed(seed, epoch, int(r))) for r in rows
    ]


def stop_token_ids(tokenizer: object) -> list[int]:
    """Ids that end a completion: the tokenizer's stop tokens (torchtune's end-of-turn and
    end-of-text ids), else its eos id."""
    stops = getattr(tokenizer, "stop_tokens", None)
    ids = [int(t) for t in stops] if stops else []
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None and int(eos) not in ids:
        ids.append(int(eos))
    return ids


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


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    vocab_limit: int | None,
    generators: Sequence[torch.Generator] | None,
) -> torch.Tensor:
    """One token per row from next-token logits ``[b, V]`` -> ``[b]`` (int64).

    Ids from ``vocab_limit`` on are never drawn (the vocabulary both models and the tokenizer
    share). ``temperature`` 0 is greedy. ``top_p`` < 1 keeps the smallest set of most likely
    tokens whose probability reaches ``top_p`` (at least one). Row ``i`` draws from
    ``generators[i]`` alone.
    """
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens more likely than it already reach top_p.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    assert generators is not None and len(generators) == probs.shape[0]
    picks = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    return torch.cat(picks)


def rollout(
    model: nn.Module,
    prompts: Prompts,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: Sequence[int],
    pad_id: int,
    vocab_limit: int | None,
    generators: Sequence[torch.Generator] | None,
    all_done: Callable[[bool], bool] | None = None,
    stop_early: bool = True,
) -> Completions:
    """Sample up to ``max_new_tokens`` tokens after each prompt, with a KV cache.

    ``model`` is a prepared kd model in hidden-output mode (:func:`kd.models.set_hidden_output`),
    of either backend, possibly FSDP2-sharded; the logits of the last position come from
    :func:`kd.models.logits_from_hidden`. The prompt runs once (prefill), then one token per step.
    The model samples in eval mode (then goes back): the completions are its policy's, without
    dropout (TRL's GKD disables dropout), and draw nothing from the global RNG.

    Args:
        model: the model that samples (the student, or the teacher for ``seq_kd``).
        prompts: left-padded prompts (:func:`prompts_of`).
        max_new_tokens: tokens sampled per row at most.
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus mass.
        stop_ids: ids that end a row's completion (included in it).
        pad_id: id written after a row's end.
        vocab_limit: ids from here on are never sampled.
        generators: one per row (:func:`row_generators`); None only when greedy.
        all_done: ``all_done(done_here)`` -> whether every rank's rows are done (a collective);
            None on one rank.
        stop_early: stop when every row has ended (False runs all ``max_new_tokens`` steps: the
            memory tracer, whose fake tensors have no values).
    """
    b, width = prompts.tokens.shape
    device = prompts.tokens.device
    total = width + max_new_tokens
    mask = torch.cat(
        [prompts.mask, torch.ones(b, max_new_tokens, dtype=torch.bool, device=device)], dim=1
    )
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    backend = backend_of(model)
    steps = 0
    was_training = model.training
    model.eval()
    try:
        # No autograd: the student is trainable, and without this every decode step's graph
        # (all its saved activations) stays alive through the KV cache until the rollout ends.
        with (
            torch.no_grad(),
            backend.kv_cache_steps(model, mask, width=width, total=total) as forward,
        ):
            hidden = forward(prompts.tokens, 0)
            for t in range(max_new_tokens):
                logits = models.logits_from_hidden(model, hidden[:, -1])
                token = sample_next(
                    logits,
                    temperature=temperature,
                    top_p=top_p,
                    vocab_limit=vocab_limit,
                    generators=generators,
                )
                token = torch.where(done, torch.full_like(token, pad_id), token)
                out[:, t] = token
                lengths += (~done).long()
                if stops.numel():
                    done |= torch.isin(token, stops)
                steps = t + 1
                if stop_early:
                    finished = bool(done.all())
                    if all_done is not None:
                        finished = all_done(finished)
                    if finished:
                        break
                if t + 1 < max_new_tokens:
                    hidden = forward(token[:, None], width + t)
    finally:
        model.train(was_training)
    return Completions(tokens=out, lengths=lengths, steps=steps)


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


class OnPolicyBatches:
    """The on-policy component of a run: per micro-batch, the dataset's ``(tokens, labels)`` or a
    model's completions of its prompts (the recipe calls :meth:`inputs` once per micro-batch).

    Args:
        settings: ``on_policy:``.
        tokenizer: the run's tokenizer (pad, stop ids, the assistant header of its chat template).
        seed: the run's seed (the coin and the per-row generators derive from it).
        max_seq_len: ``tokenizer.max_seq_len`` (prompts are cut to leave room to sample).
        vocab_limit: ids from here on are never sampled (the vocabulary every model and the
            tokenizer share).
        world: this process's place in the job (every rank samples, or none).
        device: where the models run.
    """

    def __init__(
        self,
        settings: OnPolicySettings,
        *,
        tokenizer: object,
        seed: int,
        max_seq_len: int | None,
        vocab_limit: int,
        world: WorldInfo,
        device: torch.device,
    ):
        from kd.data import pad_id_of

        self.settings = settings
        self.seed = seed
        self.max_seq_len = max_seq_len
        self.vocab_limit = vocab_limit
        self.world = world
        self.device = device
        self.pad_id = pad_id_of(tokenizer)
        self.stop_ids = stop_token_ids(tokenizer)
        self.header = models.assistant_header(tokenizer)
        self._said: set[str] = set()  # the sources whose first sampling was announced

    def inputs(
        self,
        batch: dict[str, torch.Tensor],
        *,
        step: int,
        epoch: int,
        index: int,
        student: nn.Module,
        teacher: Teacher | None,
        timer: PhaseTimer,
        sampled: dict[str, tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Micro-batch ``index`` of optimizer step ``step``: ``(tokens, labels)`` (labels not
        shifted) of the student's (probability ``lmbda``) or, with ``seq_kd``, the teacher's
        completions of its prompts; None when it trains on the dataset's own tokens.

        When the batch carries each row's teacher (``"route"``, ``teachers.route_field``), a
        ``seq_kd`` row is completed by the teacher it names, and rows naming none keep the
        dataset's tokens and labels (they learn from CE alone, as off-policy).

        Adds the sampled micro-batches and the completion tokens trained on (all ranks) to
        ``sampled[source]``
        and the sampling time to the ``generate`` phase of ``timer``. Collective when
        distributed (the coin is the same on every rank).
        """
        op = self.settings
        if coin(self.seed, step, index, op.lmbda):
            source = "student"
        elif op.seq_kd:
            source = "teacher"
        else:
            return None
        rows = batch["rows"].tolist()
        # Each row's teacher (teachers.route_field), when the batch carries one: a completion
        # is scored by the teacher its row names; rows naming none keep their own tokens (CE).
        route: list[str | None] | None = batch.get("route")  # type: ignore[assignment]
        limit = self.max_seq_len
        # The prompts are cut from the batch where the loader made it (the host: no device
        # round trip per row), then sent to the device.
        prompts = prompts_of(
            batch["tokens"],
            batch["labels"],
            pad_id=self.pad_id,
            max_len=None if limit is None else limit - op.max_new_tokens,
            rows=rows,
            header=self.header,
        ).to(self.device)
        generators = (
            row_generators(self.seed, epoch, rows, device=self.device)
            if op.temperature > 0
            else None
        )
        everyone = list(range(len(rows)))
        samplers = (
            [(student, everyone, True)]
            if source == "student"
            else self._teacher_samplers(teacher, route, len(rows))
        )
        if source not in self._said:  # once: sampling is most of an on-policy step's time
            self._said.add(source)
            log.info(
                "on_policy: the %s samples up to %d tokens per prompt (%d prompts a micro-batch); "
                "sampling takes most of a step (metrics.jsonl: time_generate_s)",
                source,
                op.max_new_tokens,
                len(rows),
            )
        parts: list[tuple[list[int], Completions]] = []
        with timer.phase("generate"):
            for model, sel, used in samplers:
                done = rollout(
                    model,
                    prompts if sel == everyone else _select(prompts, sel),
                    max_new_tokens=op.max_new_tokens,
                    temperature=op.temperature,
                    top_p=op.top_p,
                    stop_ids=self.stop_ids,
                    pad_id=self.pad_id,
                    vocab_limit=self.vocab_limit,
                    generators=None if generators is None else [generators[i] for i in sel],
                    all_done=(
                        (lambda here: not distributed.any_rank(not here, device=self.device))
                        if self.world.distributed
                        else None
                    ),
                )
                if used:
                    parts.append((sel, done))
        if source == "teacher" and teacher is not None:
            teacher.release()
        keep = [] if route is None else [i for i, r in enumerate(route) if r is None]
        done = _merge(parts, len(rows), width=op.max_new_tokens, pad_id=self.pad_id, drop=keep)
        # The completion tokens trained on, of all ranks: the same count on any world size.
        count, tokens = sampled.get(source, (0, 0))
        new = int(distributed.all_reduce_sum(done.lengths.sum()))
        sampled[source] = (count + 1, tokens + new)
        made = training_batch(prompts, done, pad_id=self.pad_id)
        if keep:
            made = _with_dataset_rows(made, batch, keep, pad_id=self.pad_id)
        return made

    def _teacher_samplers(
        self, teacher: Teacher | None, route: Sequence[str | None] | None, b: int
    ) -> list[tuple[nn.Module, list[int], bool]]:
        """The teacher models that sample (``seq_kd``): each with the rows it completes and
        whether its completions are used.

        Without routes the teacher's generator completes every row. With them (``combine:
        route``) each row's own teacher completes it and rows naming none are not sampled;
        under torchrun every rank samples with each teacher that any rank's rows name (the
        sampling runs collectives), with all its rows, unused, where none of them names it.

        Raises:
            KDUserError: a teacher that would sample is not a model.
        """
        everyone = list(range(b))
        names: list[str | None] = [None]
        if route is not None:
            here = sorted({r for r in route if r is not None})
            texts = distributed.all_gather_text("\n".join(here), device=self.device)
            names = sorted({n for t in texts if t for n in t.split("\n")})
        out: list[tuple[nn.Module, list[int], bool]] = []
        for name in names:
            model = teacher.generator_for(name) if teacher is not None else None
            if model is None:
                which = "this teacher is" if name is None else f"teacher {name} is"
                raise KDUserError(
                    f"on_policy.seq_kd: true samples the teacher's completions, but {which} "
                    "not a model that can sample; set on_policy.seq_kd=false"
                )
            sel = everyone if route is None else [i for i, r in enumerate(route) if r == name]
            out.append((model, sel or everyone, bool(sel)))
        return out


def _select(prompts: Prompts, sel: Sequence[int]) -> Prompts:
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


def _merge(
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


def _with_dataset_rows(
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
