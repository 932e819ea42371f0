"""A teacher kind added at runtime goes through ``kd validate``, ``kd plan`` and ``kd run`` with
nothing in kd changed, and a teacher with state of its own resumes exactly.

The kind is defined here: a section of its own (``counting_teacher: {k, rate}``), a source, and a
teacher whose top-k distribution sharpens with every optimizer step it has seen
(:meth:`kd.teachers.Teacher.after_step`); its step count is its state
(:meth:`kd.teachers.Teacher.state_dict`), saved in step checkpoints and restored on resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kd import checkpoint, cli
from kd.config import teacher_kinds
from kd.config.declare import MUST_MATCH, setting, settings
from kd.config.schema import Section
from kd.config.teacher_kinds import StandIn, TeacherKind, TeacherPlan
from kd.teachers import Teacher, TeacherInput, TopKSignal
from tests.conftest import UNTIMED, make_config, read_metrics, sigterm_at_step, write_config

SECTION = "counting_teacher"


@settings
class CountingSettings:
    """The counting teacher (this test's kind)."""

    k: int = setting(f"{SECTION}.k", 4, "top-k ids it answers", min=1, resume=MUST_MATCH)
    rate: float = setting(
        f"{SECTION}.rate", 0.5, "how much sharper it gets per optimizer step", resume=MUST_MATCH
    )


class CountingTeacher(Teacher):
    """Answers ids ``0..k-1`` at every position with log-probs that sharpen per step."""

    def __init__(self, settings: CountingSettings):
        self.settings = settings
        self.steps = 0
        self.seen: list[int] = []

    def signal(self, batch: TeacherInput) -> TopKSignal:
        b, s = batch.tokens.shape
        k = self.settings.k
        scores = -torch.arange(k, dtype=torch.float32) * (1.0 + self.settings.rate * self.steps)
        logprobs = torch.log_softmax(scores, dim=-1).expand(b, s, k).contiguous()
        ids = torch.arange(k).expand(b, s, k).contiguous()
        return TopKSignal(ids=ids, logprobs=logprobs, tail="renorm")

    def after_step(self, step: int) -> None:
        self.steps += 1
        self.seen.append(step)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))


LOADED: list[CountingTeacher] = []


class CountingSource:
    reads: tuple[str, ...] = ()
    needs_rows = False
    route_field: str | None = None

    def __init__(self, run: Any):
        self.settings: CountingSettings = run.kind_settings[SECTION]

    def check(self, ctx: Any, facts: Any, dataset: Any) -> None:
        from kd.errors import KDUserError

        if self.settings.k > facts.student_vocab:
            raise KDUserError(f"{SECTION}.k: {self.settings.k} is over the student's vocabulary")

    def load(self, ctx: Any, facts: Any, *, run_dir: Any = None) -> CountingTeacher:
        teacher = CountingTeacher(self.settings)
        LOADED.append(teacher)
        return teacher


def _plan(p: TeacherPlan) -> None:
    s = p.run.kind_settings[SECTION]
    p.stored_topk = s.k
    p.line = f"counting: top-{s.k} ids, no teacher weights"


def _stand_in(s: StandIn) -> None:
    from kd.memory.stand_ins import topk

    topk(s, k=s.run.kind_settings[SECTION].k, tail="renorm")


KIND = TeacherKind(
    name="counting",
    section=SECTION,
    selects=lambda run: SECTION in run.kind_settings,
    source=CountingSource,
    precedence=1,
    replaces_teacher_model=True,
    plan=_plan,
    stand_in=_stand_in,
    settings=CountingSettings,
    section_help=Section("the counting teacher (a test's kind): {k, rate}", MUST_MATCH),
)


@pytest.fixture
def counting_kind():
    teacher_kinds.register(KIND)
    LOADED.clear()
    try:
        yield KIND
    finally:
        teacher_kinds.unregister(KIND.name)


def counting_config(assets: dict, out: Path, **top: Any) -> dict:
    return make_config(
        assets,
        out,
        teacher_model=None,
        teacher_checkpointer=None,
        counting_teacher={"k": 4, "rate": 0.5},
        **top,
    )


def rows(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in UNTIMED} for r in read_metrics(out)]


def test_a_kind_registered_at_runtime_validates_plans_and_runs(
    assets, tmp_path, capsys, counting_kind
):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", counting_config(assets, out))
    assert cli.main(["validate", "--config", str(config)]) == 0
    capsys.readouterr()
    assert cli.main(["plan", "--config", str(config)]) == 0
    assert "teacher: counting: top-4 ids, no teacher weights" in capsys.readouterr().out
    assert cli.main(["run", "kd_single_device", "--config", str(config)]) == 0
    (teacher,) = LOADED
    assert teacher.seen == [1, 2, 3] and teacher.steps == 3
    metrics = read_metrics(out)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(r["kd_loss"] > 0 for r in metrics)
    # Its own section is checked like any other: a bad value is one line, exit 2.
    assert cli.main(["validate", "--config", str(config), f"{SECTION}.k=0"]) == 2
    assert f"{SECTION}.k" in capsys.readouterr().err


