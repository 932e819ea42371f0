"""The teacher interface (kd.teachers) and the backend adapters (kd.backends): every kind of
teacher answers through one protocol, a new kind plugs in without touching kd.training.train, and no module
outside the adapters asks which library built a model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kd import backends, models
from kd.teachers import (
    FixedTopKTeacher,
    LogitsSignal,
    ModelTeacher,
    StoreTeacher,
    Teacher,
    TeacherInput,
    TeacherSignal,
    TopKSignal,
    as_teacher,
)
from kd.training import train
from tests.conftest import tiny_hidden_decoder

IGN = -100
SRC = Path(__file__).resolve().parents[2] / "src" / "kd"


def _batch(b=2, s=10, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    labels = tokens.clone()
    labels[:, :3] = IGN
    return tokens, labels


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_model_teacher_is_the_bare_decoder():
    """A ModelTeacher gives exactly the loss and gradients of the decoder passed as it is."""
    student = tiny_hidden_decoder()
    teacher = models.freeze(tiny_hidden_decoder(seed=5))
    tokens, labels = _batch()
    shifted = train.shift_labels(labels)
    settings = train.LossSettings(chunk_size=7, temperature=2.0)
    out = []
    for t in (teacher, ModelTeacher(teacher)):
        student.zero_grad()
        loss, ce, kd = train.compute_loss(student, t, tokens, shifted, settings=settings)
        loss.backward()
        out.append((loss.detach(), ce, kd, _grads(student)))
    (a, *ra, ga), (b, *rb, gb) = out
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ra, rb, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))


def test_signals_implement_the_protocol():
    teacher = tiny_hidden_decoder(seed=5)
    tokens, _ = _batch()
    sig = ModelTeacher(teacher).signal(TeacherInput(tokens))
    assert isinstance(sig, LogitsSignal) and isinstance(sig, TeacherSignal)
    assert not sig.hidden.requires_grad  # the teacher runs without autograd
    topk = TopKSignal(ids=torch.zeros(2, 10, 3, dtype=torch.long), logprobs=torch.zeros(2, 10, 3))
    assert isinstance(topk, TeacherSignal)
    with pytest.raises(ValueError, match="full distribution"):
        topk.labelled_hidden(None)


class _Reader:
    """A StoreFile of one model's top-k, computed on demand (rows are ignored)."""

    def __init__(self, teacher, k):
        self.teacher, self.k, self.num_rows = teacher, k, 2
        self.calls = []

    def batch(self, rows, tokens, labels, *, k, ignore_index=-100):
        self.calls.append((list(rows), k))
        with torch.no_grad():
            logits = models.logits_from_hidden(self.teacher, self.teacher(tokens))
        lp, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
        return ids, lp


def test_file_teacher_reads_rows_and_carries_vocab_and_tail():
    teacher = models.freeze(tiny_hidden_decoder(seed=5))
    reader = _Reader(teacher, k=64)
    ft = StoreTeacher(reader, k=64, vocab=64, tail="renorm", device=torch.device("cpu"))
    tokens, labels = _batch()
    sig = ft.signal(TeacherInput(tokens, labels, rows=[4, 7]))
    assert reader.calls == [([4, 7], 64)]
    assert (sig.vocab, sig.tail) == (64, "renorm") and sig.ids.shape == (2, 10, 64)
    with pytest.raises(ValueError, match="dataset rows"):
        ft.signal(TeacherInput(tokens))
    # k = V with renorm equals the online teacher's forward KL (float32 storage here).
    student = tiny_hidden_decoder()
    shifted = train.shift_labels(labels)
    settings = train.LossSettings(chunk_size=5)
    got = train.compute_loss(
        student,
        ft,
        tokens,
        shifted,
        settings=settings,
        teacher_input=TeacherInput(tokens, labels, [0, 1]),
    )
    want = train.compute_loss(student, teacher, tokens, shifted, settings=settings)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_new_kind_of_teacher_plugs_in_without_touching_train():
    """A teacher whose signal is new to kd (here: a fixed uniform distribution) only implements
    the protocol; compute_loss and micro_step take it as they are."""

    class UniformSignal:
        def loss(self, student, student_hidden, labels, *, settings):
            logits = models.logits_from_hidden(student, student_hidden)
            logp = torch.log_softmax(logits, -1)
            mask = labels != settings.ignore_index
            ce = torch.nn.functional.cross_entropy(logits[mask], labels[mask])
            kd = -(logp[mask].mean(-1)).mean() - torch.log(torch.tensor(float(logits.size(-1))))
            return (1 - settings.kd_ratio) * ce + settings.kd_ratio * kd, ce, kd

        def labelled_hidden(self, index):
            raise ValueError("no hidden states")

        def logits(self, hidden):
            raise ValueError("no logits")

    class UniformTeacher(Teacher):
        def __init__(self):
            self.asked = 0

        def signal(self, batch):
            self.asked += 1
            return UniformSignal()

    student = tiny_hidden_decoder()
    tokens, labels = _batch()
    shifted = train.shift_labels(labels)
    teacher = UniformTeacher()
    n = int((shifted != IGN).sum())
    r = train.micro_step(
        student, teacher, tokens, shifted, settings=train.LossSettings(), num_tokens_total=n
    )
    assert teacher.asked == 1 and float(r.kd) >= 0 and _grads(student)
    assert teacher.generator is None and list(teacher.look_ahead(iter([1, 2]))) == [1, 2]


