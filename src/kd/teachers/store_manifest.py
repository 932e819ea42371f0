"""The manifest of kd's store (:mod:`kd.teachers.store_format`): what a store holds
(:class:`StoreSpec`, the teacher's identity), the manifest read and checked, and a complete store
checked against the run that reads it.

This module takes plain typed arguments (no config objects).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kd import folders, models
from kd.errors import KDUserError, brief, one_line
from kd.fileio import sha256_file
from kd.teachers.store_format import CROSS_VERSION, FORMAT, FORMAT_VERSION, KEY, MANIFEST_FILE

if TYPE_CHECKING:
    from kd.runtime.run_context import RunContext

__all__ = [
    "StoreSpec",
    "check_store_matches",
    "read_manifest",
    "run_teacher_identity",
    "spec_differences",
    "teacher_identity",
]


# ------------------------------------------------------------------------------- what a store is
@dataclass(frozen=True)
class StoreSpec:
    """What a store holds: every manifest field but the shard list.

    Attributes:
        teacher: the teacher's identity: ``component``, ``folder``, ``files`` (``[name, size]``
            pairs of its weight files) and ``config_sha256`` (of its config.json, or None).
        config_sha256: hash of the config sections that change the teacher's outputs.
        tokenizer_sha256: :func:`~kd.teachers.store_format.files_sha256` of the tokenizer's files.
        temperature: T of ``log_softmax(z_t / T)``.
        k: top-k entries stored per labelled position.
        vocab: ``min(Vs, Vt)``: the entries the log-softmax runs over.
        teacher_vocab: Vt.
        max_seq_len: ``tokenizer.max_seq_len`` of the precompute (None: untruncated).
        dataset_fingerprint: :func:`~kd.teachers.store_format.dataset_fingerprint` of the rows.
        num_rows: rows of the dataset.
        world_size: ranks of the precompute (rank r wrote rows r, r + W, ...).
        rows_per_shard: rows per shard file.
        cross_tokenizer: for a teacher with another tokenizer, ``teacher_vocab`` (its string ->
            id), ``teacher_size`` (its distribution's entries; ``vocab`` and ``teacher_vocab``
            are the same) and ``teacher_tokenizer_sha256``; None (omitted in the manifest) for
            a teacher scoring the student's tokens.
    """

    teacher: dict[str, Any]
    config_sha256: str
    tokenizer_sha256: str
    temperature: float
    k: int
    vocab: int
    teacher_vocab: int
    max_seq_len: int | None
    dataset_fingerprint: str
    num_rows: int
    world_size: int
    rows_per_shard: int
    cross_tokenizer: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["cross_tokenizer"] is None:  # a plain store's manifest is as before
            del out["cross_tokenizer"]
        return out


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(StoreSpec))


def spec_differences(stored: Mapping[str, Any], spec: StoreSpec) -> list[str]:
    """The :class:`StoreSpec` fields in which a manifest differs from ``spec`` (the teacher by
    what identifies it: a moved folder or server is the same teacher)."""
    ours = dataclasses.asdict(spec)
    return [
        name
        for name in _SPEC_FIELDS
        if (
            _teacher_key(stored.get(name)) != _teacher_key(ours[name])
            if name == "teacher"
            else stored.get(name) != ours[name]
        )
    ]


def teacher_identity(component: str, folder: Path, files: Any) -> dict[str, Any]:
    """A teacher's identity in a manifest: its builder, folder, weight files with their sizes,
    and the sha256 of its config.json (None without one). Stores are matched on all but the
    folder (a moved teacher is the same teacher); two checkpoints of one architecture whose
    files have the same names and sizes are not told apart.

    Args:
        component: the ``teacher_model`` node's ``_component_``.
        folder: the folder of its weights (checkpointer ``checkpoint_dir`` or model ``path``).
        files: its weight files: a list of names or torchtune's ``{filename_format,
            max_filename}`` (:attr:`kd.models.WeightsSource.files`).
    """
    from kd.config.validate import checkpoint_file_names

    files = checkpoint_file_names(files) or []
    config = folders.file_in(folder, folders.CONFIG_JSON, key="teacher_model")
    return {
        "component": component,
        "folder": str(folder.resolve()),
        "files": [[name, (folder / name).stat().st_size] for name in sorted(files)],
        "config_sha256": sha256_file(config) if config is not None else None,
    }


def run_teacher_identity(ctx: RunContext, source: models.WeightsSource) -> dict[str, Any]:
    """The identity (:func:`teacher_identity`) of the run's ``teacher_model``, whose weights are at
    ``source`` (:attr:`kd.runtime.run_context.ModelFacts.teacher_source`)."""
    component = str(ctx.node("teacher_model").get("_component_"))
    return teacher_identity(component, source.folder, source.files)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of the store in ``folder``, or None when there is none.

    Raises:
        KDUserError: the manifest exists but is not a kd teacher-logits manifest of this version.
    """
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KDUserError(
            f"{KEY}: {path} is unreadable ({brief(e)}); delete {folder} and rerun "
            "kd run teacher_logits"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise KDUserError(
            f"{KEY}: {path} is not a kd teacher-logits manifest; point {KEY} at a folder "
            "written by kd run teacher_logits"
        )
    if manifest.get("version") not in (FORMAT_VERSION, CROSS_VERSION):
        raise KDUserError(
            f"{KEY}: {folder} has format version {manifest.get('version')}, this kd reads "
            f"{FORMAT_VERSION} and {CROSS_VERSION}; rerun kd run teacher_logits into a new folder"
        )
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise KDUserError(
            f"{KEY}: {path} {problem} (edited or damaged); restore the file kd run "
            "teacher_logits wrote, or rerun it into a new folder"
        )
    return manifest


# Manifest fields the reader computes with, and their least value.
_MANIFEST_INTS = {
    "k": 1,
    "vocab": 1,
    "world_size": 1,
    "rows_per_shard": 1,
    "rows_per_group": 1,
    "num_rows": 0,
}


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _manifest_problem(manifest: Mapping[str, Any]) -> str | None:
    """What is wrong with a manifest's fields (None: nothing): each number the reader computes
    with an integer in range, each shard a plain file name with an integer size."""
    for name, least in _MANIFEST_INTS.items():
        if name not in manifest:
            return f"has no {name!r}"
        if not _is_int(manifest[name], least):
            return f"has {name}={one_line(repr(manifest[name]))[:40]}, not an integer >= {least}"
    cross = manifest.get("cross_tokenizer")
    if (manifest.get("version") == CROSS_VERSION) != isinstance(cross, Mapping) or (
        isinstance(cross, Mapping)
        and not (
            isinstance(cross.get("teacher_vocab"), Mapping)
            and _is_int(cross.get("teacher_size"), 1)
        )
    ):
        return f"has version {manifest.get('version')} with cross_tokenizer {type(cross).__name__}"
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return "has no list of shards"
    for entry in shards:
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return f"lists the shard {one_line(repr(name))[:60]}, not a file name"
        if not _is_int(entry.get("size"), 0):
            return f"gives shard {name} the size {one_line(repr(entry.get('size')))[:40]}"
    return None


# ------------------------------------------------------------------- checked against a run
def check_store_matches(
    manifest: Mapping[str, Any],
    folder: Path,
    *,
    tokenizer_sha256: str,
    max_seq_len: int | None,
    dataset_fingerprint: str,
    temperature: float,
    k: int,
    student_vocab: int | None,
    teacher: Mapping[str, Any] | None,
    cross_tokenizer: bool = False,
) -> None:
    """Refuse a store that was not made for this run, one line naming the difference and the fix.

    Args:
        manifest: the complete store's manifest (:func:`read_manifest`).
        folder: the store.
        tokenizer_sha256: :func:`~kd.teachers.store_format.files_sha256` of this run's tokenizer
            files.
        max_seq_len: this run's ``tokenizer.max_seq_len``.
        dataset_fingerprint: this run's :func:`~kd.teachers.store_format.dataset_fingerprint`.
        temperature: this run's temperature.
        k: ``teacher_logits.k`` of this run (at most the stored k).
        student_vocab: Vs; ``min(Vs, Vt)`` must be the stored ``vocab`` (None: not compared;
            a cross-tokenizer store's vocabulary is the teacher's own).
        teacher: this run's teacher identity when the config names a teacher (else None: not
            compared).
        cross_tokenizer: whether this run sets ``cross_tokenizer:`` (the store must then hold a
            cross-tokenizer teacher's tokens and offsets, and must not otherwise).

    Raises:
        KDUserError: the first difference.
    """
    redo = (
        f"rerun kd run teacher_logits with this config into a new {KEY}, or point {KEY} at "
        "the store made for it"
    )
    _check_cross(manifest, folder, cross_tokenizer)
    if teacher is not None and _teacher_key(manifest.get("teacher")) != _teacher_key(teacher):
        stored = manifest.get("teacher") or {}
        raise KDUserError(
            f"{KEY}: {folder} holds the logits of another teacher ({_describe(stored)}) than "
            f"teacher_model ({_describe(teacher)}); {redo}"
        )
    checks = (
        ("other tokenizer files", manifest.get("tokenizer_sha256"), tokenizer_sha256, False),
        ("another tokenizer.max_seq_len", manifest.get("max_seq_len"), max_seq_len, True),
        (
            "other rows (the tokenized dataset)",
            manifest.get("dataset_fingerprint"),
            dataset_fingerprint,
            False,
        ),
        ("another temperature", manifest.get("temperature"), float(temperature), True),
    )
    for what, stored_value, ours, show in checks:
        if stored_value != ours:
            shown = f" ({stored_value} there, {ours} here)" if show else ""
            raise KDUserError(
                f"{KEY}: {folder} was made with {what} than this run's{shown}; {redo}"
            )
    stored_k = int(manifest.get("k", 0))
    if k > stored_k:
        raise KDUserError(
            f"teacher_logits.k: {k} is more than the {stored_k} stored in {folder} ({KEY}); set "
            f"teacher_logits.k to {stored_k} or less, or rerun kd run teacher_logits with "
            f"teacher_logits.k={k} into a new {KEY}"
        )
    if student_vocab is None:
        return
    vocab = min(student_vocab, int(manifest.get("teacher_vocab", 0)))
    if vocab != manifest.get("vocab"):
        raise KDUserError(
            f"{KEY}: {folder} holds log-probs over {manifest.get('vocab')} vocabulary entries, "
            f"but this student's vocabulary gives {vocab}; {redo}"
        )


def _check_cross(manifest: Mapping[str, Any], folder: Path, cross_tokenizer: bool) -> None:
    """A cross-tokenizer store with ``cross_tokenizer:`` only, and only such a store."""
    held = manifest.get("cross_tokenizer") is not None
    if cross_tokenizer and not held:
        raise KDUserError(
            f"{KEY}: {folder} holds top-k log-probs over the student's tokens, without the "
            "teacher's token ids and offsets cross_tokenizer needs; rerun kd run teacher_logits "
            "with this config (cross_tokenizer and the teacher's kd.hf teacher_model) into a new "
            f"{KEY}, or remove cross_tokenizer"
        )
    if held and not cross_tokenizer:
        raise KDUserError(
            f"{KEY}: {folder} holds a teacher with another tokenizer (its own token ids and "
            "offsets); set cross_tokenizer: {} as when it was written (beside teacher_logits, "
            f"in its teachers member if any), or point {KEY} at a store of the student's tokens"
        )


def _teacher_key(teacher: Any) -> Any:
    """What identifies a teacher (its folder may move): component, weight files and sizes,
    config.json hash."""
    if not isinstance(teacher, Mapping):
        return None
    files = [list(f) for f in teacher.get("files") or []]
    return (teacher.get("component"), files, teacher.get("config_sha256"))


def _describe(teacher: Mapping[str, Any]) -> str:
    folder = teacher.get("folder")
    return f"{teacher.get('component')} from {folder}" if folder else str(teacher.get("component"))
