"""kd.training.on_policy (GKD): the loss on sampled sequences against TRL's GKDTrainer, prompts, the sampler,
rollout against torchtune's and transformers' own generation, and the training batch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kd import _torchtune as tt
from kd import models
from kd.config.run import LossSettings
from kd.errors import KDUserError
from kd.rollouts import prompts as prompt_rows
from kd.rollouts import sampling
from kd.runtime.prepare import prepare_student
from kd.testing import TinyModel, write_tiny_model
from kd.training import train
from kd.training.on_policy import Completions, Prompts
from tests.conftest import tiny_hidden_decoder

IGN = -100
PAD = 0
VOCAB = 64
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------- helpers
def randomised(model: torch.nn.Module, *, std: float = 0.5, seed: int = 0) -> torch.nn.Module:
    """Every parameter redrawn from N(0, std^2): peaked, input-dependent next-token choices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def left_padded(rows: list[list[int]], pad: int = PAD) -> Prompts:
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    return Prompts(tokens=tokens, mask=mask, lengths=torch.tensor([len(r) for r in rows]))


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> Prompts:
    """Prompts of the given lengths, ids in 1..vocab-1 (never the pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    return left_padded([torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths])


def greedy(model: torch.nn.Module, prompts: Prompts, *, new: int, stops=()) -> Completions:
    return sampling.rollout(
        model,
        prompts,
        max_new_tokens=new,
        temperature=0.0,
        top_p=1.0,
        stop_ids=list(stops),
        pad_id=PAD,
        vocab_limit=None,
        generators=None,
    )


def cut_at_stop(tokens: torch.Tensor, stops: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [b, n]`` with everything after each row's first stop token set to PAD, and each
    row's length (its stop token included)."""
    out = tokens.clone()
    lengths = []
    for i in range(out.shape[0]):
        hits = torch.isin(out[i], torch.tensor(stops)).nonzero()
        n = int(hits[0]) + 1 if len(hits) else out.shape[1]
        out[i, n:] = PAD
        lengths.append(n)
    return out, torch.tensor(lengths)


def choose_stop(tokens: torch.Tensor) -> int:
    """A token that ends some rows early and leaves at least one row unstopped."""
    for t in tokens[0, 1:].tolist():
        present = [(row == t).any().item() for row in tokens]
        if not all(present) and t != PAD:
            return int(t)
    raise AssertionError(f"no usable stop token in {tokens}")


def pad_to(tokens: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=PAD)


# ----------------------------------------------------------------- the loss on sampled sequences
@pytest.fixture(scope="module")
def sampled() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """(student, teacher, tokens, shifted labels): the student's sampled completions of prompts of
    different lengths, as the recipe builds them (rollout -> training_batch -> shift_labels)."""
    student = randomised(tiny_hidden_decoder(VOCAB, 32, seed=0), seed=1)
    teacher = randomised(tiny_hidden_decoder(VOCAB, 48, seed=1), seed=2)
    prompts = random_prompts([3, 7, 5, 2], VOCAB, seed=3)
    done = sampling.rollout(
        student,
        prompts,
        max_new_tokens=9,
        temperature=1.0,
        top_p=1.0,
        stop_ids=[5, 9],
        pad_id=PAD,
        vocab_limit=None,
        generators=sampling.row_generators(0, 0, [0, 1, 2, 3], device=CPU),
    )
    tokens, labels = prompt_rows.training_batch(prompts, done, pad_id=PAD)
    labels = train.shift_labels(labels)
    # The batch has prompts and right padding of different lengths.
    assert len(set(done.lengths.tolist())) > 1 or len(set(prompts.lengths.tolist())) > 1
    assert (labels == IGN).sum() > tokens.shape[0]
    return student, teacher, tokens, labels


