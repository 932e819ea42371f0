"""Recipe state (``recipe_state.pt``): optimizer, scheduler, counters and RNG, loadable with
``torch.load(weights_only=True)`` so that nothing is unpickled on resume."""

from __future__ import annotations

import importlib
import logging
import random
from pathlib import Path
from typing import Any

import torch

from kd.checkpoint.layout import RECIPE_STATE_FILE
from kd.errors import KDUserError, brief

logger = logging.getLogger("kd")

# Tensor subclasses that may sit in optimizer state (torchao's low-bit AdamW states). They are stored
# as their plain inner tensors plus the class name, so torch.load(weights_only=True) still reads the
# file, and rebuilt exactly on load (bit-identical resume with AdamW8bit too).
_SUBCLASS_KEY = "__kd_tensor_subclass__"
_SUBCLASS_MODULES = ("torchao.optim.",)


def encode_tensor_subclasses(obj: Any) -> Any:
    """Replace allow-listed tensor subclasses by ``{_SUBCLASS_KEY: name, inner..., ctx, size}`` dicts."""
    if isinstance(obj, torch.Tensor) and type(obj) not in (torch.Tensor, torch.nn.Parameter):
        cls = type(obj)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name.startswith(_SUBCLASS_MODULES) and hasattr(obj, "__tensor_flatten__"):
            inner_names, ctx = obj.__tensor_flatten__()
            return {
                _SUBCLASS_KEY: name,
                "inner": {n: getattr(obj, n) for n in inner_names},
                "ctx": list(ctx) if isinstance(ctx, tuple) else ctx,
                "size": list(obj.size()),
                "stride": list(obj.stride()),
            }
        return obj
    if isinstance(obj, dict):
        return {k: encode_tensor_subclasses(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode_tensor_subclasses(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(encode_tensor_subclasses(v) for v in obj)
    return obj


def decode_tensor_subclasses(obj: Any) -> Any:
    """Inverse of :func:`encode_tensor_subclasses` (only allow-listed classes are rebuilt)."""
    if isinstance(obj, dict):
        name = obj.get(_SUBCLASS_KEY)
        if isinstance(name, str):
            if not name.startswith(_SUBCLASS_MODULES):
                raise KDUserError(f"recipe state names tensor class {name}, which kd does not load")
            module, _, qual = name.rpartition(".")
            cls = getattr(importlib.import_module(module), qual)
            ctx = obj["ctx"]
            ctx = tuple(ctx) if isinstance(ctx, list) else ctx
            return cls.__tensor_unflatten__(
                obj["inner"], ctx, torch.Size(obj["size"]), tuple(obj["stride"])
            )
        return {k: decode_tensor_subclasses(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tensor_subclasses(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(decode_tensor_subclasses(v) for v in obj)
    return obj


def check_weights_only(obj: Any, path: str = "recipe_state") -> None:
    """Fail at save time (not hours later at resume) if obj is not weights_only-loadable.

    Args:
        obj: the recipe state, after :func:`encode_tensor_subclasses`.
        path: where ``obj`` sits, for the message.

    Raises:
        TypeError: naming the first entry that ``torch.load(weights_only=True)`` cannot read.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            # DTensor (FSDP) or torchao quantized optimizer states: gather / convert first.
            raise TypeError(
                f"{path}: tensor subclass {type(obj).__name__} cannot be saved in recipe_state.pt"
            )
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{path}: dict key {k!r} of type {type(k).__name__}")
            check_weights_only(v, f"{path}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_weights_only(v, f"{path}[{i}]")
        return
    raise TypeError(
        f"{path}: {type(obj).__name__} is not loadable with torch.load(weights_only=True)"
    )


def load_recipe_state(ckpt: Path) -> dict[str, Any]:
    """``recipe_state.pt`` of a step checkpoint, loaded with ``weights_only=True`` on CPU."""
    path = Path(ckpt) / RECIPE_STATE_FILE
    fix = f"delete {Path(ckpt).name} to resume from an older checkpoint"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise KDUserError(f"{path}: cannot read the recipe state ({brief(e)}); {fix}") from e
    if not isinstance(state, dict):
        raise KDUserError(
            f"{path}: holds a {type(state).__name__}, not a recipe state (a dict); {fix}"
        )
    return decode_tensor_subclasses(state)


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and CUDA RNG states as tensors / ints (weights_only-loadable)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional for kd itself
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "name": str(name),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    py = state["python"]
    random.setstate(
        (int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"])
    )
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning(
                "checkpoint has CUDA RNG states of %d devices, this process sees %d; CUDA RNG not restored",
                len(cuda_states),
                torch.cuda.device_count(),
            )
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state(
            (
                s["name"],
                s["keys"].numpy().astype(np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )
