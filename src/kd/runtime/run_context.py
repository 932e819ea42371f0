"""What every recipe does the same way: device, components, tokenizer, model checks and loading.

``kd run kd`` and ``kd run teacher_logits`` (and ``kd validate``, which runs the first one's
checks) share one :class:`RunContext`: the device of this rank, the one way a config key becomes a
component, the checked tokenizer, the weight-free checks of the models (:meth:`inspect_models`),
and the one way a model is built, loaded and prepared (:meth:`load_model`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from kd import checkpoint, data, models
from kd.backends import CHECKPOINTER_OF, backend_of
from kd.checkpoint import outputs
from kd.config.instantiate import build_component
from kd.config.run import RunConfig
from kd.errors import KDUserError
from kd.runtime.checkpoints import StudentSource
from kd.runtime.device import check_device, optimizer_in_cpu_problem
from kd.runtime.distributed import WorldInfo
from kd.runtime.prepare import ShardSpec, materialize, prepare_student, shard_spec

log = logging.getLogger("kd")

__all__ = ["ModelFacts", "RunContext"]


@dataclass(frozen=True)
class ModelFacts:
    """What the weight-free checks learnt of the models (meta-device builds).

    Attributes:
        student_vocab: the student's output rows (Vs).
        teacher_vocab: the teacher's (Vt), when ``teacher_model`` is set.
        tokenizer_max: the largest id the tokenizer emits.
        sources: where each model whose weights the run reads comes from, by model key.
        lora: whether the student is a LoRA model.
        teacher_source: where ``teacher_model``'s weights are (also when only identifying stored
            logits), or None without ``teacher_model``.
    """

    student_vocab: int
    teacher_vocab: int | None
    tokenizer_max: int
    sources: dict[str, models.WeightsSource]
    lora: bool
    teacher_source: models.WeightsSource | None

    @property
    def shared_vocab(self) -> int:
        """``min(Vs, Vt)`` (Vs without a teacher)."""
        return min(self.student_vocab, self.teacher_vocab or self.student_vocab)


class RunContext:
    """One rank's view of a run: its device and dtype, and the components of its config.

    Args:
        run: the typed config.
        world: this process's place in the job.
    """

    def __init__(self, run: RunConfig, world: WorldInfo):
        self.run = run
        self.world = world
        self.device = torch.device(run.device)
        if world.distributed and self.device.type == "cuda":
            self.device = torch.device("cuda", world.local_rank)
        self.dtype = models.DTYPES[run.dtype]
        self._tokenizer: Any = None
        self._ids_below: tuple[str, int] | None = None  # whose vocabulary a file's ids fit in

    def build(self, key: str, *args: Any, fix: str, **kwargs: Any) -> Any:
        """The component of config key ``key`` (allow-listed ``_component_``), called with
        ``args`` and ``kwargs`` on top of the node's own arguments."""
        node = self.run.components[key]
        return build_component(
            key, node, *args, trust=self.run.trust_remote_components, fix=fix, **kwargs
        )

    def node(self, key: str) -> dict[str, Any]:
        """Component ``key``'s plain values, for kd's functions (empty when it is absent)."""
        node = self.run.components[key]
        return OmegaConf.to_container(node, resolve=True) if node is not None else {}

    # ------------------------------------------------------------ checks (no weight read)
    def check_device(self) -> None:
        """The device exists; ``optimizer_in_cpu`` only on one CUDA device."""
        check_device(self.run.device)
        in_cpu, distributed = self.run.optimizer.in_cpu, self.world.distributed
        refused = optimizer_in_cpu_problem(in_cpu, self.device.type, distributed=distributed)
        if refused is not None:
            raise KDUserError(refused)

    def tokenizer(self) -> Any:
        """The run's tokenizer, its files checked and a test text encoded (built once)."""
        if self._tokenizer is None:
            self._tokenizer = models.checked_tokenizer(
                lambda: self.build("tokenizer", fix="check the tokenizer files and arguments"),
                models.tokenizer_files(self.node("tokenizer")),
            )
        return self._tokenizer

    def inspect_models(self, tokenizer: Any, *, read: Sequence[str]) -> ModelFacts:
        """Build the models on the meta device and check what needs no weight.

        Checked: each builder built a decoder; the tokenizer's ids against both vocabularies;
        for the models in ``read`` (whose weights the run reads), ``tokenizer.max_seq_len``
        against the model and its config.json against its safetensors headers; a Hugging Face
        teacher's own tokenizer against the run's.

        Args:
            tokenizer: the run's tokenizer (:meth:`tokenizer`).
            read: the model keys (``model``, ``teacher_model``) whose weights the run reads.

        Raises:
            KDUserError: every problem found, one line each.
        """
        with torch.device("meta"):
            student = self.build("model", fix="fix the builder's arguments")
            teacher = self.build("teacher_model", fix="fix the builder's arguments")
        built = {"model": student, "teacher_model": teacher}
        checked = {k: m if k in read else None for k, m in built.items()}
        checked["model"] = student  # the student's builder is always checked
        models.check_decoders({k: (self.node(k).get("_component_"), m) for k, m in checked.items()})
        tokenizer_max = models.tokenizer_max_id(tokenizer)
        teacher_read = "teacher_model" in read
        problems = models.check_vocab(
            tokenizer_max=tokenizer_max,
            student_vocab=models.vocab_size(student),
            teacher_vocab=models.vocab_size(teacher) if teacher_read else None,
        )
        problems += models.max_seq_len_problems(
            {k: m for k, m in built.items() if k in read}, max_seq_len=self.run.max_seq_len
        )
        sources = {}
        for key in read:
            src = sources[key] = self.weights_source(key, built[key])
            problems += checkpoint.checkpoint_config_problems(
                str(src.folder),
                src.files,
                key=src.key,
                heads=models.attention_shape(built[key]),
                folder_arg=src.field,
            )
        if problems:
            raise KDUserError("\n".join(problems))
        vocabs = [("student's", models.vocab_size(student))]
        if teacher_read:
            vocabs.append(("teacher's", models.vocab_size(teacher)))
        self._ids_below = min(vocabs, key=lambda v: v[1])
        if teacher_read:
            models.check_teacher_tokenizer(
                sources["teacher_model"],
                self.node("tokenizer"),
                teacher_vocab=models.vocab_size(teacher),
                student_vocab=models.vocab_size(student),
            )
        teacher_source = sources.get("teacher_model")
        if teacher is not None and teacher_source is None:
            teacher_source = self.weights_source("teacher_model", teacher)
        return ModelFacts(
            student_vocab=models.vocab_size(student),
            teacher_vocab=models.vocab_size(teacher) if teacher is not None else None,
            tokenizer_max=tokenizer_max,
            sources=sources,
            lora=models.is_lora(student),
            teacher_source=teacher_source,
        )

    def weights_source(self, key: str, model: nn.Module) -> models.WeightsSource:
        """Where the built model of ``key`` reads its weights from (its folder or checkpointer)."""
        return backend_of(model).weights_source(
            model, key=key, node=self.node(key), ckpt_node=self.node(CHECKPOINTER_OF[key])
        )

    def dataset(self, node: Any, tokenizer: Any, *, key: str) -> Any:
        """The dataset of config key ``key`` (``dataset``, ``validation.dataset``), checked:
        readable, non-empty, labelled, a file's own token ids inside the vocabularies
        :meth:`inspect_models` found; truncated examples are counted in a warning."""
        dataset = data.build_dataset(
            node, tokenizer, trust=self.run.trust_remote_components, key=key
        )
        truncated, checked = data.check_dataset(dataset, max_seq_len=self.run.max_seq_len, key=key)
        if self._ids_below is not None:  # rows of token ids (no tokenizer drew them)
            data.check_token_ids(dataset, vocab=self._ids_below, key=key)
        if truncated and self.world.is_rank_zero:
            log.warning(
                "%s: %d of %d examples checked reach tokenizer.max_seq_len and are truncated",
                key,
                truncated,
                checked,
            )
        return dataset

    def steps_per_epoch(self, num_rows: int, max_steps: int | None) -> int:
        """Optimizer steps per epoch over ``num_rows`` rows on this world size, at most
        ``max_steps`` (``max_steps_per_epoch``)."""
        run = self.run
        return data.steps_per_epoch(
            num_rows,
            batch_size=run.batch_size,
            world_size=self.world.world_size,
            grad_accum=run.optimizer.grad_accum,
            max_steps=max_steps,
        )

    def student_source(self, facts: ModelFacts) -> StudentSource:
        """What the student's checkpoints are written from (:class:`StudentSource`)."""
        src = facts.sources["model"]
        return StudentSource(
            model_type=src.model_type,
            source_dir=src.folder,
            lora=self.run.lora,
            backend=src.backend,
            tokenizer_files=models.tokenizer_files_to_copy(self.node("tokenizer")),
        )

    # ------------------------------------------------------------ loading
    def load_student(self, facts: ModelFacts, *, run_dir: Any) -> nn.Module:
        """The student (``model``) with its weights, prepared by
        :func:`kd.runtime.prepare.prepare_student` with the run's flags (LoRA, activation
        checkpointing and offloading, FSDP2 when distributed)."""
        ac, lora = self.run.activation_checkpointing, facts.lora
        offload = self.device.type if self.run.activation_offloading else None
        self._say_cpu_offload()
        return self.load_model(
            "model",
            facts.sources["model"],
            lambda m, shard: prepare_student(
                m,
                lora=lora,
                activation_checkpointing=ac,
                shard=shard,
                activation_offloading=offload,
            ),
            run_dir=run_dir,
        )

    def _say_cpu_offload(self) -> None:
        """On ``device: cpu`` the offload keys run their hooks but save nothing: one line each
        (docs/offloading.md)."""
        if self.device.type != "cpu" or not self.world.is_rank_zero:
            return
        said = []
        if self.run.teacher_offload != "none":
            said.append((f"teacher_offload: {self.run.teacher_offload}", "teacher_offload=none"))
        if self.run.activation_offloading:
            said.append(("enable_activation_offloading", "enable_activation_offloading=false"))
        for key, fix in said:
            log.warning(
                "%s on device cpu saves no memory (host memory is this machine's RAM, the "
                "device's own); set %s",
                key,
                fix,
            )

    def load_model(
        self,
        key: str,
        source: models.WeightsSource,
        prepare: Callable[[nn.Module, ShardSpec | None], nn.Module],
        *,
        run_dir: Any = None,
        compile: bool | None = None,
        device: torch.device | None = None,
    ) -> nn.Module:
        """The model of ``key`` with its weights (its folder's, or its checkpointer's), prepared
        by ``prepare`` (and sharded when distributed: rank 0 alone reads the files,
        :func:`kd.runtime.prepare.materialize`), compiled when ``compile`` is set.

        Args:
            key: ``model`` or ``teacher_model``.
            source: its weights (:meth:`inspect_models`).
            prepare: :func:`kd.runtime.prepare.prepare_student` or :func:`kd.runtime.prepare.prepare_teacher`
                with the recipe's flags.
            run_dir: the run's output_dir, when a torchtune checkpointer's own ``output_dir``
                must exist (``kd run kd``); None leaves it alone.
            compile: compile its layers (None: the ``compile`` key).
            device: where to build and load it on one device (None: the training device; the
                CPU for a teacher parked in host memory).
        """
        ckpt_key = CHECKPOINTER_OF[key]

        def build(device: torch.device) -> nn.Module:
            with models.default_dtype(self.dtype), device:
                return self.build(key, fix="fix the builder's arguments")

        def load(model: nn.Module) -> None:
            # Reading a large model's files takes minutes: say so before they start.
            log.info("loading %s weights from %s", key, _weights_origin(source))
            if run_dir is not None:
                outputs.make_checkpointer_output_dir(
                    self.node(ckpt_key).get("output_dir"), key=ckpt_key, run_dir=run_dir
                )
            models.load_model_weights(
                model,
                source,
                lambda: self.build(
                    ckpt_key, fix="check the checkpoint files", should_load_recipe_state=False
                ),
            )
            if key != "model":  # a student's new head may start at zero; a teacher's never does
                _refuse_zero_output(model, key, source)

        shard = (
            shard_spec(self.run.fsdp, device_type=self.device.type, param_dtype=self.dtype)
            if self.world.distributed
            else None
        )
        where = self.device if device is None else device
        model = materialize(build, load, prepare, device=where, shard=shard, world=self.world)
        if self.run.compile if compile is None else compile:
            models.compile_layers(model)
        return model


def _refuse_zero_output(model: nn.Module, key: str, source: models.WeightsSource) -> None:
    """A teacher whose output projection loaded as all zeros gives every token the same
    probability at every position (a file saved from an empty or meta-device model): its KD term
    would pull the student toward uniform, without any error.

    Raises:
        KDUserError: names the key and the folder.
    """
    weight = models.output_weight(model)
    if is_fake(weight) or weight.is_meta:
        return  # no values (the memory tracer's and the fake device's models)
    with torch.no_grad():
        zero = not bool(weight.any())
    if zero:
        raise KDUserError(
            f"{key}: the output projection loaded from {source.folder} is all zeros, so the "
            "teacher would give every token the same probability; the weights file is damaged "
            "(saved from an empty model?): export or download it again"
        )


def _weights_origin(source: models.WeightsSource) -> str:
    """The folder a model's weights are read from, and their size when the files are listed."""
    names = source.files if isinstance(source.files, list | tuple) else []
    size = 0
    for name in names:
        with contextlib.suppress(OSError, TypeError):
            size += (source.folder / str(name)).stat().st_size
    return f"{source.folder} ({size / 2**30:.2f} GiB)" if size else str(source.folder)