@pytest.fixture(scope="module")
def trl_jsd():
    """TRL's ``GKDTrainer.generalized_jsd_loss`` (no T^2 factor)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _trl_reference(trl_jsd, student, teacher, tokens, labels, *, beta, temperature):
    """TRL's loss (times T^2) on the same logits, and the student's gradients of it."""
    s_logits = models.logits_from_hidden(student, student(tokens))
    with torch.no_grad():
        t_logits = models.logits_from_hidden(teacher, teacher(tokens))
    ref = trl_jsd(s_logits, t_logits, labels, beta=beta, temperature=temperature)
    ref = ref * temperature**2
    ref.backward()
    return ref.detach(), _grads(student)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize(
    "divergence,beta",
    [
        ("jsd", 0.0),
        ("jsd", 0.3),
        ("jsd", 0.5),
        ("jsd", 1.0),
        ("reverse_kl", 1.0),
        ("forward_kl", 0.0),
    ],
)
def test_kd_term_is_trl_generalized_jsd(sampled, trl_jsd, divergence, beta, temperature, fused):
    """kd's KD term on sampled sequences is TRL's generalized JSD times T^2 (kd scales by T^2,
    TRL does not); jsd beta 1 and reverse_kl are TRL's beta 1, forward_kl its beta 0. The
    student's gradients agree too."""
    student, teacher, tokens, labels = sampled
    student.zero_grad(set_to_none=True)
    settings = LossSettings(
        kd_ratio=1.0,
        temperature=temperature,
        divergence=divergence,
        beta=0.5 if divergence != "jsd" else beta,
        fused=fused,
        chunk_size=8,
    )
    loss, _, kd = train.compute_loss(student, teacher, tokens, labels, settings=settings)
    loss.backward()
    ours = _grads(student)
    ref, theirs = _trl_reference(
        trl_jsd, student, teacher, tokens, labels, beta=beta, temperature=temperature
    )
    assert ref.item() > 1e-2  # the models disagree: a meaningful comparison
    torch.testing.assert_close(kd, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss.detach(), ref, atol=1e-5, rtol=1e-5)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-4, msg=name)


def _perturb_at(model: torch.nn.Module, where: torch.Tensor, scale: float = 5.0):
    """A forward hook adding noise to ``model``'s hidden output at the ``[b, s]`` positions
    ``where``: its logits change there (and only there)."""
    gen = torch.Generator().manual_seed(11)

    def hook(module, args, out):
        noise = torch.randn(out.shape, generator=gen) * scale
        return torch.where(where[..., None], out + noise, out)

    return model.register_forward_hook(hook)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
def test_prompt_and_padding_positions_carry_no_loss(sampled, fused):
    student, teacher, tokens, labels = sampled
    unlabelled = labels == IGN
    settings = LossSettings(kd_ratio=1.0, divergence="jsd", beta=0.5, fused=fused, chunk_size=8)
    with torch.no_grad():
        base = train.compute_loss(student, teacher, tokens, labels, settings=settings)[0]
        handle = _perturb_at(teacher, unlabelled)
        try:
            moved = train.compute_loss(student, teacher, tokens, labels, settings=settings)[0]
        finally:
            handle.remove()
        # The hook does reach the loss where a position is labelled.
        handle = _perturb_at(teacher, ~unlabelled)
        try:
            labelled_moved = train.compute_loss(
                student, teacher, tokens, labels, settings=settings
            )[0]
        finally:
            handle.remove()
    assert torch.equal(base, moved)
    assert abs(labelled_moved.item() - base.item()) > 1e-3

    # The student's hidden states get no gradient at unlabelled positions.
    grads: list[torch.Tensor] = []

    def keep_grad(module, args, out):
        out.register_hook(grads.append)

    handle = student.register_forward_hook(keep_grad)
    try:
        train.compute_loss(student, teacher, tokens, labels, settings=settings)[0].backward()
    finally:
        handle.remove()
        student.zero_grad(set_to_none=True)
    (grad,) = grads
    assert torch.count_nonzero(grad[unlabelled]) == 0
    assert grad[~unlabelled].abs().amax(dim=-1).min() > 0


