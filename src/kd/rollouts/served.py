"""The served sampler (``on_policy.sampler: served``): a vLLM or SGLang server samples the
student's completions, and kd pushes the student's weights to it every
``on_policy.sync_every_n_steps`` optimizer steps.

Rollouts are token ids in and out, never text (:mod:`kd.rollouts.served_protocols`): one request
per prompt, ``on_policy.server_concurrency`` in flight, each with ``max_tokens`` =
``on_policy.max_new_tokens``, the run's temperature and top-p, the tokenizer's stop ids and a
seed derived from ``(seed, epoch, row)`` as the local sampler's generator is, so a row samples
the same tokens in a resumed run. A logit bias of -100 keeps the ids no tokenizer has (a model's
padded rows) out, as the local sampler's vocabulary limit does.

Weights (:meth:`ServedSampler.after_step`, and once before the first rollout): the student's
weights after optimizer step ``s`` are weight *version* ``s`` (0: the loaded weights). A push
writes them as kd's checkpoint folders hold the student (:meth:`kd.backends.base.Backend.export_student`:
an HF folder, a LoRA student's PEFT adapter in ``adapter/``) into
``<sync_dir>/v<version>/``: written in a temporary folder, its marker written last, renamed into
place (a kill leaves the old folders and a ``.tmp_*`` that the next start removes). Then the
server takes it: a LoRA student's adapter is hot-loaded under a name of its own per version
(vLLM ``/v1/load_lora_adapter``, SGLang ``/load_lora_adapter``; the previous one unloaded), a full
student's folder reloaded in place (vLLM ``/collective_rpc`` ``update_config`` +
``reload_weights``; SGLang ``/update_weights_from_disk`` with ``weight_version``). Every
:class:`~kd.rollouts.base.Completions` carries the version it was sampled with; the server's own
word is checked where it gives one (vLLM answers with the adapter's name, SGLang with its
``weight_version``).

Sleep (``on_policy.server_sleep``, vLLM): after each step's rollouts (:meth:`ServedSampler.idle`)
the server sleeps while the step trains: level 2 (weights and KV cache dropped) when the push
after the step reloads the weights anyway, level 1 (weights to CPU memory) otherwise. kd frees
its own cached device memory (``torch.cuda.empty_cache``) before it wakes the server: for a push,
the weights' memory first, then the reload, then the KV cache (vLLM's RLHF order); before a
rollout, everything. One GPU is shared in time: the step trains with the server's memory free.

Resume: the state is the version being sampled; the resumed run pushes that version's folder
again (kept while a step checkpoint may need it), so the rollouts after a resume are those of a
run never stopped; a folder that is gone is replaced by the checkpoint's own weights (said in one
line). Under torchrun rank 0 writes and pushes (the gather of a sharded student is collective),
every rank samples its own rows and the ranks agree on every failure, so they stop together.

A server that stays down, refuses a request or answers something malformed raises
:class:`~kd.rollouts.base.RolloutStopped` (one line naming the key and the fix): the recipe saves
a step checkpoint and stops with exit status 2; resuming repeats the step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kd.config.on_policy_settings import OnPolicySettings
from kd.errors import KDUserError, brief, one_line
from kd.fileio import fsync_path
from kd.rollouts.base import Completions, Prompts, RolloutStopped
from kd.rollouts.served_check import (
    SampleCheck,
    load_lora,
    model_gap,
    push_refused,
    retry_aborted,
    weights_lost,
)
from kd.rollouts.served_client import PROBE_TIMEOUT_S, ServerClient, ServerUnavailable
from kd.rollouts.served_probe import check_server
from kd.rollouts.served_protocols import GEN_PROTOCOLS, BadAnswer, Sample, VLLMGeneration
from kd.rollouts.served_student import exporter_of, scorer_of
from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo

__all__ = [
    "SYNC_DIRNAME",
    "ServedSampler",
    "ServerUnavailable",
    "SyncSettings",
    "served_sampler",
    "version_dir",
]

log = logging.getLogger("kd")

SYNC_DIRNAME = "served_weights"  # <output_dir>/served_weights/ unless on_policy.server_sync_dir
_MARKER = "kd_weights.json"  # written last: a version folder without it is incomplete
_TMP = ".tmp_"
_VERSION_RE = re.compile(r"^v(\d+)$")
_STEP_RE = re.compile(r"^step_(\d+)$")
_KEY = "on_policy"


def version_dir(sync_dir: Path, version: int) -> Path:
    """``<sync_dir>/v000012`` for weight version 12."""
    return Path(sync_dir) / f"v{version:06d}"


@dataclass(frozen=True)
class SyncSettings:
    """What the sampler needs besides ``on_policy:``.

    Attributes:
        output_dir: the run's folder (step checkpoints, and the default sync folder).
        exporter: ``(folder, student) -> None`` writes the student as the server loads it (a
            LoRA student: its adapter alone, in ``adapter/``) into an existing folder (None on
            ranks other than 0);
            collective when distributed (it gathers a sharded student; rank 0 writes).
        lora_rank: a LoRA student's rank (``model.lora_rank``; None: a full student, whose
            whole weights are pushed; :attr:`lora` says which).
        scorer: ``(student, ids [n]) -> [n - 1]`` the student's top-1 log-prob at each next
            position (:func:`scorer_of`; collective when distributed); None: the model check is
            skipped.
        seed: the run's seed (row ``r`` of epoch ``e`` asks with seed ``(seed, e, r)``).
        pad_id: the id written after a completion's end.
        stop_ids: ids that end a completion (the tokenizer's).
        vocab_limit: ids from here on are never sampled (every model's and the tokenizer's).
        vocab: the student's vocabulary (its output rows).
        max_seq_len: ``tokenizer.max_seq_len``: prompt + completion never exceed it.
        world: this process's place in the job.
    """

    output_dir: Path
    exporter: Callable[[Path | None, nn.Module], None] | None
    lora_rank: int | None
    seed: int
    pad_id: int
    stop_ids: tuple[int, ...]
    vocab_limit: int
    vocab: int
    max_seq_len: int | None
    world: WorldInfo
    scorer: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    @property
    def lora(self) -> bool:
        """Whether the student is a LoRA student (its adapter is pushed, not whole weights)."""
        return self.lora_rank is not None


def _short(text: str, limit: int = 200) -> str:
    return one_line(text[:limit])


class ServedSampler:
    """The student's completions from a vLLM or SGLang server, its weights pushed by kd.

    Args:
        settings: ``on_policy:`` (``sampler: served``, ``server_*``, ``sync_every_n_steps``).
        sync: what else the sampler needs (:class:`SyncSettings`).
        device: where the completions go (the training device).

    Attributes:
        kind: ``served``.
        version: the weight version the server samples with now (-1: nothing pushed yet).
    """

    kind = "served"

    def __init__(self, settings: OnPolicySettings, sync: SyncSettings, *, device: torch.device):
        if settings.server_url is None or settings.server_model is None:
            missing = "server_url" if settings.server_url is None else "server_model"
            raise KDUserError(
                f"{_KEY}.{missing}: on_policy.sampler is served, which needs the server's "
                f"{'base URL' if missing == 'server_url' else 'served model name'}; set "
                f"{_KEY}.{missing}, or on_policy.sampler=local"
            )
        self.settings = settings
        self.sync = sync
        self.device = device
        self.protocol = GEN_PROTOCOLS[settings.server_api]
        self.client = ServerClient(settings)
        self.version = -1
        self.adapter: str | None = None  # the loaded adapter's name (LoRA)
        self._resume_version: int | None = None
        self._failure: RolloutStopped | None = None  # a push that failed after a step
        self._due = -1  # the version that push was for
        self._raised = False  # whether a rollout raised it (the run's error line said it)
        self._pushed_once = False
        # The server's sleep level (server_sleep): 0 awake, 1 weights in CPU memory, 2 weights
        # dropped. Unknown at the start (a killed run may have left it asleep): treated as 2, so
        # the first push wakes it in order (waking an awake tag is a no-op).
        self._asleep = 2 if settings.server_sleep else 0
        self._model_checked = False
        self._check = SampleCheck(settings, sync.vocab_limit, sync.stop_ids)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.sync_dir = (
            Path(settings.server_sync_dir)
            if settings.server_sync_dir is not None
            else sync.output_dir / SYNC_DIRNAME
        )
        tag = hashlib.sha1(str(sync.output_dir.resolve()).encode()).hexdigest()[:8]
        self._adapter_prefix = f"kd-{tag}-v"

    # ------------------------------------------------------------ before training
    def check(self) -> None:
        """The server answers, serves ``server_model``, takes this student's kind of weight push
        with kd's token, holds ``tokenizer.max_seq_len`` tokens, and can sleep when asked to
        (:func:`kd.rollouts.served_probe.check_server`).

        Raises:
            KDUserError: the first problem, one line naming the key and the fix.
        """
        check_server(
            self.settings,
            lora_rank=self.sync.lora_rank,
            max_seq_len=self.sync.max_seq_len,
            distributed=self.sync.world.distributed,
            sync_dir=self.sync_dir,
            probe_adapter=f"{self._adapter_prefix}probe",
        )

    # ------------------------------------------------------------ sleep
    def idle(self, step: int) -> None:
        """Step ``step``'s rollouts are sampled and it is about to train: with
        ``on_policy.server_sleep`` the server sleeps until the next push or rollout (level 2
        when the push after this step reloads the weights)."""
        s = self.settings
        if not s.server_sleep or self._asleep or s.lmbda == 0 or self._failure is not None:
            return
        level = 2 if not self.sync.lora and step % s.sync_every_n_steps == 0 else 1
        fix = "start vllm serve with --enable-sleep-mode, or set on_policy.server_sleep=false"
        self._ask(VLLMGeneration.sleep_path(level), "to sleep", f"{fix}, and resume")
        self._asleep = level

    def _ask(self, path: str, what: str, fix: str) -> None:
        """One sleep-mode request; anything but 200 stops the run in one line."""
        status, text, _ = self.client.call("POST", path, None, push=True)
        if status != 200:
            raise RolloutStopped(
                f"{_KEY}.server_sleep: {self.client.url} refused {what} (HTTP {status}: "
                f"{self.client.shown(text[:160])}); {fix}"
            )

    def _wake(self, tag: str | None = None) -> None:
        """Wake the server's ``tag`` memory (None: all of it), once kd's cached device memory
        is free for it."""
        if not self._asleep:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        fix = "see the server's log (out of memory?), fix it and resume"
        self._ask(VLLMGeneration.wake_path(tag), "to wake up", fix)
        if tag is None:
            self._asleep = 0

    def _wake_for_rollouts(self) -> None:
        """Before a rollout: a level-2 sleep dropped the weights, so the version sampled is
        reloaded from its folder; otherwise the server wakes whole."""
        if self._asleep == 2 and not self.sync.lora:
            self._take(version_dir(self.sync_dir, self.version), self.version)
        else:
            self._wake()

    # ------------------------------------------------------------ resume state
    def state_dict(self) -> dict[str, Any]:
        """The version sampled from here on: the one pushed last, or the one whose push failed
        (a resumed run pushes it again)."""
        version = self._due if self._failure is not None else self.version
        return {"version": int(version)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version = state.get("version") if state else None
        self._resume_version = int(version) if isinstance(version, int) and version >= 0 else None

    # ------------------------------------------------------------ weights
    def after_step(self, student: nn.Module, step: int) -> None:
        """Push the weights of optimizer step ``step`` when it is a multiple of
        ``on_policy.sync_every_n_steps``; the first call (before the first step) pushes what the
        run starts from (:meth:`prepare`). Collective when distributed."""
        if self.settings.lmbda == 0:  # the student never samples: nothing to push
            return
        if self.version < 0:
            self.prepare(student, step)
        elif step % self.settings.sync_every_n_steps == 0 and self._failure is None:
            # Raised by the next rollout (step + 1's, before it trains), not here: the step's
            # metrics row is logged first, and the stop saves step `step` with this version
            # due (a resumed run pushes it again).
            try:
                self._push(student, step)
            except RolloutStopped as e:
                self._failure, self._due = e, step

    def prepare(self, student: nn.Module, step: int) -> None:
        """Before the first rollout of this process (the weights after ``step`` optimizer
        steps): a resumed run pushes the version its checkpoint was sampling with; a fresh one
        version 0. Collective when distributed; a no-op once a version is pushed."""
        if self.version >= 0:
            return
        version, self._resume_version = self._resume_version, None
        if version is not None and version != step:
            folder = version_dir(self.sync_dir, version)
            present = distributed.broadcast_object(
                (folder / _MARKER).is_file(), world=self.sync.world
            )
            if present:
                self._take(folder, version)
                return
            if self.sync.world.is_rank_zero:
                log.warning(
                    "on_policy: %s (weight version %d, which the checkpoint was sampling with) "
                    "is gone; the server gets the checkpoint's own weights (version %d): the "
                    "rollouts until the next push differ from the uninterrupted run's",
                    folder,
                    version,
                    step,
                )
        self._push(student, step)

    def _push(self, student: nn.Module, version: int) -> None:
        """Write the student as ``version`` (atomically) and have the server take it."""
        world = self.sync.world
        folder = version_dir(self.sync_dir, version)
        failure: str | None = None
        tmp: Path | None = None
        if world.is_rank_zero:
            try:
                self.sync_dir.mkdir(parents=True, exist_ok=True)
                self._remove_stale_tmp()
                tmp = self.sync_dir / f"{_TMP}{folder.name}_{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                failure = (
                    f"{_KEY}.server_sync_dir: cannot write {self.sync_dir} ({brief(e, 120)}); "
                    "point it at a writable folder the server reads"
                )
        failure = distributed.broadcast_object(failure, world=world)
        if failure is not None:
            raise RolloutStopped(failure, collective=True)
        self.sync.exporter(tmp, student)  # collective: gathers a sharded student
        if world.is_rank_zero:
            assert tmp is not None
            try:
                self._seal(tmp, folder, version)
            except OSError as e:
                failure = (
                    f"{_KEY}.server_sync_dir: writing {folder} failed ({brief(e, 120)}); free "
                    "space or point on_policy.server_sync_dir elsewhere, then resume"
                )
        failure = distributed.broadcast_object(failure, world=world)
        if failure is not None:
            raise RolloutStopped(failure, collective=True)
        self._take(folder, version)

    def _seal(self, tmp: Path, folder: Path, version: int) -> None:
        """Make ``tmp`` the complete folder of ``version``: files fsynced, marker last, renamed
        over any older copy."""
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                fsync_path(path)
        marker = {"version": version, "lora": self.sync.lora, "written": time.time()}
        with open(tmp / _MARKER, "w", encoding="utf-8") as f:
            f.write(json.dumps(marker) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if folder.exists():
            old = self.sync_dir / f"{_TMP}old_{folder.name}_{os.getpid()}"
            os.rename(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, folder)
        fsync_path(self.sync_dir)

    def _remove_stale_tmp(self) -> None:
        for p in self.sync_dir.glob(f"{_TMP}*"):
            shutil.rmtree(p, ignore_errors=True)

    def _take(self, folder: Path, version: int) -> None:
        """The server loads ``folder`` as ``version`` (rank 0); every rank then samples it."""
        world = self.sync.world
        failure: str | None = None
        if world.is_rank_zero:
            try:
                if self.sync.lora:
                    self._wake()
                    self._load_adapter(folder, version)
                else:
                    self._reload(folder, version)
                self._prune(version)
            except RolloutStopped as e:
                failure = str(e)
        failure = distributed.broadcast_object(failure, world=world)
        if failure is not None:
            raise RolloutStopped(failure, collective=True)
        self.version = version
        self.adapter = self._adapter_name(version) if self.sync.lora else None
        self._pushed_once = True

    def _adapter_name(self, version: int) -> str:
        return f"{self._adapter_prefix}{version}"

    def _refused(self, what: str, answer: tuple[int, str, Any], folder: Path) -> RolloutStopped:
        disabled = self.protocol.lora_disabled(answer[0], answer[1])
        rank = self.sync.lora_rank
        return push_refused(
            self.client, what, answer, folder, lora_rank=rank, lora_disabled=disabled
        )

    def _load_adapter(self, folder: Path, version: int) -> None:
        name = self._adapter_name(version)
        adapter = str((folder / "adapter").resolve())
        unload = self.protocol.unload_lora_path
        if not self._pushed_once:  # a name left loaded by a run that was killed
            self.client.call("POST", unload, {"lora_name": name}, push=True)
        path, body = self.protocol.load_lora(name, adapter)
        status, text, data = load_lora(self.client, self.protocol, path, body)
        if status == 400 and "already" in text:  # vLLM "already been loaded", SGLang "exists"
            # This version's name, loaded before a kill or by an attempt whose answer was lost.
            self.client.call("POST", unload, {"lora_name": name}, push=True)
            status, text, data = load_lora(self.client, self.protocol, path, body)
        if status != 200 or (isinstance(data, dict) and data.get("success") is False):
            raise self._refused("the student's LoRA adapter", (status, text, data), folder)
        if self.adapter is not None and self.adapter != name:
            self.client.call("POST", unload, {"lora_name": self.adapter}, push=True)

    def _reload(self, folder: Path, version: int) -> None:
        deep = self._asleep == 2  # the weights were dropped: their memory back, then the load
        self._wake("weights" if deep else None)
        for path, body in self.protocol.reload(str(folder.resolve()), version):
            status, text, data = self.client.call("POST", path, body, push=True)
            if status != 200 or (isinstance(data, dict) and data.get("success") is False):
                raise self._refused("the student's weights", (status, text, data), folder)
        if deep:
            self._wake("kv_cache")
            self._asleep = 0

    def _prune(self, current: int) -> None:
        """Remove the version folders no step checkpoint needs: a checkpoint of step ``S``
        resumes sampling with the newest version at or before ``S``."""
        versions = sorted(
            int(m.group(1))
            for p in self.sync_dir.iterdir()
            if (m := _VERSION_RE.match(p.name)) and (p / _MARKER).is_file()
        )
        steps = (
            [
                int(m.group(1))
                for p in self.sync.output_dir.iterdir()
                if (m := _STEP_RE.match(p.name))
            ]
            if self.sync.output_dir.is_dir()
            else []
        )
        keep = {current}
        for s in steps:
            older = [v for v in versions if v <= s]
            if older:
                keep.add(older[-1])
        for v in versions:
            if v not in keep and v < current:
                shutil.rmtree(version_dir(self.sync_dir, v), ignore_errors=True)

    # ------------------------------------------------------------ rollouts
    def sample(
        self,
        prompts: Prompts,
        *,
        rows: Sequence[int],
        epoch: int,
        step: int,
        student: nn.Module,
    ) -> Completions:
        """Completions of ``prompts`` from the server (one request per prompt), version set."""
        from kd.rollouts.sampling import derive_seed

        if self._failure is not None:  # the last push failed: stop before this step trains
            self._raised = True
            raise self._failure
        if self.version < 0:
            self.prepare(student, step - 1)
        self._wake_for_rollouts()
        if not self._model_checked and self.version == step - 1:
            # The first rollout where the server holds the student's weights as they are (a
            # resumed run may sample an older version until its next push).
            self._model_checked = True
            self._check_model(prompts, student)
        s = self.settings
        lengths = prompts.lengths.tolist()
        tokens = prompts.tokens.cpu()
        width = tokens.shape[1]
        asks = []
        for i, n in enumerate(lengths):
            seed = derive_seed(self.sync.seed, epoch, int(rows[i])) if s.temperature > 0 else None
            asks.append(
                self.protocol.body(
                    model=s.server_model,
                    adapter=self.adapter,
                    prompt=tokens[i, width - n :].tolist(),
                    max_tokens=s.max_new_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    stop_ids=self.sync.stop_ids,
                    seed=seed,
                    vocab_limit=self.sync.vocab_limit,
                    vocab=self.sync.vocab,
                )
            )
        failure: RolloutStopped | None = None
        samples: list[Sample] = []
        try:
            samples = list(self._executor().map(lambda b: self._one(b, rows), asks))
        except RolloutStopped as e:
            failure = e
        self._agree(failure)
        return self._completions(samples, rows)

    def _check_model(self, prompts: Prompts, student: nn.Module) -> None:
        """The server samples the student (:func:`kd.rollouts.served_check.model_gap`, on this
        rank's first prompt); a stop when not. Collective when distributed."""
        if self.sync.scorer is None or int(prompts.lengths[0]) < 2:
            return
        n = int(prompts.lengths[0])
        ids = prompts.tokens[0, prompts.tokens.shape[1] - n :]
        local = self.sync.scorer(student, ids).float().cpu()
        failure = model_gap(
            self.client,
            self.protocol,
            self.settings,
            ids=ids.tolist(),
            local=local,
            adapter=self.adapter,
            vocab=self.sync.vocab,
            lora=self.sync.lora,
        )
        self._agree(failure)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.settings.server_concurrency, thread_name_prefix="kd-rollout"
                )
            return self._pool

    def _one(self, body: dict[str, Any], rows: Sequence[int]) -> Sample:
        where = f"{self.client.url}{self.protocol.generate_path}"
        return retry_aborted(lambda: self._rollout(body, where), self.client, where)

    def _rollout(self, body: dict[str, Any], where: str) -> Sample:
        status, text, data = self.client.call("POST", self.protocol.generate_path, body)
        if status != 200 and self.adapter is not None and self.adapter in text:
            raise weights_lost(where, self.version, self.client.shown(text[:160]))
        if status != 200:
            raise RolloutStopped(
                f"{_KEY}.server_url: {where} refused a rollout with HTTP {status} "
                f"({self.client.shown(text[:200])}); check {_KEY}.server_api, "
                f"{_KEY}.server_model and the server's --max-model-len"
            )
        try:
            if data is None:
                raise BadAnswer(f"the answer is not JSON ({_short(text, 80)!r})")
            sample = self.protocol.parse(
                data, adapter=self.adapter, model=self.settings.server_model
            )
            self._check(sample, where=where, version=None if self.sync.lora else self.version)
        except BadAnswer as e:
            raise RolloutStopped(
                f"{_KEY}.server_url: {where} gave a malformed rollout: {self.client.shown(str(e))}; "
                f"check {_KEY}.server_api matches the server ({self.settings.server_api} now)"
            ) from None
        return sample

    def _agree(self, failure: RolloutStopped | None) -> None:
        """Under torchrun every rank stops, with the failing rank's line, when one rank's
        rollouts failed (only from the main thread: the ranks run this collective in step)."""
        world = self.sync.world
        if not world.distributed or threading.current_thread() is not threading.main_thread():
            if failure is not None:
                raise failure
            return
        if distributed.any_rank(failure is not None, device=self.device):
            lines = distributed.all_gather_text(
                str(failure) if failure else None, device=self.device
            )
            rank, line = next((r, x) for r, x in enumerate(lines) if x is not None)
            raise RolloutStopped(
                line if failure is not None else f"rank {rank}: {line}", collective=True
            ) from failure

    def _completions(self, samples: Sequence[Sample], rows: Sequence[int]) -> Completions:
        n = self.settings.max_new_tokens
        tokens = torch.full((len(samples), n), self.sync.pad_id, dtype=torch.long)
        lengths = torch.zeros(len(samples), dtype=torch.long)
        for i, sample in enumerate(samples):
            k = len(sample.ids)
            if k:
                tokens[i, :k] = torch.tensor(sample.ids, dtype=torch.long)
            lengths[i] = k
        steps = int(lengths.max()) if len(samples) else 0
        return Completions(
            tokens=tokens.to(self.device),
            lengths=lengths.to(self.device),
            steps=steps,
            version=self.version,
        )

    def close(self) -> None:
        if self._failure is not None and not self._raised and self.sync.world.is_rank_zero:
            # The run ended (its last step) before a rollout could stop it: said once here.
            log.warning("on_policy: the last weight push failed (%s)", self._failure)
        if self._asleep and self.version >= 0 and self._failure is None:
            self._wake_on_the_way_out()
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def _wake_on_the_way_out(self) -> None:
        """A run that ends leaves the server awake, with the version it pushed last (one short
        try: a server that does not answer is said in one line, not waited for)."""
        quick = dataclasses.replace(self.settings, server_retries=0)
        self.client = ServerClient(quick, timeout=min(quick.server_timeout, PROBE_TIMEOUT_S))
        try:
            self._wake_for_rollouts()
        except RolloutStopped as e:
            log.warning("on_policy: the server was left asleep (%s)", e)


def served_sampler(
    run: Any,
    *,
    student: Any,
    student_vocab: int | None,
    tokenizer: object,
    seed: int,
    vocab_limit: int,
    world: WorldInfo,
    device: torch.device,
    output_dir: Path,
) -> ServedSampler:
    """The served sampler of a run (:func:`kd.rollouts.build.sampler_for`'s ``served``)."""
    from kd.data import pad_id_of
    from kd.rollouts.sampling import stop_token_ids

    assert run.on_policy is not None
    sync = SyncSettings(
        output_dir=Path(output_dir),
        exporter=exporter_of(student, world=world) if student is not None else None,
        lora_rank=run.lora.rank if run.lora is not None else None,
        seed=seed,
        pad_id=pad_id_of(tokenizer),
        stop_ids=tuple(stop_token_ids(tokenizer)),
        vocab_limit=vocab_limit,
        vocab=student_vocab if student_vocab is not None else vocab_limit,
        max_seq_len=run.max_seq_len,
        world=world,
        scorer=scorer_of(student) if student is not None else None,
    )
    return ServedSampler(run.on_policy, sync, device=device)