def test_without_the_kind_its_section_is_an_unknown_key(assets, tmp_path, capsys):
    config = write_config(tmp_path / "cfg.yaml", counting_config(assets, tmp_path / "run"))
    assert cli.main(["validate", "--config", str(config)]) == 2
    assert SECTION in capsys.readouterr().err


def test_a_teacher_with_state_resumes_exactly(assets, tmp_path, monkeypatch, counting_kind):
    top = dict(max_steps_per_epoch=4, save_every_n_steps=2, keep_last_n=2, shuffle=True)
    reference = tmp_path / "reference"
    config = write_config(tmp_path / "ref.yaml", counting_config(assets, reference, **top))
    assert cli.main(["run", "kd_single_device", "--config", str(config)]) == 0

    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", counting_config(assets, out, **top))
    with monkeypatch.context() as m:
        sigterm_at_step(m, 2)
        assert cli.main(["run", "kd_single_device", "--config", str(config)]) == 0
    latest = checkpoint.find_latest_checkpoint(out)
    assert checkpoint.read_checkpoint_marker(latest)["step"] == 2
    assert not (out / "final").exists()
    LOADED.clear()
    assert (
        cli.main(
            ["run", "kd_single_device", "--config", str(config), "resume_from_checkpoint=true"]
        )
        == 0
    )
    (resumed,) = LOADED
    assert resumed.seen == [3, 4] and resumed.steps == 4  # counted on from the saved 2
    a = load_file(reference / "final" / "model.safetensors")
    b = load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert rows(reference) == rows(out)
    assert json.dumps(rows(out)[-1]["kd_loss"]) == json.dumps(rows(reference)[-1]["kd_loss"])


def test_a_kinds_section_reads_as_a_run_attribute_and_joins_the_tables_last(
    assets, tmp_path, counting_kind
):
    """RunConfig and the schema know no kind: the registered section is ``run.<section>`` (None
    without it), a key of the schema's tables (after the built-in sections), and gone again when
    the kind is unregistered."""
    from kd.config import load_config, schema
    from kd.config.run import run_config

    config = write_config(tmp_path / "cfg.yaml", counting_config(assets, tmp_path / "run"))
    run = run_config(load_config(str(config), []))
    assert run.counting_teacher == CountingSettings(k=4, rate=0.5)
    assert run.counting_teacher is run.kind_settings[SECTION]
    assert run.with_section(SECTION, None).counting_teacher is None
    assert list(schema.SECTIONS)[-1] == SECTION and SECTION in schema.TOP_LEVEL
    teacher_kinds.unregister(KIND.name)
    try:
        assert SECTION not in schema.SECTIONS and SECTION not in schema.TOP_LEVEL
        with pytest.raises(AttributeError):
            run.counting_teacher  # noqa: B018
    finally:
        teacher_kinds.register(KIND)


def test_what_a_kind_refuses_of_on_policy_and_validation_is_its_declaration(
    assets, tmp_path, capsys
):
    """kd.config.checks.features reads what each kind refuses from the registry: a kind that
    declares a refusal gets it as the one problem line of kd validate, exit 2."""
    import dataclasses

    refusing = dataclasses.replace(
        KIND,
        on_policy="cannot score completions made during training; remove on_policy",
        validation="holds no held-out distribution; remove validation",
    )
    teacher_kinds.register(refusing)
    try:
        cfg = counting_config(assets, tmp_path / "run")
        config = write_config(tmp_path / "cfg.yaml", cfg)
        assert cli.main(["validate", "--config", str(config)]) == 0
        capsys.readouterr()
        on_policy = {"lmbda": 1.0, "max_new_tokens": 4}
        config = write_config(tmp_path / "on.yaml", {**cfg, "on_policy": on_policy})
        assert cli.main(["validate", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert "on_policy: cannot score completions made during training; remove on_policy" in err
        validation = {"dataset": cfg["dataset"]}
        config = write_config(tmp_path / "val.yaml", {**cfg, "validation": validation})
        assert cli.main(["validate", "--config", str(config)]) == 2
        assert "validation: holds no held-out distribution; remove validation" in (
            capsys.readouterr().err
        )
    finally:
        teacher_kinds.unregister(refusing.name)


def test_several_teachers_beside_a_null_teacher_model_distil_on_policy(assets, tmp_path, capsys):
    """``teachers:`` is the teacher when ``teacher_model: null``: on_policy is not refused as
    plain fine-tuning (it was, with a fix, 'set teacher_model', that teachers: itself refuses)."""
    cfg = make_config(assets, tmp_path / "run", on_policy={"lmbda": 1.0, "max_new_tokens": 4})
    member = {
        "name": "a",
        "teacher_model": cfg.pop("teacher_model"),
        "teacher_checkpointer": cfg.pop("teacher_checkpointer"),
    }
    cfg.update(teacher_model=None, teacher_checkpointer=None, teachers={"members": [member]})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main(["validate", "--config", str(config)]) == 0, capsys.readouterr().err
    # plain fine-tuning still is refused
    plain = {k: v for k, v in cfg.items() if k != "teachers"}
    config = write_config(tmp_path / "plain.yaml", plain)
    assert cli.main(["validate", "--config", str(config)]) == 2
    assert "on_policy: needs a teacher to score the completions, but teacher_model is null" in (
        capsys.readouterr().err
    )