# ------------------------------------------------------------------------------------- prompts
def test_prompt_starts_single_and_multi_turn():
    labels = torch.tensor(
        [
            [IGN, IGN, IGN, 7, 8, IGN, IGN, IGN],  # one answer, right padding
            [IGN, IGN, 5, 6, IGN, IGN, 9, 10],  # two turns: the last answer starts at 6
            [IGN, 4, IGN, IGN, IGN, IGN, IGN, IGN],  # a one-token answer
            [IGN] * 8,  # nothing labelled: the whole row
            [3, 4, IGN, IGN, IGN, IGN, IGN, IGN],  # labelled from the first token: no prompt
        ]
    )
    assert prompt_rows.prompt_starts(labels).tolist() == [3, 6, 1, 8, 0]


def test_prompts_of_left_pads_the_last_answers_prompt():
    tokens = torch.tensor(
        [
            [11, 12, 13, 14, 15, 0, 0, 0],
            [21, 22, 23, 24, 25, 26, 27, 28],
        ]
    )
    labels = torch.tensor(
        [
            [IGN, IGN, IGN, 14, 15, IGN, IGN, IGN],
            [IGN, IGN, 23, 24, IGN, IGN, 27, 28],
        ]
    )
    p = prompt_rows.prompts_of(tokens, labels, pad_id=PAD, max_len=None, rows=[0, 1])
    assert p.tokens.tolist() == [[0, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26]]
    assert p.mask.tolist() == [[False] * 3 + [True] * 3, [True] * 6]
    assert p.lengths.tolist() == [3, 6]
    assert p.truncated == 0


def test_prompts_of_truncation_keeps_the_last_tokens_and_counts():
    tokens = torch.tensor(
        [[11, 12, 13, 14, 15, 0], [21, 22, 23, 24, 25, 26], [31, 32, 33, 0, 0, 0]]
    )
    labels = torch.tensor(
        [
            [IGN, IGN, IGN, IGN, 15, IGN],
            [IGN, IGN, IGN, 24, 25, 26],
            [IGN, IGN, 33, IGN, IGN, IGN],
        ]
    )
    p = prompt_rows.prompts_of(tokens, labels, pad_id=PAD, max_len=3, rows=[0, 1, 2])
    assert p.tokens.tolist() == [[12, 13, 14], [21, 22, 23], [0, 31, 32]]
    assert p.lengths.tolist() == [3, 3, 2]
    assert p.truncated == 1


def test_prompts_of_refuses_a_row_without_prompt_naming_it():
    tokens = torch.tensor([[11, 12, 13], [21, 22, 23]])
    labels = torch.tensor([[IGN, 12, 13], [21, 22, 23]])
    with pytest.raises(KDUserError, match=r"^dataset: row 42 has no prompt.*train_on_input"):
        prompt_rows.prompts_of(tokens, labels, pad_id=PAD, max_len=None, rows=[7, 42])


def test_prompts_of_a_row_without_labels_drops_the_batch_padding():
    """A row whose answer truncation removed is all prompt: its own tokens, not the padding the
    batch's longer rows added on its right."""
    tokens = torch.tensor([[11, 12, 13, PAD, PAD], [21, 22, 23, 24, 25]])
    labels = torch.tensor([[IGN] * 5, [IGN, IGN, 23, 24, IGN]])
    p = prompt_rows.prompts_of(tokens, labels, pad_id=PAD, max_len=None, rows=[0, 1])
    assert p.lengths.tolist() == [3, 2]
    assert p.tokens[0].tolist() == [11, 12, 13]
    assert p.tokens[1, 1:].tolist() == [21, 22]


