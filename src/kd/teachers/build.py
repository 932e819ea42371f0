"""The one place a config's teacher is chosen, and each kind's lifecycle before it teaches.

:func:`teacher_source` reads the config once and returns what the run's teacher is made from:

* ``teacher_logits:`` set -> :class:`StoredTeacherSource` (kd's store, or an axolotl / DistillKit
  file; ``teacher_model``, if set, only identifies the teacher the store came from);
* else ``teacher_server:`` set -> :class:`ServedTeacherSource` (a vLLM or SGLang server,
  :mod:`kd.teachers.served`); beside ``teacher_logits`` it is the server that filled the store
  (``kd run teacher_logits``), not asked by ``kd run kd``;
* else ``teacher_model:`` set -> :class:`ModelTeacherSource` (a local model, either backend);
* else None: plain fine-tuning.

A source has the recipe's phases: :meth:`TeacherSource.check` runs every weight-free check
(``kd validate`` and ``kd run`` before any weight loads), :meth:`TeacherSource.load` returns the
:class:`kd.teachers.Teacher`. A new kind of teacher is a new source and teacher here, plus its
config keys; the recipe does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kd import models
from kd.config.run import RunConfig, TeacherLogitsSettings
from kd.errors import KDUserError
from kd.teachers import foreign_logits, stored_logits
from kd.teachers.base import Teacher
from kd.teachers.files import FileTeacher, TeacherLogitsFile
from kd.teachers.model import ModelTeacher
from kd.teachers.quantize import quantize_int8
from kd.teachers.served import ServedTeacher, TeacherClient, check_server
from kd.training.prepare import prepare_teacher
from kd.training.run_context import ModelFacts, RunContext

__all__ = [
    "ModelTeacherSource",
    "ServedTeacherSource",
    "StoredTeacherSource",
    "TeacherSource",
    "teacher_source",
]


class TeacherSource(Protocol):
    """How the config names the run's teacher, before it is loaded.

    Attributes:
        reads: the model keys whose weights this teacher reads (checked before loading).
        needs_rows: whether batches must carry their dataset row indices (files are indexed by
            row).
    """

    reads: tuple[str, ...]
    needs_rows: bool

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        """Every check that needs no weight, against the run's models and training data."""
        ...

    def load(self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None) -> Teacher:
        """The teacher, ready (collective when distributed)."""
        ...


def teacher_source(run: RunConfig) -> TeacherSource | None:
    """The run's teacher source (see the module docstring), or None without a teacher."""
    if run.teacher_logits is not None:  # also beside teacher_server: the store it filled
        _check_no_quantization(run, "this run reads stored teacher logits (teacher_logits)")
        return StoredTeacherSource(run)
    if run.teacher_server is not None:
        _check_no_quantization(run, "this run's teacher is served (teacher_server)")
        return ServedTeacherSource(run)
    if run.components["teacher_model"] is not None:
        return ModelTeacherSource(quantization=getattr(run, "teacher_quantization", "none"))
    _check_no_quantization(run, "this run has no teacher_model")
    return None


def _check_no_quantization(run: RunConfig, why: str) -> None:
    """``teacher_quantization`` applies to a local ``teacher_model`` only."""
    quantization = getattr(run, "teacher_quantization", "none")  # a duck-typed run may lack it
    if quantization != "none":
        raise KDUserError(
            f"teacher_quantization: {quantization} quantizes a local teacher_model, "
            f"and {why}; set teacher_quantization=none"
        )


class ModelTeacherSource:
    """``teacher_model`` (+ ``teacher_checkpointer`` for a torchtune builder): a local model,
    its decoder-layer linears quantized to int8 when ``quantization`` is ``int8``
    (``teacher_quantization``, :mod:`kd.teachers.quantize`)."""

    reads = ("teacher_model",)
    needs_rows = False

    def __init__(self, quantization: str = "none"):
        self.quantization = quantization

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        # Its shapes, files and tokenizer were checked with the student's
        # (RunContext.inspect_models reads every key of ``reads``).
        if self.quantization != "none" and ctx.world.distributed:
            raise KDUserError(
                f"teacher_quantization: {self.quantization} runs on one device (an FSDP2-sharded "
                "teacher is not quantized); set teacher_quantization=none, or run on one device"
            )

    def load(self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None) -> ModelTeacher:
        def prepare(model: Any, shard: Any) -> Any:
            model = prepare_teacher(model, shard=shard)
            return quantize_int8(model) if self.quantization == "int8" else model

        model = ctx.load_model(
            "teacher_model", facts.sources["teacher_model"], prepare, run_dir=run_dir
        )
        return ModelTeacher(model, folder=facts.sources["teacher_model"].folder)


class StoredTeacherSource:
    """``teacher_logits:``: top-k log-probs from kd's store or another tool's file."""

    reads: tuple[str, ...] = ()
    needs_rows = True

    def __init__(self, run: RunConfig):
        assert run.teacher_logits is not None
        self.run = run
        self.settings: TeacherLogitsSettings = run.teacher_logits
        self.reader: TeacherLogitsFile | None = None
        self.vocab: int | None = None

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        """Open the file and check it against this run: every row of the data (by hash), and for
        kd's store the teacher (when the config names one), tokenizer files, max_seq_len,
        temperature and k."""
        settings, run = self.settings, self.run
        rows = (dataset[i] for i in range(len(dataset)))
        fingerprint = stored_logits.dataset_fingerprint(
            stored_logits.row_hash(ex["tokens"], ex["labels"]) for ex in rows
        )
        if settings.format != "kd":
            source_t = settings.source_temperature
            reader = foreign_logits.ForeignLogitsReader(
                settings.path,
                format=settings.format,
                k=settings.k,
                alpha=1.0 if source_t is None else source_t / run.loss.temperature,
                max_seq_len=run.max_seq_len,
                student_vocab=facts.student_vocab,
                alignment=settings.alignment,
            )
            if reader.fingerprint != fingerprint:
                raise KDUserError(
                    f"dataset: its {len(dataset)} rows are not the {reader.num_rows} rows "
                    f"of {settings.path} (teacher_logits.path, by hash); set dataset to "
                    f"{{_component_: kd.data.pretokenized_dataset, data_files: {settings.path}}}"
                )
            self.reader = reader
            return
        store = stored_logits.TeacherLogitsReader(settings.path)
        source = facts.teacher_source
        stored_logits.check_store_matches(
            store.manifest,
            settings.path,
            tokenizer_sha256=stored_logits.files_sha256(
                models.tokenizer_files(ctx.node("tokenizer"))
            ),
            max_seq_len=run.max_seq_len,
            dataset_fingerprint=fingerprint,
            temperature=run.loss.temperature,
            k=settings.k,
            student_vocab=facts.student_vocab,
            teacher=ctx.teacher_identity(source) if source is not None else None,
        )
        # The student's KD softmax runs over the shared vocabulary, as with a teacher model.
        self.reader, self.vocab = store, int(store.manifest["vocab"])

    def load(self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None) -> FileTeacher:
        assert self.reader is not None, "check() opens the file"
        return FileTeacher(
            self.reader,
            k=self.settings.k,
            vocab=self.vocab,
            tail=self.settings.tail,
            device=ctx.device,
        )


class ServedTeacherSource:
    """``teacher_server:``: a vLLM or SGLang server answers the teacher's top-k log-probs."""

    reads: tuple[str, ...] = ()
    needs_rows = False

    def __init__(self, run: RunConfig):
        assert run.teacher_server is not None
        self.run = run
        self.settings = run.teacher_server
        self.client: TeacherClient | None = None

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        """The server answers, serves ``teacher_server.model``, gives ``top_k`` log-probs and
        decodes a probe as the student's tokenizer does (:func:`kd.teachers.served.check_server`)."""
        client = TeacherClient(self.settings, vocab=facts.student_vocab)
        check_server(client, ctx.tokenizer(), k=self.settings.top_k)
        self.client = client

    def load(self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None) -> ServedTeacher:
        assert self.client is not None, "check() reaches the server"
        s = self.settings
        return ServedTeacher(
            self.client,
            k=s.top_k,
            tail=s.tail,
            temperature=self.run.loss.temperature,
            device=ctx.device,
            concurrency=s.concurrency,
            prefetch=s.prefetch,
            ignore_index=self.run.loss.ignore_index,
        )
