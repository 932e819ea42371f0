"""The one place a config's teacher is chosen, and each kind's lifecycle before it teaches.

:func:`teacher_source` asks the teacher-kind registry (:mod:`kd.config.teacher_kinds`) which kind
the config names, and that kind builds its source: the sources here (a local model, kd's store or
another tool's file, a served teacher, the student itself), or another module's (several
teachers, a teacher with another tokenizer); None: plain fine-tuning.

A source has the recipe's phases: :meth:`TeacherSource.check` runs every weight-free check
(``kd validate`` and ``kd run`` before any weight loads), :meth:`TeacherSource.load` returns the
:class:`kd.teachers.Teacher`. A new kind of teacher is its kind module in :mod:`kd.config.teacher_kinds`, its
source and its teacher; the recipe does not change (``docs/teachers.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kd import data, models
from kd.config import teacher_kinds
from kd.config.run import RunConfig
from kd.config.teacher_kinds.model import torchrun_problem
from kd.config.teacher_kinds.store import TeacherLogitsSettings
from kd.errors import KDUserError
from kd.runtime.prepare import prepare_teacher
from kd.runtime.run_context import ModelFacts, RunContext
from kd.teachers import foreign_store, store_folder, store_format, store_manifest, store_reader
from kd.teachers.base import Teacher
from kd.teachers.files import StoreFile, StoreTeacher
from kd.teachers.hidden_states import HiddenStateTeacher, check_layer_map
from kd.teachers.model import ModelTeacher
from kd.teachers.parking import ParkedWeights
from kd.teachers.placement import HeadOnStudentDevice, check_teacher_device, same_device
from kd.teachers.privileged import PrivilegedRows
from kd.teachers.quantize import quantize_int8
from kd.teachers.self_teacher import SelfTeacher
from kd.teachers.served import ServedTeacher, TeacherClient, check_server, probe_client

log = logging.getLogger("kd")

_STORE = "teacher_server.store"

__all__ = [
    "ModelTeacherSource",
    "SelfTeacherSource",
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
        route_field: the data field batches carry as :attr:`kd.teachers.TeacherInput.route`
            (several teachers routed by a field), or None.
    """

    reads: tuple[str, ...]
    needs_rows: bool
    route_field: str | None

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        """Every check that needs no weight, against the run's models and training data."""
        ...

    def load(self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None) -> Teacher:
        """The teacher, ready (collective when distributed)."""
        ...


NOT_ASKED = (
    "kd_ratio is 0 and the teacher samples nothing (on_policy.seq_kd): the run trains on CE "
    "alone and loads no teacher (no kd_loss); set kd_ratio above 0 to distil"
)


def teacher_source(run: RunConfig) -> TeacherSource | None:
    """The run's teacher source: the source of the kind the registry selects
    (:func:`kd.config.teacher_kinds.selected`), or None without a teacher (plain fine-tuning),
    and None when the run asks its teacher nothing (:func:`kd.config.teacher_kinds.in_use`:
    ``kd_ratio: 0`` and no ``seq_kd``), said once on the ``kd`` logger.

    Raises:
        KDUserError: the kind refuses this run (``TeacherKind.refuse``).
    """
    if teacher_kinds.selected(run) is not None and teacher_kinds.in_use(run) is None:
        teacher_kinds.refuse(run)
        log.info(NOT_ASKED)
        return None
    return _source_of(run)


def _source_of(run: RunConfig) -> TeacherSource | None:
    """The source of the kind the registry selects for ``run`` (a whole run, or a member of
    ``teachers:``, built when the whole is), or None."""
    teacher_kinds.refuse(run)
    kind = teacher_kinds.selected(run)
    if kind is None:
        return None
    source = kind.source
    if callable(source) and not isinstance(source, type):
        source = source(run)  # a function of the run choosing the reference
    cls = teacher_kinds.resolve(source)
    # A kind holding one-teacher configs (teachers:' members) builds them with this function.
    return cls(run, _source_of) if kind.nested is not None else cls(run)