def test_fixed_topk_teacher_and_as_teacher():
    ids, lp = torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 3)
    sig = FixedTopKTeacher(ids, lp).signal(TeacherInput(torch.zeros(1, 2, dtype=torch.long)))
    assert sig.ids is ids and sig.logprobs is lp
    decoder = tiny_hidden_decoder()
    assert isinstance(as_teacher(decoder), ModelTeacher) and as_teacher(None) is None
    t = ModelTeacher(decoder)
    assert as_teacher(t) is t and t.generator is decoder


def test_teacher_source_is_chosen_once_from_the_config(tmp_path):
    from types import SimpleNamespace

    from kd.teachers.build import ModelTeacherSource, StoredTeacherSource, teacher_source

    def run(teacher_model, teacher_logits, kd_ratio=0.5, teacher_samples=False):
        return SimpleNamespace(
            loss=SimpleNamespace(needs_teacher_logits=kd_ratio > 0),
            teacher_samples=teacher_samples,
            teacher_logits=teacher_logits,
            teacher_server=None,
            self_teacher=None,
            cross_tokenizer=None,
            teachers=None,
            hidden_states=None,
            teacher_quantization="none",
            teacher_offload="none",
            teacher_device=None,
            components={"teacher_model": teacher_model},
            has_teacher=teacher_model is not None and teacher_logits is None,
        )

    logits = SimpleNamespace(path=tmp_path, k=4, tail="bucket", format="kd")
    assert teacher_source(run(None, None)) is None
    assert isinstance(teacher_source(run({"_component_": "x"}, None)), ModelTeacherSource)
    # kd_ratio 0: a teacher asked nothing is not loaded; one that samples seq_kd answers is
    assert teacher_source(run({"_component_": "x"}, None, kd_ratio=0.0)) is None
    sampler = run({"_component_": "x"}, None, kd_ratio=0.0, teacher_samples=True)
    assert isinstance(teacher_source(sampler), ModelTeacherSource)
    stored = teacher_source(run({"_component_": "x"}, logits))
    assert isinstance(stored, StoredTeacherSource)
    assert stored.reads == () and stored.needs_rows
    assert ModelTeacherSource.reads == ("teacher_model",) and not ModelTeacherSource.needs_rows


def test_backend_of_picks_the_adapter(tmp_path):
    from kd.testing import TinyModel, write_tiny_model

    tt_model = tiny_hidden_decoder()
    assert backends.backend_of(tt_model) is backends.TORCHTUNE
    shape = TinyModel(
        vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64
    )
    folder = write_tiny_model(tmp_path / "hf", shape, seed=0, writer="transformers")
    from kd.hf.model import causal_lm

    hf_model = causal_lm(str(folder))
    assert backends.backend_of(hf_model) is backends.TRANSFORMERS
    for model in (tt_model, hf_model):
        backend = backends.backend_of(model)
        assert backends.backend_named(backend.name) is backend
        assert models.output_weight(model) is backend.output_weight(model)
        assert len(models.decoder_layers(model)) == len(backend.decoder_layers(model))


def _calls_outside(allowed: tuple[str, ...], names: set[str]) -> list[str]:
    found = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in names:
                    found.append(f"{rel}:{node.lineno}")
    return found


def test_no_backend_test_outside_the_adapters():
    """Only kd.backends (and kd.hf, the transformers backend's own module) ask whether a model
    is a transformers model."""
    assert _calls_outside(("backends/", "hf/"), {"is_hf_model"}) == []


# The names kd gives a config as plain containers or a DictConfig.
CONFIG_NAMES = ("data", "cfg", "config", "raw")