def test_a_labelled_assistant_header_belongs_to_the_prompt(assets, tmp_path):
    """torchtune's chat format labels ``<|im_start|>assistant\\n``: the prompt takes it (as a chat
    template's generation prompt), so the student samples the answer, not its turn header. A
    tokenizer that labels the answer alone has no header."""
    from omegaconf import OmegaConf

    from kd import testing
    from kd.config.instantiate import instantiate
    from kd.hf.tokenization import tokenizer as hf_tokenizer
    from tests.conftest import tokenizer_node

    node = OmegaConf.create(tokenizer_node(assets["tokenizer"], 64))
    tok = instantiate(node, key="tokenizer")
    header = models.assistant_header(tok)
    assert tok.decode(header) == "<|im_start|>assistant\n"
    hf_tok = hf_tokenizer(str(testing.write_hf_tokenizer(tmp_path / "hf")), max_seq_len=64)
    assert models.assistant_header(hf_tok) == []

    h = len(header)
    answer = [97, 98]
    row = [1, 2, 3, *header, *answer, 5]
    tokens = torch.tensor([row, [1, 2, 3, 4, *answer, 5, *([PAD] * (h - 1))]])
    labels = torch.tensor([[IGN] * 3 + row[3:], [IGN] * 4 + answer + [5] + [IGN] * (h - 1)])
    p = prompt_rows.prompts_of(tokens, labels, pad_id=PAD, max_len=None, rows=[0, 1], header=header)
    assert p.lengths.tolist() == [3 + h, 4]
    assert p.tokens[0].tolist() == [1, 2, 3, *header]
    without = prompt_rows.prompts_of(tokens, labels, pad_id=PAD, max_len=None, rows=[0, 1])
    assert without.lengths.tolist() == [3, 4]


def test_check_prompts_checks_a_spread_sample_including_the_last_row():
    good = {"tokens": [1, 2, 3], "labels": [IGN, 2, 3]}
    bad = {"tokens": [1, 2, 3], "labels": [1, 2, 3]}
    prompt_rows.check_prompts([good] * 100)
    with pytest.raises(KDUserError, match=r"^val: row 99 has no prompt"):
        prompt_rows.check_prompts([good] * 99 + [bad], key="val")
    with pytest.raises(KDUserError, match=r"^dataset: row 0 has no prompt"):
        prompt_rows.check_prompts([bad] + [good] * 99)


# ------------------------------------------------------------------------------------- sampler
def _gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_is_argmax_within_the_shared_vocab():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    got = sampling.sample_next(
        logits, temperature=0.0, top_p=1.0, vocab_limit=None, generators=None
    )
    assert torch.equal(got, logits.argmax(-1))
    logits[:, 45] = 100.0  # the best id lies outside the shared vocabulary
    got = sampling.sample_next(logits, temperature=0.0, top_p=1.0, vocab_limit=40, generators=None)
    assert torch.equal(got, logits[:, :40].argmax(-1))


