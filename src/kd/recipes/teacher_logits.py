"""Precompute the teacher's top-k log-probs once, for training without the teacher in memory.

Run it (the same config as the KD run; the store goes under ``teacher_logits.path``):

    kd run teacher_logits --config my.yaml teacher_logits.path=/data/logits_k64
    kd run --nproc_per_node 4 teacher_logits --config my.yaml teacher_logits.path=/data/logits_k64
    kd run kd --config my.yaml teacher_logits.path=/data/logits_k64     # then train from it

Features (each knob is a config key; defaults live in kd/config/schema.py):
    - The rows are the training ``dataset`` exactly as ``kd run kd`` tokenizes them (the same
      builder, the same ``tokenizer.max_seq_len`` truncation), run through the teacher in padded
      batches of ``batch_size``; the log-softmax and top-k cover the labelled positions only.
    - ``teacher_logits.k`` (1..4096, default 64): entries per labelled position; disk grows with
      k (ids int32 + log-probs float16: 6 bytes each). Training may use any k up to the stored.
    - ``temperature``: the stored values are ``log_softmax(z_t / T)``; training with another T is
      refused (recompute).
    - ``teacher_logits.rows_per_shard``: rows per Parquet shard (the unit of resume).
    - The student's weights are never read (its config gives the vocabulary ``min(Vs, Vt)``).
    - ``teacher_server:`` in place of ``teacher_model``: a vLLM or SGLang server answers the
      top-``teacher_logits.k`` log-probs (:mod:`kd.teachers.served`; temperature 1, ids in the
      student's vocabulary); the store is the same, and ``kd run kd`` with the same config then
      trains from it without asking the server again.
    - ``cross_tokenizer:`` (a ``kd.hf`` teacher with its own tokenizer): the teacher runs on its
      own tokens of each row's text and the store keeps, per labelled teacher token, its id,
      character span and own log-prob, and the top-k over the teacher's vocabulary in float32
      (:mod:`kd.teachers.cross_stored`; format version 2), so ``kd run kd`` with the same
      config aligns and takes GOLD's loss without the teacher.
    - Under torchrun rank r takes rows r, r + W, ... and writes its own shards; the teacher is
      sharded with FSDP2 as in ``kd run kd``.
    - Atomic and resumable (:mod:`kd.teachers.store_writer`): a killed run rerun with the same
      config skips complete shards and writes byte-identical files; a folder holding the store
      of another config is refused.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from kd import _torchtune as tt
from kd import data
from kd.config.run import RunConfig, run_config
from kd.errors import KDUserError
from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo
from kd.runtime.prepare import prepare_teacher
from kd.runtime.run_context import RunContext
from kd.teachers import ModelTeacher, TeacherInput, store_folder, store_format, store_writer
from kd.teachers.cross import CrossTokenizerSource, CrossTokenizerTeacher
from kd.teachers.cross_stored import cross_spec
from kd.teachers.served import ServedTeacher, TeacherClient, check_server, probe_client

log = logging.getLogger("kd")

KEY = "teacher_logits.path"


class TeacherLogitsRecipe:
    """Run the teacher over the training data once and store its top-k log-probs.

    Phases: :meth:`preload` (checks, no weight, nothing written), :meth:`load` (the teacher),
    :meth:`compute` (the shards this rank still lacks, then rank 0's manifest).
    """

    def __init__(self, run: RunConfig, *, world: WorldInfo):
        self.run = run
        self.world = world
        self.ctx = RunContext(run, world)
        self.device = self.ctx.device
        settings = run.teacher_logits
        if settings is None:
            raise KDUserError(
                "teacher_logits: null; set teacher_logits.path=DIR, the folder the teacher's "
                "top-k log-probs are written to"
            )
        if run.components["teacher_model"] is None and run.teacher_server is None:
            raise KDUserError(
                "teacher_model: null, but kd run teacher_logits runs the teacher; set "
                "teacher_model (and its checkpointer) to the teacher of the KD run"
            )
        if run.teacher_server is not None and run.loss.temperature != 1.0:
            raise KDUserError(
                f"temperature: {run.loss.temperature:g}, but a teacher_server answers at "
                "temperature 1 and the store holds the full distribution's top-k at the run's "
                "temperature; set temperature=1, or use teacher_model for this store"
            )
        if settings.format != "kd":
            raise KDUserError(
                f"teacher_logits.format: {settings.format} names another tool's file, which kd "
                "run teacher_logits does not write; set teacher_logits.format=kd (kd run kd "
                "reads the axolotl or distillkit file as it is)"
            )
        self.settings = settings
        self.folder = settings.path
        self.lock: Path | None = None

    # ------------------------------------------------------------ 1. before any weight
    def preload(self) -> None:
        """Every check that needs no weight: device, tokenizer, both models' shapes (meta), the
        teacher's files, k against the vocabulary, the data (every row is read and hashed), and
        the folder (empty, or a store of this very config to resume)."""
        run, ctx = self.run, self.ctx
        ctx.check_device()
        self.tokenizer = ctx.tokenizer()
        # The student's weights are never read: its config gives the vocabulary min(Vs, Vt).
        served = run.teacher_server
        # A cross-tokenizer teacher's tokenizer differs: it is checked by its source instead.
        self.cross = CrossTokenizerSource(run) if run.cross_tokenizer is not None else None
        own = served is not None or self.cross is not None
        facts = ctx.inspect_models(self.tokenizer, read=() if own else ("teacher_model",))
        self.facts = facts
        self.dataset = ctx.dataset(run.components["dataset"], self.tokenizer, key="dataset")
        if self.cross is not None:
            self.cross.check(ctx, facts, self.dataset)
        # The teacher's distribution: its own vocabulary across tokenizers, else the shared.
        vocab = self.cross.teacher_size if self.cross is not None else facts.shared_vocab
        if self.settings.k > vocab:
            what = "teacher's own" if self.cross is not None else "shared"
            raise KDUserError(
                f"teacher_logits.k: {self.settings.k} is more than the {vocab} {what} "
                f"vocabulary entries; set teacher_logits.k to {vocab} or less"
            )
        self.hashes = [
            store_format.row_hash(ex["tokens"], ex["labels"])
            for ex in (self.dataset[i] for i in range(len(self.dataset)))
        ]
        self.client: TeacherClient | None = None
        if served is not None:
            probe = probe_client(served, vocab=facts.student_vocab)  # short: seconds if down
            check_server(probe, self.tokenizer, k=self.settings.k)
            self.client = TeacherClient(served, vocab=facts.student_vocab)
        self.spec = store_folder.store_spec(
            run,
            ctx,
            facts,
            k=self.settings.k,
            hashes=self.hashes,
            world_size=self.world.world_size,
            rows_per_shard=self.settings.rows_per_shard,
        )
        if self.cross is not None:
            folder = Path(str(ctx.node("teacher_model")["path"])).expanduser()
            self.spec = cross_spec(self.spec, self.cross, folder)
        self.manifest = store_folder.check_store_folder(self.folder, self.spec, key=KEY)
        self.todo, self.done = self._todo()

    # ------------------------------------------------------------ 2. the teacher
    def load(self) -> None:
        """The folder, started; the teacher, loaded and prepared (sharded under torchrun),
        unless every rank's shards are complete."""
        distributed.barrier()
        if self.world.is_rank_zero:
            self.lock = store_folder.start_store_folder(
                self.folder, self.spec, self.manifest, key=KEY
            )
        bs = self.run.batch_size
        self.batches = [
            (name, rows[i : i + bs]) for name, rows in self.todo for i in range(0, len(rows), bs)
        ]
        counts = torch.zeros(self.world.world_size, dtype=torch.int64, device=self.device)
        counts[self.world.rank] = len(self.batches)
        # Every rank runs as many teacher forwards as the busiest one (FSDP2 collectives).
        self.steps = int(distributed.all_reduce_sum(counts).max())
        self.teacher: ModelTeacher | ServedTeacher | CrossTokenizerTeacher | None = None
        if self.steps == 0:
            return
        if self.cross is not None:
            self.teacher = self.cross.load(self.ctx, self.facts, compile=False)
            return
        if self.client is not None:
            served = self.run.teacher_server
            assert served is not None
            self.teacher = ServedTeacher(
                self.client,
                k=self.spec.k,
                tail="bucket",
                temperature=1.0,
                device=torch.device("cpu"),
                concurrency=served.concurrency,
                prefetch=0,
            )
            return
        # The precompute's teacher is the KD run's teacher (not compiled: one pass over the data).
        model = self.ctx.load_model(
            "teacher_model",
            self.facts.sources["teacher_model"],
            lambda m, shard: prepare_teacher(m, shard=shard),
            compile=False,
        )
        self.teacher = ModelTeacher(model)

    # ------------------------------------------------------------ 3. the shards
    def _todo(self) -> tuple[list[tuple[str, list[int]]], int]:
        """This rank's shards that are not in place and whole yet, and how many are."""
        entries = {e["name"]: e for e in (self.manifest or {}).get("shards", [])}
        layout = store_format.rank_shards(
            len(self.dataset),
            world_size=self.world.world_size,
            rank=self.world.rank,
            rows_per_shard=self.settings.rows_per_shard,
        )
        todo = [
            (name, rows)
            for name, rows in layout
            if not store_writer.shard_done(self.folder / name, rows, entries.get(name))
        ]
        return todo, len(layout) - len(todo)

    def compute(self) -> None:
        """Write this rank's missing shards, then (rank 0) the complete manifest.

        Under FSDP2 every rank runs the same number of teacher forwards: a rank with fewer
        batches left runs fillers (its first row) and writes nothing for them.
        """
        batches, steps = self.batches, self.steps
        if self.done and self.world.is_rank_zero:
            log.info("teacher_logits: %d shard(s) already complete in %s", self.done, self.folder)
        pending: dict[str, list[tuple[Any, ...]]] = {}
        shard_rows = dict(self.todo)
        collate = functools.partial(
            tt.padded_collate_sft, padding_idx=data.pad_id_of(self.tokenizer), ignore_idx=-100
        )
        filler = [self.world.rank]
        bar = tqdm(
            range(steps),
            disable=None if self.world.is_rank_zero else True,  # None: off unless a terminal
            desc="teacher_logits",
        )
        # Without the bar (a log file, a batch job) each shard written says how far it is.
        say = bar.disable and self.world.is_rank_zero
        total, done, start = sum(len(r) for r in shard_rows.values()), 0, time.monotonic()
        for i in bar:
            name, rows = batches[i] if i < len(batches) else (None, filler)
            results = self._forward(rows, collate)
            if name is None:
                continue
            pending.setdefault(name, []).extend(results)
            if len(pending[name]) == len(shard_rows[name]):
                self._write(name, shard_rows[name], pending.pop(name))
                done += len(shard_rows[name])
                if say:
                    log.info(
                        "teacher_logits: wrote %s, %d of %d rows (%.0f%%) in %.0f s",
                        name,
                        done,
                        total,
                        100 * done / total,
                        time.monotonic() - start,
                    )
        distributed.barrier()
        if self.world.is_rank_zero:
            store_writer.complete_manifest(self.folder, self.spec)
            log.info(
                "teacher_logits: %d rows, top-%d log-probs (T=%g) in %s",
                self.spec.num_rows,
                self.spec.k,
                self.spec.temperature,
                self.folder,
            )

    @torch.no_grad()
    def _forward(self, rows: list[int], collate: Any) -> list[tuple[Any, ...]]:
        """The teacher's top-k at the labelled positions of ``rows``: per row ``(num_tokens, ids
        [n_labelled * k] int32, logprobs [n_labelled * k] float16)``, a cross-tokenizer
        teacher's with float32 log-probs and its columns (:meth:`CrossTokenizerTeacher.store_rows`)."""
        examples = [self.dataset[r] for r in rows]
        batch = collate(examples)
        if isinstance(self.teacher, ServedTeacher):
            return self._served(examples, batch)
        if isinstance(self.teacher, CrossTokenizerTeacher):
            made = self.teacher.store_rows(
                TeacherInput(batch["tokens"].to(self.device), labels=batch["labels"], rows=rows),
                k=self.spec.k,
                temperature=self.spec.temperature,
                chunk=self.run.loss.chunk_size,
            )
            return [(len(ex["tokens"]), *r) for ex, r in zip(examples, made, strict=True)]
        assert self.teacher is not None
        signal = self.teacher.signal(TeacherInput(batch["tokens"].to(self.device)))
        spec, chunk = self.spec, self.run.loss.chunk_size
        out = []
        for b, ex in enumerate(examples):
            n = len(ex["tokens"])
            positions = store_format.labelled_positions(batch["labels"][b, :n]).to(self.device)
            h = signal.hidden[b, positions]  # [n_labelled, d]
            ids, lps = [], []
            for start in range(0, h.size(0), chunk):
                logits = signal.logits(h[start : start + chunk])
                i, lp = store_format.topk_logprobs(
                    logits, vocab=spec.vocab, temperature=spec.temperature, k=spec.k
                )
                ids.append(i.cpu())
                lps.append(lp.cpu())
            flat_ids = torch.cat(ids).flatten() if ids else torch.zeros(0, dtype=torch.int32)
            flat_lps = torch.cat(lps).flatten() if lps else torch.zeros(0, dtype=torch.float16)
            out.append((n, flat_ids.numpy(), flat_lps.numpy()))
        self.teacher.release()
        return out

    def _served(
        self, examples: list[dict[str, Any]], batch: dict[str, torch.Tensor]
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """:meth:`_forward` with a served teacher: its top-k at the labelled positions."""
        assert self.teacher is not None
        signal = self.teacher.signal(TeacherInput(batch["tokens"], labels=batch["labels"]))
        out = []
        for b, ex in enumerate(examples):
            n = len(ex["tokens"])
            ids, lps = store_folder.row_entries(
                batch["labels"][b, :n], signal.ids[b], signal.logprobs[b]
            )
            out.append((n, ids, lps))
        return out

    def _write(self, name: str, rows: list[int], results: list[tuple[Any, ...]]) -> None:
        store_writer.write_shard(
            self.folder / name,
            rows=rows,
            hashes=[self.hashes[r] for r in rows],
            num_tokens=[r[0] for r in results],
            ids=[r[1] for r in results],
            logprobs=[r[2] for r in results],
            k=self.spec.k,
            vocab=self.spec.vocab,
            teacher=[r[3] for r in results] if self.cross is not None else None,
        )


def recipe_main(cfg: DictConfig) -> None:
    """Entry point of ``kd run teacher_logits`` (and of torchrun): preload, load, compute."""
    run = run_config(cfg)
    world = distributed.init_distributed(torch.device(run.device).type)
    recipe: TeacherLogitsRecipe | None = None
    try:
        recipe = TeacherLogitsRecipe(run, world=world)
        recipe.preload()
        recipe.load()
        recipe.compute()
    finally:
        if recipe is not None and recipe.lock is not None:
            store_writer.release_lock(recipe.lock)
        distributed.destroy()


if __name__ == "__main__":
    from kd.runtime.launch import run_recipe

    sys.exit(run_recipe(recipe_main))
