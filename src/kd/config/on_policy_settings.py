"""The on-policy section of :class:`kd.config.run.RunConfig` (``on_policy:``), each key
declared once: how often a micro-batch trains on the student's own completions, how they are
sampled, and the served sampler's server (:mod:`kd.rollouts`).

This module imports no torch: ``kd plan`` and the config checks stay fast.
"""

from __future__ import annotations

from pathlib import Path

from kd.config.declare import MAY_CHANGE, MUST_MATCH, optional_base_url, setting, settings

# What may sample the student's on-policy completions (on_policy.sampler; kd.rollouts).
SAMPLERS: tuple[str, ...] = ("local", "served")
# What the local sampler may sample in (on_policy.sampling_dtype; null = the student's dtype).
SAMPLING_DTYPES: tuple[str, ...] = ("bf16", "fp32")


@settings
class OnPolicySettings:
    """On-policy distillation (``on_policy:``; :mod:`kd.training.on_policy`), GKD's knobs as TRL names
    them: with probability lmbda a micro-batch trains on the student's own completions of its
    prompts (drawn once per micro-batch, the same on every rank), scored by the teacher."""

    lmbda: float = setting(
        "on_policy.lmbda",
        0.5,
        "probability that a micro-batch trains on the student's own completions (0 = never, "
        "1 = always)",
        min=0.0,
        max=1.0,
        resume=MUST_MATCH,
    )
    max_new_tokens: int = setting(
        "on_policy.max_new_tokens",
        128,
        "tokens sampled per prompt at most (sampling stops earlier at the tokenizer's stop "
        "tokens); prompt + max_new_tokens fit tokenizer.max_seq_len (longer prompts keep their "
        "last tokens)",
        min=1,
        resume=MUST_MATCH,
    )
    temperature: float = setting(
        "on_policy.temperature",
        0.9,
        "sampling temperature of the completions (0 = greedy); the loss uses temperature",
        min=0.0,
        resume=MUST_MATCH,
    )
    top_p: float = setting(
        "on_policy.top_p",
        1.0,
        "nucleus sampling: the smallest set of tokens whose probability reaches top_p",
        min_exclusive=0.0,
        max=1.0,
        resume=MUST_MATCH,
    )
    seq_kd: bool = setting(
        "on_policy.seq_kd",
        False,
        "the other micro-batches (probability 1 - lmbda) train on the teacher's completions "
        "instead of the dataset's (sequence-level KD)",
        resume=MUST_MATCH,
    )
    # What samples the student (kd.rollouts: the Sampler interface). The served sampler's own
    # settings are the server_* keys and sync_every_n_steps (kd.rollouts.served).
    sampler: str = setting(
        "on_policy.sampler",
        "local",
        "what samples the student's completions: local (the student in this process) or served "
        "(a vLLM / SGLang server given the student's weights, on_policy.server_url)",
        choices=SAMPLERS,
        resume=MAY_CHANGE,
    )
    batch_rollouts: bool = setting(
        "on_policy.batch_rollouts",
        False,
        "local sampler: one generation per optimizer step over the prompts of all its on-policy "
        "micro-batches, grouped by length, finished rows leaving the batch (each row keeps its "
        "own seeded generator; float rounding of the wider batch may differ from false)",
        resume=MAY_CHANGE,
    )
    rollout_batch_size: int | None = setting(
        "on_policy.rollout_batch_size",
        None,
        "batch_rollouts: prompts per generation (length-sorted groups); null = all of a step's",
        min=1,
        resume=MAY_CHANGE,
    )
    cuda_graphs: bool = setting(
        "on_policy.cuda_graphs",
        False,
        "local sampler with batch_rollouts on a CUDA device: each decode step is replayed from a "
        "CUDA graph captured once per batch size (one launch a token instead of one per "
        "operation; the same tokens); not with compile: true",
        resume=MAY_CHANGE,
    )
    async_steps: int = setting(
        "on_policy.async_steps",
        0,
        "1: the next step's completions are sampled while this step trains (at most one "
        "optimizer step stale); 0: sampled at the start of their own step",
        min=0,
        max=1,
        resume=MAY_CHANGE,
    )
    sampling_dtype: str | None = setting(
        "on_policy.sampling_dtype",
        None,
        "local sampler: the dtype it samples in: null = the student's (dtype); bf16 on an fp32 "
        "student keeps a bf16 copy of its weights (updated after each step; KV cache and logits "
        "in bf16, the draw in fp32): faster decoding, slightly other probabilities",
        choices=SAMPLING_DTYPES,
        resume=MAY_CHANGE,
    )
    # The served sampler (sampler: served; kd.rollouts.served, docs/served_sampler.md).
    sync_every_n_steps: int = setting(
        "on_policy.sync_every_n_steps",
        1,
        "sampler served: the student's weights are pushed to the server every n optimizer steps "
        "(a LoRA adapter hot-loaded, full weights reloaded); the rollouts between are up to n - 1 "
        "steps stale (metrics: rollout_version_lag)",
        min=1,
        resume=MUST_MATCH,
    )
    server_url: str | None = setting(
        "on_policy.server_url",
        None,
        "sampler served: the vLLM / SGLang server's base URL (http://host:port), without /v1",
        read=optional_base_url,
        resume=MAY_CHANGE,
    )
    server_api: str = setting(
        "on_policy.server_api",
        "vllm",
        "sampler served: the server's protocol: vllm (POST /v1/completions with token ids) or "
        "sglang (POST /generate with input_ids)",
        choices=("vllm", "sglang"),
        resume=MAY_CHANGE,
    )
    server_model: str | None = setting(
        "on_policy.server_model",
        None,
        "sampler served: the name the server serves the student's base model under "
        "(--served-model-name), checked before training",
        resume=MAY_CHANGE,
    )
    server_sync_dir: Path | None = setting(
        "on_policy.server_sync_dir",
        None,
        "sampler served: where the pushed weights are written, a folder the server reads at the "
        "same path (a shared disk when it runs elsewhere); null = output_dir/served_weights",
        resume=MAY_CHANGE,
    )
    server_timeout: float = setting(
        "on_policy.server_timeout",
        300.0,
        "sampler served: seconds one attempt of a request (a rollout, a weight push) may take in "
        "all; a request with its retries ends within (retries + 1) x timeout + the backoff "
        "waits, then the run saves a checkpoint and stops",
        min_exclusive=0,
        max=3600,
        resume=MAY_CHANGE,
    )
    server_retries: int = setting(
        "on_policy.server_retries",
        3,
        "sampler served: retries of a request that timed out, could not connect or got a 429 / "
        "5xx (exponential backoff); then the run saves a checkpoint and stops",
        min=0,
        max=100,
        resume=MAY_CHANGE,
    )
    server_backoff: float = setting(
        "on_policy.server_backoff",
        1.0,
        "sampler served: seconds before the first retry, doubling (at most 60 s a wait)",
        min=0,
        max=60,
        resume=MAY_CHANGE,
    )
    server_concurrency: int = setting(
        "on_policy.server_concurrency",
        16,
        "sampler served: rollout requests in flight per rank (one prompt each; the server "
        "batches them)",
        min=1,
        max=1024,
        resume=MAY_CHANGE,
    )
    server_token_env: str | None = setting(
        "on_policy.server_token_env",
        None,
        "sampler served: the environment variable holding the server's API token (vllm serve "
        "--api-key; sent as a Bearer token, never printed); null = none",
        resume=MAY_CHANGE,
    )
    server_check_model: bool = setting(
        "on_policy.server_check_model",
        True,
        "sampler served: at the first rollout, compare the server's top-1 log-probs over the "
        "first prompt with the student's and stop when they differ by more than 0.3 nats on "
        "average (another model, or a LoRA adapter on another base); false: say the gap only",
        resume=MAY_CHANGE,
    )
    server_sleep: bool = setting(
        "on_policy.server_sleep",
        False,
        "sampler served, vLLM: the server sleeps while each step trains (vllm serve "
        "--enable-sleep-mode, VLLM_SERVER_DEV_MODE=1): its KV cache and weights leave the GPU "
        "after the step's rollouts (level 2 when the push after the step reloads the weights, "
        "else level 1: weights kept in CPU memory) and come back, after kd frees its cached "
        "device memory, for the next push or rollout: one GPU shared in time",
        resume=MAY_CHANGE,
    )
    server_admin_token_env: str | None = setting(
        "on_policy.server_admin_token_env",
        None,
        "sampler served, SGLang: the environment variable holding the server's "
        "--admin-api-key, sent with kd's weight pushes (/update_weights_from_disk and the LoRA "
        "routes, which take only that key once it is set; never printed); null = "
        "server_token_env's token",
        resume=MAY_CHANGE,
    )

    @property
    def teacher_samples(self) -> bool:
        """Whether the teacher may sample completions to train on (``seq_kd`` with ``lmbda``
        below 1: the coin then sometimes comes out false): the one test the run
        (:attr:`kd.config.run.RunConfig.teacher_samples`) and the generation plan
        (:func:`kd.memory.generation.generation_knobs`) read."""
        return self.seq_kd and self.lmbda < 1
