"""The generation phase of the memory estimate (only with ``on_policy:``): what stays resident at
the start of a step plus the larger of the sampling models' rollouts
(:func:`kd.rollouts.sampling.rollout`: KV cache, prefill or decoding step, the sampler's ``[b, V]``
buffers). Derivation and trace check: ``docs/memory_accuracy.md``. Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import replace

from kd.config.on_policy_settings import OnPolicySettings
from kd.memory import hf_terms
from kd.memory.activations import mlp_nograd_bytes
from kd.memory.knobs import GenerationKnobs, TrainKnobs
from kd.memory.shapes import ModelShape
from kd.memory.training_step import Components, between_steps
from kd.rollouts import plan as rollout_plan

# kd.rollouts.sampling.rollout's own tensors besides the model's: the prompts (int64 ids, bool mask, int64
# lengths), the [b, P + N] bool mask, the [b, N] int64 completions and the per-row state; the
# stop ids (two: end of turn and end of text).
_STOP_IDS = 2


def rope_bytes(shape: ModelShape, width: int, a: int) -> int:
    """Per token: torchtune's RoPE temporaries on ``width`` values (q or k) at given positions.

    With ``input_pos`` (generation) the fp32 cache is indexed per position: Qwen2 gathers
    ``[cos, sin]`` (8 hd), casts both to the dtype, then holds the rotated copy, both products and
    their sum (4 width); Llama gathers its ``[hd / 2, 2]`` table (4 hd), upcasts x (4 width) and
    holds fp32 products, their difference and sum (8 width).
    """
    hd = shape.head_dim
    if shape.family == "qwen2":
        return 8 * hd + (2 * a * hd if a != 4 else 0) + 4 * a * width
    return 4 * hd + (4 * width if a != 4 else 0) + 8 * width


def cached_layer_peak(shape: ModelShape, batch: int, q_len: int, keys: int, a: int) -> int:
    """A torchtune decoder layer's peak without autograd beyond its input, when ``q_len`` new
    positions per row attend to a KV cache of ``keys`` positions (the rollout's prefill and
    decoding steps).

    The steps: the attention norm (fp32 input, square, product, scaled product: 12 h); RoPE on q,
    then on k with v alive (:func:`rope_bytes`); SDPA, whose keys and values are the whole cache,
    copied to every head for grouped-query attention (a view for one kv head), with the boolean
    mask turned into an additive ``[b, 1, q_len, keys]`` mask in the dtype, the output and an fp32
    logsumexp; the output projection; the MLP norm with the attention output and residual; the
    MLP (:func:`mlp_nograd_bytes`).
    """
    h, q, kv, nh, nkv, hd = (
        shape.embed_dim,
        shape.q_dim,
        shape.kv_dim,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
    )
    n = batch * q_len
    kv_copies = 2 * a * batch * nh * keys * hd if 1 < nkv < nh else 0
    mask = a * batch * q_len * keys
    norm = (12 if a != 4 else 8) * h + 4
    steps = [
        n * norm,
        n * (a * (h + q) + rope_bytes(shape, q, a)),
        n * (a * (h + q + 2 * kv) + rope_bytes(shape, kv, a)),
        n * a * (h + 2 * q) + 4 * batch * nh * q_len + kv_copies + mask,
        n * a * (2 * h + 2 * q) + kv_copies,
        n * (2 * a * h + norm),
        n * mlp_nograd_bytes(shape, a),
    ]
    return max(steps)


def kv_cache_bytes(shape: ModelShape, batch: int, total: int, a: int) -> int:
    """torchtune's KV cache (``local_kv_cache``): per layer, keys and values
    ``[b, n_kv_heads, total, head_dim]`` in the dtype and the int64 positions ``[total]``."""
    return shape.num_layers * (2 * a * batch * shape.kv_dim * total + 8 * total)


def upcast_bytes(vocab: int, batch: int, a: int) -> int:
    """The next-token logits ``[b, V]`` in the dtype and their fp32 copy (``logits_from_hidden``)."""
    return (a + 4) * batch * vocab if a != 4 else 4 * batch * vocab


def sampler_bytes(vocab: int, batch: int, a: int, g: GenerationKnobs) -> int:
    """Peak of the next-token logits and ``kd.rollouts.sampling.sample_next`` on ``[b, V]``.

    The logits in the dtype and their fp32 copy; then the fp32 logits, the vocabulary-masked
    clone (the sampled vocabulary is taken to be smaller than the output, as a tokenizer's usually
    is) and: greedy, nothing more; with a temperature, the tempered copy and its softmax; with
    top-p, the tempered copy, the sorted values, the int64 order, their softmax, cumulative sum
    and its difference (32 B per entry at the cumulative sum).
    """
    n = batch * vocab
    upcast = upcast_bytes(vocab, batch, a)
    if g.temperature == 0.0:
        return max(upcast, 8 * n)
    if g.top_p >= 1.0:
        return max(upcast, 12 * n)
    return max(upcast, 32 * n)


# Where in the rollout a candidate peak lies, for what FSDP2 holds gathered there
# (:func:`fsdp_gathered`): a decoder layer running, the sampling (no layer gathered), or the
# boundaries where the next unit is all-gathered (:func:`hf_terms.generation_boundaries`).
LAYER, HEAD = "layer", "head"


def rollout_candidates(
    shape: ModelShape, k: TrainKnobs, *, graphs: bool = False
) -> list[tuple[str, dict[str, int]]]:
    """The generation's candidate peaks when ``shape`` samples, each with where it lies
    (:data:`LAYER`, :data:`HEAD` or a boundary of :func:`hf_terms.generation_boundaries`) and its
    transient components (``kv_cache``, ``activations``, ``sampling``, ``buffers``):
    :func:`kd.rollouts.sampling.rollout` on ``b`` prompts of ``P = seq_len - new_tokens`` tokens,
    with a cache of ``seq_len`` positions.

    The rollout's own tensors are held throughout (torchtune: int32 positions ``[b, total]``, the
    prefill mask ``[b, P, total]`` and the key positions too), and so is the prefill's output
    until the first decoding step returns. The candidates: the prefill (a decoder layer on
    ``b * P`` tokens), the first token's sampling, and the first decoding step (with the fp32
    logits of the first token still referenced); from the second token on, the new logits are
    computed while the last ones are still referenced; and the layer boundaries.

    With ``graphs`` (the student's decode steps replayed from CUDA graphs,
    ``on_policy.cuda_graphs``) every candidate also holds one decode step's temporaries (the
    hidden state, a cached layer's peak, the logits and their fp32 upcast): the graphs' memory
    pool keeps them for the rest of the rollout (:mod:`kd.rollouts.graphs`). Derived from how a
    capture allocates, not yet measured on a GPU.
    """
    g = k.generation
    assert g is not None
    # The rows sampled together: a micro-batch, or a step's with on_policy.batch_rollouts.
    b, a, new = g.rows or k.batch_size, k.dtype_bytes, g.new_tokens
    prompt = max(1, k.seq_len - new)
    total = prompt + new
    h, vocab = shape.embed_dim, shape.vocab_size
    own = 9 * b * prompt + 8 * b + b * total + 8 * b * new + 9 * b + 8 * _STOP_IDS
    logits = 4 * b * vocab
    sampler = sampler_bytes(vocab, b, a, g)
    pool = 0
    if graphs:
        step = a * b * h + cached_layer_peak(shape, b, 1, total, a)
        pool = step + logits + upcast_bytes(vocab, b, a)
    if shape.hf:
        steps = hf_terms.generation_steps(
            shape,
            b,
            prompt,
            new,
            a,
            logits=logits,
            upcast=upcast_bytes(vocab, b, a),
            sampler=sampler,
        )
        # generation_steps' order: the prefill's layers, the first sampling, (the first and the
        # last decoding steps,) the last sampling
        where = [LAYER] * shape.num_layers + [HEAD] + [LAYER, LAYER] * (new > 1) + [HEAD]
        assert len(where) == len(steps)
        bounds = hf_terms.generation_boundaries(shape, b, prompt, new, a, logits=logits)
        tagged = [*zip(where, steps, strict=True), *bounds.items()]
        return [
            (w, dict(d, buffers=d.get("buffers", 0) + own, sampling=d.get("sampling", 0) + pool))
            for w, d in tagged
        ]
    own += 4 * b * total + b * prompt * total + 8 * total
    cache = kv_cache_bytes(shape, b, total, a)
    hidden = a * b * prompt * h
    held = logits + b * total + 8 * b + a * b * h  # the first decoding step's, beside its layer
    decode = held + cached_layer_peak(shape, b, 1, total, a)
    steps = [
        (LAYER, {"activations": hidden + cached_layer_peak(shape, b, prompt, total, a)}),
        (HEAD, {"activations": hidden, "sampling": sampler}),
        (LAYER, {"activations": hidden + decode - logits, "sampling": logits}),
        ("embedding", {}),
        ("first", {"activations": hidden}),
        ("between", {"activations": hidden}),
        ("decoding", {"activations": hidden + held - logits, "sampling": logits}),
    ]
    if new > 1:  # the next logits, in the dtype and in fp32, while the last ones are referenced
        steps.append(
            (HEAD, {"activations": a * b * h, "sampling": logits + upcast_bytes(vocab, b, a)})
        )
    return [
        (w, dict(d, kv_cache=cache, buffers=own, sampling=d.get("sampling", 0) + pool))
        for w, d in steps
    ]


def rollout_bytes(shape: ModelShape, k: TrainKnobs) -> dict[str, int]:
    """The generation's transient components (``kv_cache``, ``activations``, ``sampling``,
    ``buffers``) at its peak on one device (:func:`rollout_candidates`)."""
    return max((d for _, d in rollout_candidates(shape, k)), key=lambda d: sum(d.values()))


def fsdp_gathered(shape: ModelShape, per_param: float, where: str) -> int:
    """Bytes FSDP2 holds gathered on a rank at a point of the rollout (``where``: see
    :func:`rollout_candidates`) when ``shape`` samples sharded.

    The root unit (final norm, output projection; the embedding when tied) is gathered at the
    first forward and stays (``reshard_after_forward=False``); every other unit (the untied
    embedding, each layer) is gathered for its forward and freed after it. FSDP2 keeps a unit's
    all-gather output referenced until the next unit has copied its own out (to overlap the
    copy with the next all-gather), and the last unit's until the root's forward ends. So a
    running layer holds its parameters twice (all-gather output and parameters), the gathering
    of the next unit three unit-sized buffers (the last one's output, its own output and
    parameters), and the first forward's first unit also the root's all-gather output.
    """
    root = shape.output_params() + shape.embed_dim
    emb = 0 if shape.tie_word_embeddings else shape.embedding_params()
    if not emb:
        root += shape.embedding_params()
    layer = shape.largest_layer_params()
    before_first = root if not emb else emb  # the unit gathered before the first layer
    units = {
        LAYER: 2 * layer,
        HEAD: 0,
        # untied: the embedding gathered while the root's all-gather output is referenced
        "embedding": root + 2 * emb,
        "first": before_first + 2 * layer,
        "between": 3 * layer if shape.num_layers > 1 else 2 * layer,
        "decoding": 2 * layer + max(layer if shape.num_layers > 1 else 0, emb),
    }
    return int(per_param * (root + units[where]))


def generation_phase(
    student: ModelShape,
    teacher: ModelShape | None,
    k: TrainKnobs,
    resident: Components,
    *,
    model_buffers: int,
) -> Components:
    """The generation phase (``k.generation`` set): the larger of the sampling models' rollouts
    (:func:`rollout_bytes`) on top of what stays between steps
    (:func:`kd.memory.training_step.between_steps`).

    The int64 tokens and labels of the micro-batches sampled before this one stay on the device
    (``grad_accum - 1`` of them, at most ``seq_len`` tokens each; at least one is counted) beside
    both models' buffers (``model_buffers``). Under FSDP2 each candidate peak of the rollout
    (:func:`rollout_candidates`) adds what the sampling model holds gathered there
    (:func:`fsdp_gathered`); when the teacher samples in a step of several micro-batches, an
    earlier micro-batch may have been the student's, whose root stays gathered.

    Raises:
        ValueError: a sampling model that is not there.
    """
    g = k.generation
    assert g is not None
    batches = 16 * k.tokens * max(1, k.grad_accum - 1)
    phases = []
    for name in g.models:
        shape = student if name == "student" else teacher
        if shape is None:
            raise ValueError(f"estimate: generation by the {name}, but there is no {name}")
        per_param = k.teacher_dtype_bytes if name == "teacher" else k.dtype_bytes
        held = 0  # the student's root, gathered by its rollout of an earlier micro-batch
        if name == "teacher" and k.num_ranks > 1 and k.grad_accum > 1 and "student" in g.models:
            held = fsdp_gathered(student, k.dtype_bytes, HEAD)
        sampling = k
        if name == "student" and g.copy_dtype_bytes is not None:
            # The sampler's copy in on_policy.sampling_dtype: its cache, activations and logits.
            sampling = replace(k, dtype_bytes=g.copy_dtype_bytes)
        graphs = name == "student" and g.cuda_graphs
        for where, rollout in rollout_candidates(shape, sampling, graphs=graphs):
            in_flight = held + fsdp_gathered(shape, per_param, where) if k.num_ranks > 1 else 0
            phase = between_steps(resident, in_flight=in_flight, buffers=model_buffers + batches)
            for comp, val in rollout.items():
                phase[comp] = phase.get(comp, 0) + val
            phases.append(phase)
    return max(phases, key=lambda d: sum(d.values()), default={})


def generation_knobs(
    settings: OnPolicySettings | None,
    *,
    teacher: bool,
    batch_size: int = 1,
    grad_accum: int = 1,
    dtype: str = "bf16",
) -> GenerationKnobs | None:
    """What samples on the training device at the start of a step (``on_policy:``): the student
    when ``lmbda`` > 0 and its sampler runs here (:mod:`kd.rollouts.plan`: not a served one), the
    teacher when ``seq_kd`` (and ``lmbda`` < 1: the coin then sometimes comes out false); None
    when nothing samples here.

    Args:
        settings: the run's ``on_policy`` settings (None: no on-policy distillation).
        teacher: the run has a teacher model.
        batch_size: rows per micro-batch.
        grad_accum: micro-batches per optimizer step (``batch_rollouts`` samples them together).
        dtype: the student's ``dtype`` (``on_policy.sampling_dtype`` may sample in another).
    """
    if settings is None:
        return None
    models = []
    if settings.lmbda > 0 and rollout_plan.samples_on_device(settings):
        models.append("student")
    if settings.teacher_samples and teacher:
        models.append("teacher")
    if not models:
        return None
    rows = rollout_plan.rollout_rows(settings, batch_size=batch_size, grad_accum=grad_accum)
    return GenerationKnobs(
        new_tokens=settings.max_new_tokens,
        models=tuple(models),
        temperature=settings.temperature,
        top_p=settings.top_p,
        rows=rows if rows != batch_size else None,
        student_copy=rollout_plan.student_copy(settings, dtype=dtype),
        copy_dtype_bytes=rollout_plan.copy_dtype_bytes(settings, dtype=dtype),
        cuda_graphs=settings.cuda_graphs and "student" in models,
    )