class ModelTeacherSource:
    """``teacher_model`` (+ ``teacher_checkpointer`` for a torchtune builder): a local model,
    its decoder-layer linears quantized to int8 when ``quantization`` is ``int8``
    (``teacher_quantization``, :mod:`kd.teachers.quantize`)."""

    reads = ("teacher_model",)
    needs_rows = False
    route_field: str | None = None

    def __init__(self, run: RunConfig | None = None):
        self.run = run
        self.hidden_states = run.hidden_states if run is not None else None
        self.quantization: str = run.teacher_quantization if run is not None else "none"
        self.offload: str = run.teacher_offload if run is not None else "none"
        self.device_name: str | None = run.teacher_device if run is not None else None

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        # Its shapes, files and tokenizer were checked with the student's
        # (RunContext.inspect_models reads every key of ``reads``); a hidden-state map is
        # checked against both models' layer counts (config.json).
        if self.hidden_states is not None:
            check_layer_map(self.hidden_states, facts)
        problem = torchrun_problem(self.run) if self.run is not None else None
        if problem is not None and ctx.world.distributed:
            raise KDUserError(problem)
        if self.device_name is not None:  # before any weight is read
            check_teacher_device(self.device_name, distributed=ctx.world.distributed)

    def load(self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None) -> Teacher:
        def prepare(model: Any, shard: Any) -> Any:
            model = prepare_teacher(model, shard=shard)
            return quantize_int8(model) if self.quantization == "int8" else model

        parked = self.offload != "none"
        where = None
        if self.device_name is not None:  # teacher_device
            where = check_teacher_device(self.device_name, distributed=ctx.world.distributed)
        # A parked teacher is read into host memory; only its output projection goes to the device.
        model = ctx.load_model(
            "teacher_model",
            facts.sources["teacher_model"],
            prepare,
            run_dir=run_dir,
            device=torch.device("cpu") if parked else where,
        )
        own_device = where is not None and not same_device(where, ctx.device)
        if own_device:
            HeadOnStudentDevice(model, ctx.device)
        teacher = ModelTeacher(
            model,
            folder=facts.sources["teacher_model"].folder,
            parked=ParkedWeights(model, ctx.device, mode=self.offload) if parked else None,
            signal_device=ctx.device if own_device else None,
        )
        if self.hidden_states is not None:
            return HiddenStateTeacher(teacher, self.hidden_states)
        return teacher