def _kind_reads(path: Path, sections: set[str]) -> set[str]:
    """The sections ``path`` reads: ``run.<section>`` (also ``self.run.``, ``member.run.``),
    and a config's ``data.get("<section>")`` / ``data["<section>"]`` (plain containers)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in sections:
            base = node.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if name == "run":
                found.add(node.attr)
        key = None
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
            base, key = getattr(node.func, "value", None), node.args[0]
        elif isinstance(node, ast.Subscript):
            base, key = node.value, node.slice
        if key is not None and getattr(base, "id", None) not in CONFIG_NAMES:
            key = None  # a memory component named like a section, a schema table
        if isinstance(key, ast.Constant) and key.value in sections:
            found.add(key.value)
    return found


def test_every_registered_kind_is_complete():
    """Each kind module declares one registered kind with its section in the schema, its teacher
    class, its source and stand-in (their references resolve), its planner inputs, its own
    modules and its doc page; a kind module left out of the registry fails."""
    from kd.config import schema
    from kd.config import teacher_kinds as kinds

    registered = kinds.kinds()
    assert len({k.name for k in registered}) == len(registered)
    modules = {p.stem for p in (SRC / "config" / "teacher_kinds").glob("*.py")}
    modules -= {"__init__", "base"}
    assert modules, "the kind modules are in kd/config/teacher_kinds"
    declared = {k.selects.__module__.rsplit(".", 1)[-1] for k in registered}
    assert modules <= declared, f"kind modules not registered: {modules - declared}"
    root = SRC.parents[1]
    for kind in registered:
        if kind.section is not None:
            assert kind.section in schema.TOP_LEVEL, kind.name
            # its section's keys and help are declared by a kind module, not by run.py/schema.py
            assert kind.settings is not None and kind.section_help is not None, kind.name
            assert kind.settings.__module__.startswith("kd.config.teacher_kinds."), kind.name
        module, _, cls = kind.teacher.rpartition(".")
        teacher = getattr(__import__(module, fromlist=[cls]), cls)
        assert Teacher in teacher.__mro__, kind.name
        assert (root / kind.doc).is_file(), kind.doc
        assert kind.modules and all((SRC / m).is_file() for m in kind.modules), kind.name
        assert kind.plan is not None, f"{kind.name}: the planner needs its inputs"
        if isinstance(kind.source, str):  # by reference: it names a source with both phases
            source = kinds.resolve(kind.source)
            assert callable(source.check) and callable(source.load), kind.name
        if kind.stand_in is not None:
            assert callable(kinds.resolve(kind.stand_in)), kind.name


def test_the_run_config_and_the_schema_name_no_kind():
    """RunConfig's fields and the schema's own tables hold no kind's section: the registry adds
    them (a built-in kind is its module and its registry line)."""
    import dataclasses

    from kd.config import teacher_kinds as kinds
    from kd.config.run import RunConfig

    sections = {k.section for k in kinds.kinds() if k.section is not None}
    assert not sections & {f.name for f in dataclasses.fields(RunConfig)}
    for module in ("config/run.py", "config/schema.py"):
        tree = ast.parse((SRC / module).read_text())
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)} & sections
        assert not named, f"{module} names {sorted(named)}"


def test_no_module_outside_a_kinds_own_files_reads_its_section():
    """Which teacher keys a config sets is asked only by the registry's kind modules and each
    kind's own modules (its source, teacher, config checks, tracer stand-in), read from the
    registry."""
    from kd.config import teacher_kinds as kinds

    sections = {k.section for k in kinds.kinds() if k.section is not None}
    owned: dict[str, set[str]] = {}
    for kind in kinds.kinds():
        refs = [r for r in (kind.source, kind.stand_in) if isinstance(r, str)]
        by_ref = [r.partition(":")[0].removeprefix("kd.").replace(".", "/") + ".py" for r in refs]
        for module in (*kind.modules, *by_ref):
            owned.setdefault(module, set()).add(kind.name)
    # The rules between features (on_policy, validation) read what kinds refuse from the
    # registry (TeacherKind.on_policy / .validation), never a kind's section.
    assert "config/checks/features.py" not in owned
    outside = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("config/teacher_kinds/") or rel in owned:
            continue
        read = _kind_reads(path, sections)
        if read:
            outside.append(f"{rel}: {sorted(read)}")
    assert outside == []


def test_the_recipe_never_asks_which_teacher_it_holds():
    """The recipe names no kind's section, teacher class or source, read from the registry."""
    from kd.config import teacher_kinds as kinds

    recipe = (SRC / "recipes" / "kd.py").read_text()
    names = {"store_format", "store_manifest", "store_reader", "store_writer", "store_folder"}
    names |= {"foreign_store", "is_hf_model"}
    for kind in kinds.kinds():
        names.add(kind.teacher.rpartition(".")[2])
        if kind.section is not None:
            names.add(f"run.{kind.section}")
    for name in sorted(names):
        assert name not in recipe, name
    assert (
        _kind_reads(SRC / "recipes" / "kd.py", {k.section for k in kinds.kinds()} - {None}) == set()
    )


