"""The memory estimate's terms one by one: byte counts derived by hand for small known shapes, and
monotonicity (more layers or longer sequences never need less memory), for each term and each
phase of :func:`kd.memory.estimate`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kd.memory import runtime
from kd.memory.activations import (
    layer_saved_bytes,
    nograd_forward_bytes,
    student_activations,
    student_forward_bytes,
)
from kd.memory.estimate import (
    GIB,
    estimate,
    runtime_reserve,
)
from kd.memory.evaluation import evaluation_bytes
from kd.memory.generation import (
    kv_cache_bytes,
    rollout_bytes,
    sampler_bytes,
    upcast_bytes,
)
from kd.memory.knobs import GenerationKnobs, OptimizerSpec, TrainKnobs
from kd.memory.loss_head import (
    STORED_TOPK_BYTES,
    fused_loss_bytes,
    loss_head,
    unfused_loss_bytes,
)
from kd.memory.resident import optimizer_state_bytes, resident_bytes
from kd.memory.shapes import TRANSFORMERS, LoraSpec, ModelShape
from kd.memory.training_step import between_steps, resident_components

# A small Llama-style decoder whose sizes are easy to count by hand: h 64, f 128, 4 query heads
# of 16, 2 kv heads; per layer q 4096 + k 2048 + v 2048 + o 4096 + 3 x 8192 (MLP) + 2 x 64
# (norms) = 36,992 parameters; embedding and untied output 64,000 each; final norm 64.
LLAMA = ModelShape(
    name="tiny_llama",
    family="llama",
    vocab_size=1000,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=64,
    intermediate_dim=128,
    tie_word_embeddings=False,
    max_seq_len=64,
)
LAYER_PARAMS = 36_992
TOTAL_PARAMS = 2 * 64_000 + 2 * LAYER_PARAMS + 64
QWEN = replace(LLAMA, name="tiny_qwen2", family="qwen2", tie_word_embeddings=True)
LORA = replace(QWEN, lora=LoraSpec(rank=8, attn_modules=("q_proj", "v_proj"), mlp=True))
TEACHER = replace(LLAMA, name="tiny_teacher", num_layers=3, embed_dim=96, intermediate_dim=192)
# The same sizes run by transformers' modules (kd.hf): Llama, and Gemma 3's norms and head size.
HF_LLAMA = replace(LLAMA, backend=TRANSFORMERS, model_type="llama")
HF_GEMMA = replace(
    HF_LLAMA,
    model_type="gemma3_text",
    qk_norm=True,
    head_size=24,
    norm="rms_1p",
    sandwich_norms=True,
    embed_scale=True,
    rope_types=2,
)


def test_shape_counts_the_hand_count():
    assert LLAMA.layer_base_params() == LAYER_PARAMS
    assert LLAMA.total_params() == TOTAL_PARAMS


# --------------------------------------------------------------------------- resident terms
@pytest.mark.parametrize(
    "optimizer,dtype_bytes,expected",
    [
        (OptimizerSpec(), 2, (4000, 2000)),  # AdamW foreach: sqrt(exp_avg_sq) of every parameter
        (OptimizerSpec(fused=True), 2, (4000, 0)),
        (OptimizerSpec(foreach=False), 2, (4000, 200)),  # one temporary of the largest (100)
        (OptimizerSpec(), 4, (8000, 4000)),
        (OptimizerSpec(kind="adamw8bit"), 2, (2031, 0)),  # 2 x (1 + 4 / 256) B per parameter
        (OptimizerSpec(kind="sgd", momentum=0.9), 2, (2000, 0)),
        (OptimizerSpec(kind="sgd"), 2, (0, 0)),
        (OptimizerSpec(in_cpu=True), 2, (0, 0)),
    ],
)
def test_optimizer_state_bytes(optimizer, dtype_bytes, expected):
    knobs = TrainKnobs(batch_size=1, seq_len=8, optimizer=optimizer, dtype_bytes=dtype_bytes)
    assert optimizer_state_bytes(1000, 100, knobs) == expected


@pytest.mark.parametrize(
    "world_size,offload,expected", [(1, False, 10), (0, False, 10), (4, False, 3), (4, True, 0)]
)
def test_per_rank_share(world_size, offload, expected):
    knobs = TrainKnobs(batch_size=1, seq_len=8, world_size=world_size, fsdp_cpu_offload=offload)
    assert knobs.per_rank(10) == expected


def test_resident_bytes_of_a_full_student_by_hand():
    res = resident_bytes(LLAMA, None, TrainKnobs(batch_size=1, seq_len=8))
    assert res.student_weights == res.gradients == 2 * TOTAL_PARAMS
    assert res.optimizer_states == 4 * TOTAL_PARAMS and res.optimizer_temp == 2 * TOTAL_PARAMS
    assert res.layer_grads == 2 * LAYER_PARAMS and res.output_grad == 2 * 64_000
    assert res.head_grads == 2 * 64  # the final norm's: the untied embedding's comes last
    assert res.teacher_weights == res.lora_adapters == 0
    assert (res.in_flight_forward, res.in_flight_backward) == (0, 0)


def test_resident_bytes_under_fsdp_by_hand():
    knobs = TrainKnobs(batch_size=1, seq_len=8, world_size=2)
    res = resident_bytes(LLAMA, None, knobs)
    assert res.student_weights == TOTAL_PARAMS  # bf16 / 2 ranks
    root = 2 * (2 * 64_000 + 64)
    # two layers in flight (current + prefetched) and the root unit; in backward the layer's
    # unsharded fp32 gradient plus its shard
    assert res.in_flight_forward == 2 * 2 * LAYER_PARAMS + root
    assert res.in_flight_backward == 2 * 2 * LAYER_PARAMS + root + int(4 * LAYER_PARAMS * 1.5)
    offloaded = resident_bytes(LLAMA, None, replace(knobs, fsdp_cpu_offload=True))
    assert offloaded.student_weights == offloaded.gradients == offloaded.optimizer_states == 0


def test_quantized_teacher_weights():
    knobs = TrainKnobs(batch_size=1, seq_len=8, teacher_bytes_per_param=0.5)
    assert resident_bytes(QWEN, LLAMA, knobs).teacher_weights == TOTAL_PARAMS // 2


def test_resident_components_carry_the_batch_and_stored_logits():
    knobs = TrainKnobs(batch_size=2, seq_len=8, stored_topk=4, grad_accum=2)
    res = resident_bytes(QWEN, None, knobs)
    comps = resident_components(res, knobs)
    assert comps["stored_logits"] == STORED_TOPK_BYTES * 4 * 16
    assert comps["buffers"] == res.model_buffers + 16 * 16  # int64 tokens and labels
    assert comps["gradients"] == res.gradients  # accumulation keeps them between micro-batches
    between = between_steps(comps, in_flight=7, buffers=3)
    assert between["gradients"] == between["stored_logits"] == 0
    assert (between["fsdp_in_flight"], between["buffers"]) == (7, 3)


# --------------------------------------------------------------------------- activations
def test_layer_saved_bytes_by_hand():
    # per token, full fine-tuning, bf16: attention norm fp32 x + rsqrt + normed x (4h + 4 + 4h),
    # the q/k/v input (2h), SDPA's q, k, v, out at full head count (2 x 4 x 64) and fp32 lse (4 x
    # 4); the MLP norm again, the w1/w3 input (2h), w1 out, silu out, w3 out, product (4 x 2f)
    per_token = (8 * 64 + 4) + 2 * 64 + 2 * 4 * 64 + 4 * 4 + (8 * 64 + 4) + 2 * 64 + 4 * 2 * 128
    assert per_token == 2840
    assert layer_saved_bytes(LLAMA, 2, 8, 2, input_grad=True) == 16 * per_token
    # Qwen2's RoPE adds dtype copies of cos and sin per position, for q and for k
    assert layer_saved_bytes(QWEN, 2, 8, 2, input_grad=True) == 16 * per_token + 8 * 4 * 2 * 16


def test_checkpointed_layers_save_their_input():
    knobs = TrainKnobs(batch_size=2, seq_len=8, activation_checkpointing=True)
    acts = student_activations(LLAMA, knobs)
    assert acts.layers == (2 * 16 * 64,) * 2
    assert acts.head == 16 * (8 * 64 + 4)  # the final norm: fp32 input, rsqrt, normed input


# --------------------------------------------------------------------------- loss head
def test_unfused_loss_bytes_without_teacher():
    knobs = TrainKnobs(batch_size=2, seq_len=8, fused_loss=False)
    # fp32 logits + log-probs (8 V per token), the log-probs kept, then their gradients
    assert unfused_loss_bytes(LLAMA, None, knobs) == (8 * 16_000, 4 * 16_000, 8 * 16_000)


def test_fused_loss_bytes_by_hand():
    knobs = TrainKnobs(batch_size=2, seq_len=8)
    grad_h, grad_w32, grad_w = 2 * 16 * 64, 4 * 1000 * 64, 2 * 1000 * 64
    chunk = 4 * 16 * 1000 + 12 * 16 * 1000 + 28 * 16 + 664  # forward_kl, one chunk of 16 rows
    copies = 2 * 16 * (64 + 64)  # the labelled rows of both hidden states
    expected = copies + grad_h + max(grad_w32 + chunk, grad_w32 + grad_w)
    assert fused_loss_bytes(LLAMA, LLAMA, knobs) == (expected, grad_h + grad_w)


def test_loss_head_picks_the_path_and_notes_it():
    knobs = TrainKnobs(batch_size=2, seq_len=8)
    lora_out = replace(LORA, lora=replace(LORA.lora, output=True))
    assert loss_head(LORA, QWEN, knobs, output_grad=0).notes == ()
    unfused = loss_head(lora_out, QWEN, knobs, output_grad=0)
    assert unfused.output_grad_held == 0 and "unfused logits path" in unfused.notes[0]
    stored = replace(knobs, stored_topk=8)
    assert "apply_lora_to_output=false" in loss_head(lora_out, None, stored, output_grad=0).notes[0]
    with pytest.raises(ValueError, match="take no teacher"):
        loss_head(QWEN, QWEN, stored, output_grad=0)


# --------------------------------------------------------------------------- generation
def test_kv_cache_bytes_by_hand():
    # per layer: keys and values [b, kv_heads, total, head_dim] in bf16 and int64 positions
    assert kv_cache_bytes(LLAMA, 2, 16, 2) == 2 * (2 * 2 * 2 * 32 * 16 + 8 * 16)


@pytest.mark.parametrize(
    "temperature,top_p,expected",
    [(0.0, 1.0, 8 * 2000), (0.9, 1.0, 12 * 2000), (0.9, 0.9, 32 * 2000)],
)
def test_sampler_bytes(temperature, top_p, expected):
    g = GenerationKnobs(new_tokens=4, temperature=temperature, top_p=top_p)
    assert upcast_bytes(1000, 2, 2) == 6 * 2000 and upcast_bytes(1000, 2, 4) == 4 * 2000
    assert sampler_bytes(1000, 2, 2, g) == expected


def test_generation_by_a_missing_model_is_refused():
    knobs = TrainKnobs(batch_size=1, seq_len=16, generation=GenerationKnobs(4, ("teacher",)))
    with pytest.raises(ValueError, match="no teacher"):
        estimate(QWEN, None, knobs)


# --------------------------------------------------------------------------- reserve
def test_runtime_reserve():
    """CUDA: the measured terms by name (kd.memory.runtime); CPU: the process and 3%."""
    one = TrainKnobs(batch_size=1, seq_len=8)
    cuda = runtime_reserve(100 * GIB, one)
    assert cuda == (
        runtime.CUDA_CONTEXT_BYTES + runtime.CUBLAS_WORKSPACE_BYTES + int(0.05 * 100 * GIB)
    )
    ac = replace(one, activation_checkpointing=True)
    assert runtime_reserve(100 * GIB, ac) - cuda == int(0.135 * 100 * GIB) - int(0.05 * 100 * GIB)
    two = replace(one, world_size=2)
    assert runtime_reserve(100 * GIB, two) == cuda + runtime.NCCL_BYTES_PER_RANK
    cpu = replace(one, device_type="cpu")
    assert runtime_reserve(100 * GIB, cpu) == GIB + int(0.03 * 100 * GIB)
    assert runtime_reserve(100 * GIB, replace(one, reserve_bytes=5)) == 5


def test_plan_reports_allocated_reserved_and_device_peaks():
    """allocated + allocator_slack = reserved; + cuda_runtime = the device peak (the budget's)."""
    est = estimate(QWEN, None, TrainKnobs(batch_size=1, seq_len=64))
    slack = est.phases[est.peak_phase]["allocator_slack"]
    rt = est.phases[est.peak_phase]["cuda_runtime"]
    assert slack == est.runtime.fragmentation + est.runtime.workspace > 0
    assert rt == est.runtime.context == runtime.CUDA_CONTEXT_BYTES
    assert est.reserved_peak_bytes == est.allocated_peak_bytes + slack
    assert est.peak_bytes == est.reserved_peak_bytes + rt


# --------------------------------------------------------------------------- monotonicity
KNOBS = {
    "eager": TrainKnobs(batch_size=2, seq_len=64),
    "checkpointed-unfused-jsd": TrainKnobs(
        batch_size=2, seq_len=64, activation_checkpointing=True, fused_loss=False, divergence="jsd"
    ),
    "accumulating-fsdp": TrainKnobs(batch_size=1, seq_len=64, grad_accum=3, world_size=4),
    "evaluation-generation": TrainKnobs(
        batch_size=2,
        seq_len=64,
        eval_batch=3,
        generation=GenerationKnobs(new_tokens=16, models=("student", "teacher"), top_p=0.9),
    ),
}
STUDENTS = {
    "llama": LLAMA,
    "qwen2": QWEN,
    "lora": LORA,
    "transformers-llama": HF_LLAMA,
    "transformers-gemma3": HF_GEMMA,
}


def _allocated(student: ModelShape, teacher: ModelShape | None, knobs: TrainKnobs) -> dict:
    est = estimate(student, teacher, knobs)
    return {p: est.allocated(p) for p in est.phase_names}


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
@pytest.mark.parametrize("student", STUDENTS.values(), ids=STUDENTS.keys())
def test_more_layers_or_tokens_never_need_less(student, knobs):
    def grown(shape: ModelShape) -> ModelShape:
        return replace(shape, num_layers=shape.num_layers + 2)

    base = _allocated(student, TEACHER, knobs)
    bigger = [
        _allocated(grown(student), TEACHER, knobs),
        _allocated(student, grown(TEACHER), knobs),
        _allocated(student, TEACHER, replace(knobs, seq_len=2 * knobs.seq_len)),
    ]
    for other in bigger:
        assert all(other[p] >= base[p] for p in base), (base, other)


@pytest.mark.parametrize("seq", [8, 32, 128])
def test_each_term_grows_with_the_sequence(seq):
    def terms(s: int) -> list[int]:
        k = replace(KNOBS["evaluation-generation"], seq_len=s)
        acts = student_activations(QWEN, k)
        return [
            acts.total,
            student_forward_bytes(QWEN, k, acts),
            nograd_forward_bytes(TEACHER, k.batch_size, s, 2),
            loss_head(QWEN, TEACHER, k, output_grad=0).peak,
            unfused_loss_bytes(QWEN, TEACHER, k)[0],
            sum(evaluation_bytes(QWEN, TEACHER, k).values()),
            sum(rollout_bytes(QWEN, k).values()),
            kv_cache_bytes(QWEN, k.batch_size, s, 2),
        ]

    assert all(a <= b for a, b in zip(terms(seq), terms(2 * seq), strict=True))


def test_a_teacher_without_weights_of_its_own_has_no_buffers_of_its_own():
    """A self teacher without a frozen copy runs the student's modules (teacher_bytes_per_param
    0): no second set of RoPE tables (torchtune's LoRA Qwen2 builds one per layer: 0.38 GiB of
    the H100's LoRA self-teacher row, planned 12% over before)."""
    knobs = TrainKnobs(batch_size=1, seq_len=8)
    student = replace(LORA, rope_per_layer=True)
    teacher = replace(student, lora=None)
    own = resident_bytes(student, teacher, knobs).model_buffers
    shared = resident_bytes(student, teacher, replace(knobs, teacher_bytes_per_param=0.0))
    assert own - shared.model_buffers == teacher.buffer_bytes(knobs.dtype_bytes) > 0
    assert shared.model_buffers == student.buffer_bytes(knobs.dtype_bytes)