class StoredTeacherSource:
    """``teacher_logits:``: top-k log-probs from kd's store or another tool's file."""

    reads: tuple[str, ...] = ()
    needs_rows = True
    route_field: str | None = None

    def __init__(self, run: RunConfig):
        assert run.teacher_logits is not None
        self.run = run
        self.settings: TeacherLogitsSettings = run.teacher_logits
        self.reader: StoreFile | None = None
        self.vocab: int | None = None

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        """Open the file and check it against this run: every row of the data (by hash), and for
        kd's store the teacher (when the config names one), tokenizer files, max_seq_len,
        temperature and k."""
        settings, run = self.settings, self.run
        rows = (dataset[i] for i in range(len(dataset)))
        fingerprint = store_format.dataset_fingerprint(
            store_format.row_hash(ex["tokens"], ex["labels"]) for ex in rows
        )
        if settings.format != "kd":
            source_t = settings.source_temperature
            reader = foreign_store.ForeignStoreReader(
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
        store = store_reader.open_run_store(
            ctx,
            facts,
            run,
            path=settings.path,
            k=settings.k,
            dataset_fingerprint=fingerprint,
            student_vocab=facts.student_vocab,
        )
        # The student's KD softmax runs over the shared vocabulary, as with a teacher model.
        self.reader, self.vocab = store, int(store.manifest["vocab"])

    def load(self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None) -> StoreTeacher:
        assert self.reader is not None, "check() opens the file"
        return StoreTeacher(
            self.reader,
            k=self.settings.k,
            vocab=self.vocab,
            tail=self.settings.tail,
            device=ctx.device,
        )


class ServedTeacherSource:
    """``teacher_server:``: a vLLM or SGLang server answers the teacher's top-k log-probs.

    With ``teacher_server.store`` every answer is also kept in kd's store (write-through,
    :class:`kd.teachers.store_folder.WriteThroughStore`); a store already complete answers the
    whole run and the server is not asked (nor needed).
    """

    reads: tuple[str, ...] = ()
    needs_rows = False
    route_field: str | None = None

    def __init__(self, run: RunConfig):
        assert run.teacher_server is not None
        self.run = run
        self.settings = run.teacher_server
        self.client: TeacherClient | None = None
        self.needs_rows = self.settings.store is not None  # the store is indexed by row
        self.spec: store_manifest.StoreSpec | None = None
        self.manifest: dict[str, Any] | None = None
        self.hashes: list[str] = []
        self.lengths: list[int] = []

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        """The store (write-through), then the server unless the store is complete: it answers,
        serves ``teacher_server.model``, gives ``top_k`` log-probs and decodes a probe as the
        student's tokenizer does (:func:`kd.teachers.served.check_server`)."""
        if self.settings.store is not None:
            self._check_store(ctx, facts, dataset)
            if self.manifest is not None and self.manifest.get("complete"):
                log.info(
                    "%s: %s is complete; the run reads it and does not ask the server",
                    _STORE,
                    self.settings.store,
                )
                return
        probe = probe_client(self.settings, vocab=facts.student_vocab)  # short: seconds if down
        check_server(probe, ctx.tokenizer(), k=self.settings.top_k)
        self.client = TeacherClient(self.settings, vocab=facts.student_vocab)

    def _check_store(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        run, store = self.run, self.settings.store
        assert store is not None
        if ctx.world.world_size > 1:
            raise KDUserError(
                f"{_STORE}: write-through runs on one process, this run has "
                f"{ctx.world.world_size}; fill the store first with kd run --nproc_per_node "
                f"{ctx.world.world_size} teacher_logits --config <this config> "
                f"teacher_logits.path={store} teacher_logits.k={self.settings.top_k}, then "
                f"train with teacher_logits.path={store}"
            )
        if run.loss.temperature != 1.0:
            raise KDUserError(
                f"{_STORE}: temperature is {run.loss.temperature:g}, but a store keeps the "
                "server's answers at temperature 1; set temperature=1, or "
                f"{_STORE}=null"
            )
        rows = [dataset[i] for i in range(len(dataset))]
        self.hashes = [store_format.row_hash(ex["tokens"], ex["labels"]) for ex in rows]
        self.lengths = [len(ex["tokens"]) for ex in rows]
        self.spec = store_folder.store_spec(
            run,
            ctx,
            facts,
            k=self.settings.top_k,
            hashes=self.hashes,
            world_size=1,
            rows_per_shard=self.settings.store_rows_per_shard,
        )
        self.manifest = store_folder.check_store_folder(store, self.spec, key=_STORE)

    def load(
        self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None
    ) -> ServedTeacher | StoreTeacher:
        s = self.settings
        store: store_folder.WriteThroughStore | None = None
        if s.store is not None:
            assert self.spec is not None, "check() opens the store"
            if self.manifest is not None and self.manifest.get("complete"):
                reader = store_reader.StoreReader(s.store, key=_STORE)
                return StoreTeacher(reader, k=s.top_k, vocab=None, tail=s.tail, device=ctx.device)
            lock = store_folder.start_store_folder(s.store, self.spec, self.manifest, key=_STORE)
            store = store_folder.WriteThroughStore(
                s.store, self.spec, self.hashes, key=_STORE, lock=lock
            )
        assert self.client is not None, "check() reaches the server"
        return ServedTeacher(
            self.client,
            k=s.top_k,
            tail=s.tail,
            temperature=self.run.loss.temperature,
            device=ctx.device,
            concurrency=s.concurrency,
            prefetch=s.prefetch,
            ignore_index=self.run.loss.ignore_index,
            store=store,
            lengths=self.lengths,
        )


class SelfTeacherSource:
    """``self_teacher:``: the student is its own teacher, seeing each row with a privileged
    context (:mod:`kd.teachers.self_teacher`). No teacher weights are read for a LoRA student
    or ``weights: live``; a full fine-tune with ``weights: initial`` loads a frozen copy of the
    student's initial weights."""

    reads: tuple[str, ...] = ()
    needs_rows = True
    route_field: str | None = None

    def __init__(self, run: RunConfig):
        assert run.self_teacher is not None
        self.run = run
        self.settings = run.self_teacher
        self.rows: PrivilegedRows | None = None

    def check(self, ctx: RunContext, facts: ModelFacts, dataset: Sequence[Any]) -> None:
        """Render every row with its context: a missing field (row number), a template that does
        not render, a teacher input over ``tokenizer.max_seq_len`` (row number) or a completion
        the context changes are one line; logs the longest teacher input."""
        tokenizer = ctx.tokenizer()
        rows = PrivilegedRows(
            dataset, tokenizer, self.settings, header=models.assistant_header(tokenizer)
        )
        on_policy = self.run.on_policy
        longest, row = rows.check(
            max_seq_len=self.run.max_seq_len,
            new_tokens=on_policy.max_new_tokens if on_policy is not None else None,
        )
        if ctx.world.is_rank_zero:
            log.info(
                "self_teacher: the longest teacher input (prompt + context + completion) is %d "
                "tokens (row %d of %d)%s",
                longest,
                row,
                len(dataset),
                ""
                if self.run.max_seq_len is None
                else f", within tokenizer.max_seq_len {self.run.max_seq_len}",
            )
        self.rows = rows

    def load(self, ctx: RunContext, facts: ModelFacts, *, run_dir: Any = None) -> SelfTeacher:
        assert self.rows is not None, "check() renders the rows"
        initial = self.settings.weights == "initial"
        pad_id = data.pad_id_of(ctx.tokenizer())
        if facts.lora or not initial:
            # The student itself (bind_student), with its adapters off for the initial weights.
            return SelfTeacher(self.rows, pad_id=pad_id, adapters_off=facts.lora and initial)
        source = facts.sources["model"]
        copy = ctx.load_model(
            "model", source, lambda m, shard: prepare_teacher(m, shard=shard), run_dir=run_dir
        )
        return SelfTeacher(self.rows, pad_id=pad_id, model=copy, folder=source.folder)