def test_vocab_limit_is_never_sampled():
    n = 2000
    logits = torch.zeros(n, 12)
    logits[:, 8:] = 3.0  # the likeliest ids are past the limit
    got = sampling.sample_next(
        logits, temperature=1.0, top_p=1.0, vocab_limit=8, generators=_gens(n)
    )
    assert got.max() < 8
    assert len(set(got.tolist())) == 8


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_p_keeps_the_nucleus_of_transformers(monkeypatch, top_p, temperature):
    """The distribution sampled from equals transformers' temperature + TopPLogitsWarper on the
    same logits: the same kept set, the same renormalised probabilities."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(1)) * 2.0
    seen: list[torch.Tensor] = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        seen.append(probs.clone())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    sampling.sample_next(
        logits, temperature=temperature, top_p=top_p, vocab_limit=None, generators=_gens(64)
    )
    ours = torch.stack(seen)
    warped = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits))
    theirs = warped.softmax(-1)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    kept = (ours > 0).sum(-1)
    assert kept.min() >= 1 and (kept < 30).any() and (kept > 1).any()


def test_each_row_draws_from_its_own_generator():
    """A row's tokens depend on its logits and its generator alone: the same row sampled in a
    batch of other rows and alone gives the same tokens, step after step."""
    flat = torch.zeros(1, 50)
    others = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    batch_gens = _gens(4, seed=100)
    alone_gens = [torch.Generator().manual_seed(100 + 2)]
    batch = torch.cat([others[:2], flat, others[2:]])
    in_batch, alone = [], []
    for _ in range(20):
        kw = dict(temperature=1.0, top_p=1.0, vocab_limit=None)
        in_batch.append(int(sampling.sample_next(batch, generators=batch_gens, **kw)[2]))
        alone.append(int(sampling.sample_next(flat, generators=alone_gens, **kw)[0]))
    assert in_batch == alone
    assert len(set(alone)) > 5  # the draws are random


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_shapes_the_sampled_distribution(temperature):
    n = 6000
    base = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    got = sampling.sample_next(
        base.expand(n, -1),
        temperature=temperature,
        top_p=1.0,
        vocab_limit=None,
        generators=_gens(n),
    )
    freq = torch.bincount(got, minlength=5).float() / n
    want = (base / temperature).softmax(-1)
    untempered = base.softmax(-1)
    # 6000 draws: a frequency's standard error is at most 0.0065.
    assert (freq - want).abs().max() < 0.03
    assert (freq - untempered).abs().max() > 0.1


# ------------------------------------------------------------------------------------- rollout
# One tiny decoder shape for both backends (torchtune builder and HF folder).
SHAPE = TinyModel(
    vocab_size=VOCAB,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=32,
    intermediate_dim=64,
    max_seq_len=64,
)


def _tt_model(seed: int = 0, lora: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in SHAPE.builder().items() if k != "_component_"}
    if lora:
        model = tt.lora_qwen2(
            lora_attn_modules=["q_proj", "v_proj"],
            apply_lora_to_mlp=True,
            lora_rank=4,
            lora_alpha=8,
            **kwargs,
        )
    else:
        model = tt.qwen2(**kwargs)
    return randomised(model, seed=seed + 10).eval()


def _tt_reference(model: torch.nn.Module, prompts: Prompts, *, new: int, stops=None):
    """torchtune's own generation (no KV cache), greedy: ``[b, new]`` completions."""
    with torch.no_grad():
        out, _ = tt.generate_tokens(
            model,
            prompts.tokens,
            max_generated_tokens=new,
            pad_id=PAD,
            temperature=1e-6,
            top_k=1,
            stop_tokens=stops,
        )
    return pad_to(out[:, prompts.tokens.shape[1] :], new)


def test_torchtune_greedy_rollout_is_torchtune_generate():
    model = _tt_model()
    prompts = random_prompts([3, 8, 5, 1], VOCAB, seed=1)
    new = 10
    free = _tt_reference(model, prompts, new=new)
    stop = choose_stop(free)
    stopped = _tt_reference(model, prompts, new=new, stops=[stop])
    want, want_len = cut_at_stop(free, [stop])
    assert torch.equal(stopped, want)  # torchtune agrees with the reading of its output
    assert (want_len < new).any() and (want_len == new).any()

    models.set_hidden_output(model, True)
    got = greedy(model, prompts, new=new)
    assert torch.equal(got.tokens, free)
    assert got.lengths.tolist() == [new] * 4
    got = greedy(model, prompts, new=new, stops=[stop])
    assert torch.equal(got.tokens, want)
    assert torch.equal(got.lengths, want_len)
    assert got.steps == int(want_len.max())


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("hf") / "m", SHAPE, seed=0, writer="transformers"
    )


def _hf_reference(model, prompts: Prompts, *, new: int, stops=None) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts.tokens,
            attention_mask=prompts.mask.long(),
            max_new_tokens=new,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=stops,
        )
    return pad_to(out[:, prompts.tokens.shape[1] :], new)


def test_hf_greedy_rollout_is_transformers_generate(hf_folder):
    from kd.hf.model import causal_lm

    model = randomised(causal_lm(str(hf_folder)), seed=5).eval()
    model.generation_config.eos_token_id = None
    prompts = random_prompts([3, 8, 5, 1], VOCAB, seed=2)
    new = 10
    free = _hf_reference(model, prompts, new=new)
    stop = choose_stop(free)
    want, want_len = cut_at_stop(free, [stop])
    assert torch.equal(_hf_reference(model, prompts, new=new, stops=[stop]), want)
    assert (want_len < new).any() and (want_len == new).any()

    models.set_hidden_output(model, True)
    got = greedy(model, prompts, new=new)
    assert torch.equal(got.tokens, free)
    got = greedy(model, prompts, new=new, stops=[stop])
    assert torch.equal(got.tokens, want)
    assert torch.equal(got.lengths, want_len)


