"""torchtune KD configs run unchanged: map their keys and loss components to kd's, with notices.

Each mapping appends one line to ``notices`` (printed as ``kd: notice: ...`` by
:func:`kd.config.load_config`), so the user sees what changed instead of a silent rewrite.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from kd.config import schema

# torchtune KD loss class name -> kd divergence. kd always computes the loss chunked over labelled
# tokens, so the chunked and unchunked torchtune classes map to the same divergence.
TORCHTUNE_KD_LOSSES: dict[str, str] = {
    "ForwardKLLoss": "forward_kl",
    "ForwardKLWithChunkedOutputLoss": "forward_kl",
    "ReverseKLLoss": "reverse_kl",
    "ReverseKLWithChunkedOutputLoss": "reverse_kl",
    "SymmetricKLLoss": "symmetric_kl",
    "SymmetricKLWithChunkedOutputLoss": "symmetric_kl",
}

# Cross-entropy losses a torchtune config puts under `loss:`; kd's loss already includes CE.
CE_LOSSES: frozenset[str] = frozenset(
    {"CEWithChunkedOutputLoss", "LinearCrossEntropyLoss", "CrossEntropyLoss"}
)
_LOSS_PACKAGES = ("torchtune.modules.loss", "torch.nn")

# torchtune top-level keys with an exact kd equivalent inside the `fsdp:` section.
_FSDP_KEYS = {
    "fsdp_cpu_offload": "cpu_offload",
    "fsdp_reshard_after_forward": "reshard_after_forward",
}


def _loss_class(target: Any) -> str | None:
    """Class name of a torchtune/torch loss target, or None for anything else."""
    if not isinstance(target, str) or not target.startswith(_LOSS_PACKAGES):
        return None
    return target.rsplit(".", 1)[-1]


def apply_compat(cfg: DictConfig, notices: list[str]) -> None:
    """Rewrite torchtune-only keys and loss nodes of ``cfg`` in place.

    - keys in :data:`kd.config.schema.IGNORED_TORCHTUNE_KEYS` are dropped (``fsdp_*`` keys are
      moved into the ``fsdp:`` section);
    - ``loss:`` naming a cross-entropy loss becomes ``null``;
    - ``kd_loss:`` as a torchtune loss node or a plain string becomes ``{divergence: ...}``.

    Args:
        cfg: the config as read from YAML (and overrides); modified in place.
        notices: one line is appended per change.
    """
    for name, reason in schema.IGNORED_TORCHTUNE_KEYS.items():
        if name not in cfg:
            continue
        value = cfg[name]
        del cfg[name]
        if name in _FSDP_KEYS:
            section = cfg.get("fsdp")
            if section is None:
                cfg["fsdp"] = {}
                section = cfg["fsdp"]
            if isinstance(section, DictConfig) and _FSDP_KEYS[name] not in section:
                section[_FSDP_KEYS[name]] = value
                notices.append(f"{name}: mapped to fsdp.{_FSDP_KEYS[name]}={value}")
                continue
        notices.append(f"{name}: ignored ({reason})")
    _map_loss(cfg, notices)
    _map_kd_loss(cfg, notices)


def _map_loss(cfg: DictConfig, notices: list[str]) -> None:
    node = cfg.get("loss")
    if not isinstance(node, DictConfig):
        return
    target = node.get("_component_")
    if _loss_class(target) in CE_LOSSES:
        cfg["loss"] = None
        notices.append(
            f"loss: {target} dropped; kd's loss already includes it as "
            "(1 - kd_ratio) * CE + kd_ratio * KD"
        )


def _map_kd_loss(cfg: DictConfig, notices: list[str]) -> None:
    if "kd_loss" not in cfg:
        return
    value = cfg["kd_loss"]
    if isinstance(value, str):
        if "." not in value:
            # `kd_loss: reverse_kl` is shorthand for `kd_loss: {divergence: reverse_kl}`; the
            # section defaults fill beta and skew_alpha later.
            cfg["kd_loss"] = {"divergence": value}
            return
        # A dotted path given as a string (`kd_loss=torchtune.modules.loss.ReverseKLLoss`).
        cfg["kd_loss"] = {"_component_": value}
        value = cfg["kd_loss"]
    if not isinstance(value, DictConfig) or "_component_" not in value:
        return
    target = value.get("_component_")
    divergence = TORCHTUNE_KD_LOSSES.get(_loss_class(target) or "")
    if divergence is None:
        return  # validate_config reports the unsupported component with the valid choices
    # kd's own section keys (beta, skew_alpha) set next to the component are kept.
    kept = {k: value[k] for k in value if k in schema.KD_LOSS and k != "divergence"}
    extra = sorted(k for k in value if k != "_component_" and k not in kept)
    cfg["kd_loss"] = {"divergence": divergence, **kept}
    line = f"kd_loss: {target} mapped to kd_loss.divergence={divergence}"
    if extra:
        line += f" (its {', '.join(extra)} ignored: kd chunks the loss by loss_chunk_size)"
    notices.append(line)