def test_the_store_has_one_name():
    """The files of top-k log-probs are "the store" (kd's: StoreReader; axolotl / DistillKit
    files: kd.teachers.foreign_store, ForeignStoreReader; either: StoreFile): the old "logits"
    names of its reader classes and module are gone from the code and the docs (the config key
    ``teacher_logits`` and the recipe of that name stay)."""
    old = ("TeacherLogitsReader", "TeacherLogitsFile", "ForeignLogitsReader", "foreign_logits")
    root = SRC.parents[1]
    found = [
        f"{path.relative_to(root)}: {name}"
        for path in [*SRC.rglob("*.py"), *(root / "docs").glob("*.md"), root / "README.md"]
        for name in old
        if name in path.read_text()
    ]
    assert found == []


def test_the_ce_kd_mix_is_written_once():
    """``(1 - r) * CE + r * KD`` is kd.losses.mix_ce_kd; signals, the fused losses and the
    evaluation call it (a second copy could drift from it)."""
    import re

    mix = re.compile(r"\(1(\.0)? - [\w.]*kd_ratio\) \* \w+ \+ [\w.]*kd_ratio \* \w+")
    found = []
    for path in SRC.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if mix.search(code) and "``" not in code and '"' not in code:
                found.append(f"{path.relative_to(SRC)}:{n}")
    assert [f.split(":")[0] for f in found] == ["losses/divergences.py"]


def test_the_member_keys_of_several_teachers_are_the_member_kinds_sections():
    """A member of ``teachers:`` holds the section of a kind declared ``member=True`` (or a
    local teacher_model): kd.config.teachers' key list and the registry agree."""
    from kd.config import teacher_kinds as kinds
    from kd.config.teachers import TEACHER_KEYS

    sections = {k.section or "teacher_model" for k in kinds.kinds() if k.member}
    assert sections | {"teacher_checkpointer"} == set(TEACHER_KEYS)


def test_the_registry_imports_no_torch():
    """kd validate and kd plan read the registry before any torch import (fast errors)."""
    import subprocess
    import sys

    code = "import sys, kd.config.teacher_kinds, kd.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class _Counting(Teacher):
    """A teacher with state: the optimizer steps it has seen."""

    def __init__(self, steps: int = 0):
        self.steps = steps

    def after_step(self, step: int) -> None:
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))


def test_teachers_made_of_teachers_pass_the_step_and_the_state_on():
    """Several teachers and a hidden-state teacher hand after_step, state_dict and
    load_state_dict to the teachers they hold; a teacher without state saves {}."""
    from kd.config.teacher_kinds.hidden_states import HiddenStateSettings
    from kd.teachers.hidden_states import HiddenStateTeacher
    from kd.teachers.multi import MultiTeacher

    a, b = _Counting(), _Counting(5)
    plain = FixedTopKTeacher(torch.zeros(1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1))
    multi = MultiTeacher([a, b, plain], names=["a", "b", "c"], weights=[1, 1, 1], combine="weights")
    multi.after_step(1)
    assert (a.steps, b.steps) == (1, 6)
    assert multi.state_dict() == {"a": {"steps": 1}, "b": {"steps": 6}}
    fresh = [_Counting(), _Counting(), plain]
    again = MultiTeacher(fresh, names=["a", "b", "c"], weights=[1, 1, 1], combine="weights")
    again.load_state_dict(multi.state_dict())
    assert [t.steps for t in fresh[:2]] == [1, 6]

    inner = ModelTeacher(tiny_hidden_decoder())
    hidden = HiddenStateTeacher(inner, HiddenStateSettings(layer_map=("0:0",)))
    assert hidden.state_dict() == {} and plain.state_dict() == {}
    counting = _Counting(2)
    hidden.inner = counting  # the wrapped teacher's hooks are the ones called
    hidden.after_step(3)
    assert hidden.state_dict() == {"steps": 3}
    hidden.load_state_dict({"steps": 7})
    assert counting.steps == 7