def test_lora_student_rollout_is_its_generation():
    """A LoRA student, prepared as the recipe prepares it (adapters trainable, activation
    checkpointing, train mode), samples what torchtune's generate gives for the same model."""
    model = _tt_model(seed=3, lora=True)
    prompts = random_prompts([4, 2, 6], VOCAB, seed=4)
    want = _tt_reference(model, prompts, new=8)
    prepare_student(model, lora=True, activation_checkpointing=True)
    assert model.training
    got = greedy(model, prompts, new=8)
    assert torch.equal(got.tokens, want)
    # The adapters take part: without them the model says something else.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.zero_()
    assert not torch.equal(greedy(model, prompts, new=8).tokens, want)


def test_rollout_samples_from_the_models_policy_without_dropout(hf_folder):
    """A student in train mode with dropout (LoRA dropout) samples as in eval mode: the
    completions are the policy's, and no draw of the global RNG is spent."""
    from kd.hf.model import lora_causal_lm

    model = lora_causal_lm(
        str(hf_folder),
        lora_attn_modules=["q_proj", "v_proj"],
        lora_rank=4,
        lora_alpha=8,
        apply_lora_to_mlp=True,
        lora_dropout=0.5,
    )
    model = randomised(model, seed=6).eval()
    model.generation_config.eos_token_id = None
    prompts = random_prompts([3, 6], VOCAB, seed=5)
    want = _hf_reference(model, prompts, new=8)
    prepare_student(model, lora=True, activation_checkpointing=False)
    assert model.training
    rng = torch.get_rng_state()
    got = greedy(model, prompts, new=8)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training  # restored
    assert torch.equal(got.tokens, want)


def _sample(model, prompts, rows, *, seed=0, epoch=0, stops=(7,)):
    return sampling.rollout(
        model,
        prompts,
        max_new_tokens=10,
        temperature=1.0,
        top_p=0.95,
        stop_ids=list(stops),
        pad_id=PAD,
        vocab_limit=VOCAB - 4,
        generators=sampling.row_generators(seed, epoch, rows, device=CPU),
    )


def test_sampled_rollout_is_reproducible_per_row():
    model = _tt_model(seed=7)
    models.set_hidden_output(model, True)
    prompts = random_prompts([3, 6, 2], VOCAB, seed=6)
    a = _sample(model, prompts, [10, 11, 12])
    b = _sample(model, prompts, [10, 11, 12])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    assert a.tokens.max() < VOCAB - 4
    other_epoch = _sample(model, prompts, [10, 11, 12], epoch=1)
    assert not torch.equal(a.tokens, other_epoch.tokens)
    # Row 11 sampled alone (another padding, another batch) draws the same tokens.
    alone = _sample(model, left_padded([prompts.tokens[1, -6:].tolist()]), [11])
    n = int(alone.lengths[0])
    assert n == int(a.lengths[1])
    assert torch.equal(alone.tokens[0, :n], a.tokens[1, :n])


# ------------------------------------------------------------------------------- training batch
def test_training_batch_labels_the_completion_only():
    prompts = left_padded([[11, 12, 13], [21], [31, 32]])
    completions = Completions(
        tokens=torch.tensor([[41, 42, 7, 0], [51, 52, 53, 54], [61, 7, 0, 0]]),
        lengths=torch.tensor([3, 4, 2]),
        steps=4,
    )
    tokens, labels = prompt_rows.training_batch(prompts, completions, pad_id=PAD)
    assert tokens.tolist() == [
        [11, 12, 13, 41, 42, 7],
        [21, 51, 52, 53, 54, 0],
        [31, 32, 61, 7, 0, 0],
    ]
    assert labels.tolist() == [
        [IGN, IGN, IGN, 41, 42, 7],
        [IGN, 51, 52, 53, 54, IGN],
        [IGN, IGN, 61, 7, IGN, IGN],
    ]
    # Shifted, the labelled positions are exactly the completion tokens (stop included).
    shifted = train.shift_labels(labels)
    assert int(train.count_tokens([shifted])) == int(completions.lengths.sum())
