"""Knowledge-distillation losses: divergences, the logits path and the fused linear path.

Conventions shared by every function here:

* ``p = softmax(teacher / T)`` and ``q = softmax(student / T)`` over the first ``min(Vs, Vt)`` vocab
  entries (Qwen-style padded embeddings differ only in never-used rows past the tokenizer).
* All softmax / divergence / CE math runs in fp32, whatever the input dtype.
* Reductions are means over positions whose label is not ``ignore_index``; the KD term is scaled by
  ``T^2`` (Hinton et al.) so its gradient magnitude does not shrink with the temperature.
* Divergences (``DIVERGENCES``):

  - ``forward_kl``: KL(p||q). This is the true KL; torchtune's ``ForwardKLLoss`` returns the soft
    cross-entropy H(p, q) = KL(p||q) + H(p), which has the same gradient but never reaches 0.
  - ``reverse_kl``: KL(q||p).
  - ``symmetric_kl``: 0.5 (KL(p||q) + KL(q||p)).
  - ``jsd``: beta KL(p||m) + (1 - beta) KL(q||m) with m = beta p + (1 - beta) q. At the edges, where
    that formula is identically 0, we follow TRL's ``generalized_jsd_loss``: beta == 0 gives KL(p||q)
    and beta == 1 gives KL(q||p).
  - ``tvd``: 0.5 sum |p - q|.
  - ``skew_forward_kl``: KL(p || a p + (1 - a) q), a = skew_alpha (DistiLLM).
  - ``skew_reverse_kl``: KL(q || a q + (1 - a) p).

The fused path (:func:`fused_linear_kd_loss`) never materializes full-vocab logits of either model:
per chunk of labelled tokens it computes both models' logits, the loss and the gradient w.r.t. the
student's chunk logits, and immediately folds that gradient into d(hidden) and d(weight). Backward
then only rescales those two tensors. :func:`fused_linear_ce_loss` is the same without a teacher.

Offline teacher (:func:`fused_linear_topk_kd_loss`): per labelled position only the teacher's top-k
ids ``i_1..i_k`` and log-probs ``log p_j = log_softmax(z_t / T)[i_j]`` are known. With the
student's full-vocab ``q = softmax(z_s / T)`` (over the first ``vocab`` entries), ``q_j = q[i_j]``
and the student tail ``q_tail = 1 - sum_j q_j`` (computed as a logsumexp over the other vocab
entries, so it stays exact when tiny), the divergence is taken over k+1 categories:

* ``tail="bucket"``: teacher ``[p_1..p_k, p_tail]``, ``p_tail = max(1 - sum_j p_j, 0)`` floored
  at the smallest normal float32 (fp16-stored log-probs can sum to >= 1; a zero ``p_tail`` would
  make reverse-type divergences ~1e38 where the true value is moderate; the floor changes
  forward-type values by < 1e-35), student ``[q_1..q_k, q_tail]``. Any divergence of
  ``DIVERGENCES`` applies unchanged to these two (k+1)-vectors.
* ``tail="renorm"``: teacher ``p'_j = p_j / sum_i p_i`` on the k ids, 0 elsewhere. For
  ``forward_kl``, ``jsd``, ``tvd``, ``skew_forward_kl`` and ``skew_reverse_kl`` this is exactly the
  full-vocab divergence against ``p'``: a vocab entry with p = 0 contributes a term linear in its q
  (0, ``-(1 - beta) log(1 - beta) q``, ``q / 2``, 0, ``-log(a) q``), so the tail entries lump
  into one category ``(p_tail = 0, q_tail)``. ``reverse_kl`` and ``symmetric_kl`` are infinite
  against a teacher with zeros, so for them the student is renormalised over the same k ids too
  (k categories, ``q'_j = q_j / sum_i q_i``; the student's tail mass then gets no gradient). So
  are ``jsd`` with beta = 1 (which is ``reverse_kl``) and ``skew_reverse_kl`` with a = 0, which
  are treated the same way.

When k equals the vocab size there is no tail and both modes compare the k entries (bucket: the
teacher as stored; renorm: renormalised). CE is from the labels at T = 1 over the student's full
vocab, as everywhere. Teacher ids must be distinct within a row (top-k ids are).
"""

from kd.losses.divergences import (
    DIVERGENCES,
    ce_loss,
    kd_loss,
    mix_ce_kd,
    per_token_divergence,
    shared_vocab_logprobs,
)
from kd.losses.fused import fused_linear_kd_loss
from kd.losses.topk import fused_linear_ce_loss, fused_linear_topk_kd_loss

__all__ = [
    "DIVERGENCES",
    "ce_loss",
    "fused_linear_ce_loss",
    "fused_linear_kd_loss",
    "fused_linear_topk_kd_loss",
    "kd_loss",
    "mix_ce_kd",
    "per_token_divergence",
    "shared_vocab_logprobs",
]
