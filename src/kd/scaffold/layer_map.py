"""``kd init``'s hidden-state map (``hidden_states.layer_map``, :mod:`kd.teachers.hidden_states`).

A student cut from the teacher (a depth-pruned copy: same widths, some decoder layers dropped)
has each kept layer's weights equal to one of the teacher's: those layers map to themselves, found
by comparing the weights. Any other pair gets a uniform map: student layer ``i`` of ``n`` to
teacher layer ``floor((i + 1) * m / n) - 1`` of ``m`` (the last to the last). Both maps also pair
the embeddings and the final norms.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kd.scaffold.inspection import ModelChoice

__all__ = ["hidden_states_lines", "kept_layers", "propose_layer_map", "uniform_map"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def uniform_map(student_layers: int, teacher_layers: int) -> list[int]:
    """Teacher layer of each student layer, spread evenly (the last maps to the last)."""
    return [max(0, (i + 1) * teacher_layers // student_layers - 1) for i in range(student_layers)]


def _layer_tensors(folder: Path) -> dict[int, dict[str, str]]:
    """``{layer: {parameter name within the layer: file}}`` of a folder's safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text()).get("weight_map", {})
    else:
        from safetensors import safe_open

        names = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                names.update(dict.fromkeys(f.keys(), file.name))
    layers: dict[int, dict[str, str]] = {}
    for name, file in names.items():
        m = _LAYER.search(name)
        if m is not None:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = f"{name}\0{file}"
    return layers


def _read(folder: Path, entry: str):  # noqa: ANN202 - a torch.Tensor (torch imported lazily)
    from safetensors import safe_open

    name, file = entry.split("\0")
    with safe_open(str(folder / file), "pt") as f:
        return f.get_tensor(name)


def kept_layers(teacher: Path, student: Path) -> list[int] | None:
    """The teacher layer each student layer was cut from, when every student layer's weights
    equal one teacher layer's (compared on one weight per layer, then all of that layer's);
    None otherwise."""
    import torch

    t_layers, s_layers = _layer_tensors(teacher), _layer_tensors(student)
    if not s_layers or not t_layers or len(s_layers) > len(t_layers):
        return None
    found: list[int] = []
    start = 0
    for i in sorted(s_layers):
        names = s_layers[i]
        probe = sorted(names)[0]
        s_probe = _read(student, names[probe])
        match = None
        for j in range(start, len(t_layers)):
            other = t_layers.get(j, {})
            if set(other) != set(names):
                continue
            t_probe = _read(teacher, other[probe])
            if t_probe.shape == s_probe.shape and torch.equal(t_probe, s_probe):
                if all(
                    torch.equal(_read(student, names[n]), _read(teacher, other[n])) for n in names
                ):
                    match = j
                    break
        if match is None:
            return None
        found.append(match)
        start = match + 1
    return found


def propose_layer_map(teacher: ModelChoice, student: ModelChoice) -> tuple[list[str], str]:
    """``hidden_states.layer_map`` for the pair, and how it was found (one phrase)."""
    kept = None
    if student.weight_files and teacher.weight_files:
        kept = kept_layers(teacher.folder, student.folder)
    if kept is not None:
        how = (
            "the student's layers were cut from the teacher's (equal weights): each maps to itself"
        )
        layers = kept
    else:
        n, m = student.num_layers or 1, teacher.num_layers or 1
        how = f"uniform: {n} student layers spread over the teacher's {m}"
        layers = uniform_map(n, m)
    entries = ["embed:embed", *(f"{i}:{j}" for i, j in enumerate(layers)), "norm:norm"]
    return entries, how


def hidden_states_lines(teacher: ModelChoice, student: ModelChoice) -> list[str]:
    """The commented ``hidden_states:`` block of kd init's config (needs the teacher model)."""
    entries, how = propose_layer_map(teacher, student)
    listed = ", ".join(f"'{e}'" for e in entries)
    return [
        "# Hidden-state distillation: match the student's layer outputs to the teacher's",
        "# (a learned projection where widths differ; docs/hidden_states.md). The map:",
        f"# {how}.",
        "# hidden_states:",
        f"#   layer_map: [{listed}]",
        "#   loss: cosine  # cosine, mse or nmse",
        "#   weight: 1.0  # loss = (1 - kd_ratio) * CE + kd_ratio * KD + weight * hidden_loss",
    ]
