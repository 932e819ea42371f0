"""kd.models: output projection access, the hidden-state forward, LoRA handling, weight loading,
activation checkpointing, RoPE buffers and the tokenizer/vocabulary checks, on tiny torchtune
Qwen2 decoders."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kd import _torchtune as tt
from kd import models
from kd.errors import KDUserError
from tests.conftest import MAX_SEQ_LEN, write_tokenizer

VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=64,
    intermediate_dim=128,
    max_seq_len=64,
)
LORA = dict(
    lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8
)


def plain(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return tt.qwen2(**{**SHAPE, **kw})


def lora(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return tt.lora_qwen2(**{**SHAPE, **LORA, **kw})


def tokens(b: int = 2, s: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# --- output projection ------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_output_weight_and_vocab_size(tied):
    m = plain(tie_word_embeddings=tied)
    w = models.output_weight(m)
    assert w.shape == (VOCAB, SHAPE["embed_dim"])
    assert models.vocab_size(m) == VOCAB
    if tied:
        assert w is m.tok_embeddings.weight
    else:
        assert w is m.output.weight
        assert w is not m.tok_embeddings.weight
    assert models.has_plain_output(m)


def test_lora_output_weight_and_plain_output():
    m = lora()
    assert models.has_plain_output(m)  # the output projection itself has no adapter
    assert models.vocab_size(m) == VOCAB
    adapted = lora(apply_lora_to_output=True)
    assert isinstance(adapted.output, tt.LoRALinear)
    assert not models.has_plain_output(adapted)
    # The base weight of the LoRA projection, not an adapter matrix.
    assert models.output_weight(adapted) is adapted.output.weight
    assert models.vocab_size(adapted) == VOCAB


# --- hidden-state forward ---------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_set_hidden_output_and_logits_from_hidden(tied):
    m = plain(tie_word_embeddings=tied).eval()
    x = tokens()
    with torch.no_grad():
        logits = m(x)
        models.set_hidden_output(m)
        hidden = m(x)
        assert hidden.shape == (2, 10, SHAPE["embed_dim"])
        from_hidden = models.logits_from_hidden(m, hidden)
        assert from_hidden.dtype == torch.float32
        torch.testing.assert_close(from_hidden, logits.float(), rtol=1e-6, atol=1e-6)
        # The hidden states are the final-norm output the projection consumes.
        torch.testing.assert_close(hidden @ models.output_weight(m).T, logits, rtol=1e-5, atol=1e-5)
        models.set_hidden_output(m, enabled=False)
        torch.testing.assert_close(m(x), logits, rtol=0, atol=0)
        models.set_hidden_output(m, enabled=False)  # disabling twice is harmless
        assert m(x).shape == (2, 10, VOCAB)


def test_set_hidden_output_is_per_instance():
    a, b = plain(), plain()
    models.set_hidden_output(a)
    with torch.no_grad():
        assert a(tokens()).shape[-1] == SHAPE["embed_dim"]
        assert b(tokens()).shape[-1] == VOCAB


def test_logits_from_hidden_lora_output_uses_adapter():
    m = lora(apply_lora_to_output=True).eval()
    with torch.no_grad():
        m.output.lora_b.weight.normal_()  # nonzero adapter: logits differ from the base projection
        logits = m(tokens())
        models.set_hidden_output(m)
        hidden = m(tokens())
        from_hidden = models.logits_from_hidden(m, hidden)
    torch.testing.assert_close(from_hidden, logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hidden @ models.output_weight(m).T, logits, atol=1e-3)


# --- LoRA, freezing ---------------------------------------------------------------------------


def test_is_lora():
    assert not models.is_lora(plain())
    assert models.is_lora(lora())
    assert models.is_lora(tt.lora_qwen2(**{**SHAPE, **LORA, "lora_attn_modules": ["v_proj"]}))


def test_freeze():
    m = plain().train()
    out = models.freeze(m)
    assert out is m
    assert not m.training
    assert all(not mod.training for mod in m.modules())
    assert all(not p.requires_grad for p in m.parameters())


def test_setup_lora_trainable_only_adapters():
    m = lora()
    models.setup_lora_trainable(m)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert trainable and frozen
    assert all(".lora_a." in n or ".lora_b." in n for n in trainable)
    # Every adapter trains: 2 attention projections + 3 MLP linears per layer, a and b each.
    assert len(trainable) == SHAPE["num_layers"] * (2 + 3) * 2
    assert "tok_embeddings.weight" in frozen and "layers.0.attn.q_proj.weight" in frozen
    # Gradients reach only the adapters.
    m(tokens()).sum().backward()
    assert all((p.grad is not None) == (n in trainable) for n, p in m.named_parameters())


# --- load_weights -----------------------------------------------------------------------------


def test_load_weights_full_exact():
    src, dst = plain(seed=1), plain(seed=2)
    state = src.state_dict()
    models.load_weights(dst, state, lora=False, source="checkpointer")
    for k, v in dst.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


@pytest.mark.parametrize("source", ["checkpointer", "teacher_checkpointer"])
def test_load_weights_missing_key(source):
    state = plain(seed=1).state_dict()
    del state["layers.1.mlp.w2.weight"]
    with pytest.raises(KDUserError) as err:
        models.load_weights(plain(), state, lora=False, source=source)
    msg = str(err.value)
    assert msg.startswith(f"{source}: the checkpoint does not match the model builder")
    assert "layers.1.mlp.w2.weight" in msg
    assert f"{source}.checkpoint_dir" in msg
    assert "\n" not in msg


def test_load_weights_unexpected_key_and_wrong_shape():
    state = plain(seed=1).state_dict()
    state["layers.2.attn.q_proj.weight"] = torch.zeros(64, 64)  # a third layer
    with pytest.raises(KDUserError, match=r"teacher_checkpointer: .*layers\.2\.attn\.q_proj"):
        models.load_weights(plain(), state, lora=False, source="teacher_checkpointer")
    bigger = plain(seed=1, vocab_size=VOCAB + 32).state_dict()
    with pytest.raises(KDUserError, match=r"checkpointer: .*tok_embeddings\.weight"):
        models.load_weights(plain(), bigger, lora=False, source="checkpointer")


def test_load_weights_lora_partial():
    base = plain(seed=1).state_dict()
    student = lora(seed=2)
    adapters_before = {n: p.detach().clone() for n, p in student.named_parameters() if "lora_" in n}
    assert adapters_before
    models.load_weights(student, base, lora=True, source="checkpointer")
    loaded = student.state_dict()
    for k, v in base.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    for n, v in adapters_before.items():  # adapters keep their init
        torch.testing.assert_close(loaded[n], v, rtol=0, atol=0)
    # A fresh LoRA model (lora_b = 0) with these base weights computes what the base model does.
    ref = plain()
    ref.load_state_dict(base)
    with torch.no_grad():
        torch.testing.assert_close(student(tokens()), ref(tokens()), rtol=1e-5, atol=1e-5)


def test_load_weights_lora_still_checks_base_keys():
    base = plain(seed=1).state_dict()
    missing = {k: v for k, v in base.items() if k != "norm.scale"}
    with pytest.raises(KDUserError, match=r"checkpointer: .*missing \['norm\.scale'\]"):
        models.load_weights(lora(), missing, lora=True, source="checkpointer")
    extra = {**base, "layers.0.attn.q_proj.scale": torch.zeros(64)}
    with pytest.raises(KDUserError, match=r"unexpected \['layers\.0\.attn\.q_proj\.scale'\]"):
        models.load_weights(lora(), extra, lora=True, source="checkpointer")
    # A full (non-LoRA) load of a base-only state dict into a LoRA model is a mismatch.
    with pytest.raises(KDUserError, match="lora_a"):
        models.load_weights(lora(), base, lora=False, source="checkpointer")


# --- activation checkpointing -----------------------------------------------------------------


@pytest.mark.parametrize("make", [plain, lora], ids=["full", "lora"])
def test_activation_checkpointing_same_outputs_and_grads(make):
    ref, ckpt = make(seed=3), make(seed=4)
    ckpt.load_state_dict(ref.state_dict())
    models.enable_activation_checkpointing(ckpt)
    wrapped = [m for m in ckpt.modules() if type(m).__name__ == "CheckpointWrapper"]
    assert len(wrapped) == SHAPE["num_layers"]
    # The wrapper's state-dict hooks keep the key names, so checkpoints load unchanged.
    assert set(ckpt.state_dict()) == set(ref.state_dict())

    # Count the MLP's forward calls (forward hooks do not fire during the recompute).
    calls = []
    mlp = wrapped[0]._checkpoint_wrapped_module.mlp
    mlp_forward = mlp.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return mlp_forward(*args, **kwargs)

    mlp.forward = counted

    x = tokens(seed=5)
    out_ref, out_ckpt = ref(x), ckpt(x)
    torch.testing.assert_close(out_ckpt, out_ref, rtol=0, atol=0)
    assert len(calls) == 1
    (out_ref.float() ** 2).mean().backward()
    (out_ckpt.float() ** 2).mean().backward()
    assert len(calls) == 2  # the layer was recomputed in backward

    def grads(m: nn.Module) -> dict[str, torch.Tensor]:
        return {
            n.replace("_checkpoint_wrapped_module.", ""): p.grad
            for n, p in m.named_parameters()
            if p.grad is not None
        }

    g_ref, g_ckpt = grads(ref), grads(ckpt)
    assert g_ref.keys() == g_ckpt.keys() and g_ref
    for n, g in g_ref.items():
        torch.testing.assert_close(g_ckpt[n], g, rtol=1e-6, atol=1e-7, msg=n)


# --- buffers ----------------------------------------------------------------------------------


def test_reset_rope_buffers_after_to_empty():
    ref = plain()
    caches = {n: b.clone() for n, b in ref.named_buffers() if n.endswith("cache")}
    assert caches
    with torch.device("meta"):
        m = tt.qwen2(**SHAPE)
    m.to_empty(device="cpu")
    for n, b in m.named_buffers():
        if n in caches:
            b.fill_(float("nan"))
    models.reset_rope_buffers(m)
    got = dict(m.named_buffers())
    for n, b in caches.items():
        torch.testing.assert_close(got[n], b, rtol=0, atol=0)


def test_unrecomputable_buffers():
    m = plain()
    assert models.unrecomputable_buffers(m) == {}  # only RoPE caches are non-persistent
    m.layers[1].mlp.register_buffer("mask", torch.ones(3), persistent=False)
    m.register_buffer("top", torch.ones(1), persistent=False)
    m.layers[0].register_buffer("saved", torch.ones(1))  # persistent: in the state dict
    assert sorted(models.unrecomputable_buffers(m)) == ["layers.1.mlp.mask", "top"]


# --- dtype ------------------------------------------------------------------------------------


def test_default_dtype_builds_in_dtype_and_restores():
    before = torch.get_default_dtype()
    with models.default_dtype(torch.bfloat16):
        m = tt.qwen2(**SHAPE)
        assert torch.get_default_dtype() == torch.bfloat16
    assert torch.get_default_dtype() == before
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="boom"), models.default_dtype(torch.float64):
        raise ValueError("boom")
    assert torch.get_default_dtype() == before
    assert models.DTYPES == {"bf16": torch.bfloat16, "fp32": torch.float32}


# --- tokenizer and vocabulary -----------------------------------------------------------------


def test_tokenizer_max_id_qwen(tmp_path):
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    tok_dir = write_tokenizer(tmp_path / "tok")
    tok = qwen2_5_tokenizer(
        path=str(tok_dir / "vocab.json"),
        merges_file=str(tok_dir / "merges.txt"),
        special_tokens_path=str(tok_dir / "tokenizer.json"),
        max_seq_len=MAX_SEQ_LEN,
    )
    # 256 byte tokens, then the special tokens from 256 on.
    assert models.tokenizer_max_id(tok) == 256 + len(tt.QWEN2_5_SPECIAL_TOKENS) - 1


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_tokenizer_max_id_sources():
    tiktoken_like = _Obj(
        tt_model=_Obj(tt_model=_Obj(n_vocab=1000)), special_tokens={"<|end|>": 1005}
    )
    assert models.tokenizer_max_id(tiktoken_like) == 1005
    assert models.tokenizer_max_id(_Obj(tt_model=_Obj(tt_model=_Obj(n_vocab=1000)))) == 999
    assert models.tokenizer_max_id(_Obj(vocab_size=32000)) == 31999
    assert models.tokenizer_max_id(_Obj(encoder={"a": 3, "b": 7}, special_tokens={})) == 7
    with pytest.raises(KDUserError, match="^tokenizer: cannot read its vocabulary size"):
        models.tokenizer_max_id(_Obj(encoder={}, vocab_size="many"))


def test_check_vocab_padded_vocabularies():
    # Qwen2.5 style: teacher padded larger than the student; every id fits both.
    assert (
        models.check_vocab(tokenizer_max=151664, student_vocab=151936, teacher_vocab=152064) == []
    )
    assert models.check_vocab(tokenizer_max=277, student_vocab=288, teacher_vocab=None) == []
    # Boundary: the largest id must be a row, so id == vocab rows is out of range.
    assert models.check_vocab(tokenizer_max=287, student_vocab=288, teacher_vocab=288) == []

    beyond_student = models.check_vocab(tokenizer_max=288, student_vocab=288, teacher_vocab=320)
    assert len(beyond_student) == 1
    assert beyond_student[0].startswith("tokenizer: emits ids up to 288 but the student (model)")

    beyond_teacher = models.check_vocab(tokenizer_max=300, student_vocab=320, teacher_vocab=288)
    assert len(beyond_teacher) == 1
    assert "the teacher (teacher_model) has only 288 vocab rows" in beyond_teacher[0]

    both = models.check_vocab(tokenizer_max=400, student_vocab=320, teacher_vocab=288)
    assert len(both) == 2
    assert "student (model)" in both[0] and "teacher (teacher_model)" in both[1]
    assert models.check_vocab(tokenizer_max=400, student_vocab=320, teacher_vocab=None) == [both[0]]


def _tokenizer_node(tok_dir) -> dict:
    return {
        "_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
        "path": str(tok_dir / "vocab.json"),
        "merges_file": str(tok_dir / "merges.txt"),
        "special_tokens_path": str(tok_dir / "tokenizer.json"),
        "max_seq_len": MAX_SEQ_LEN,
    }


def _build_tokenizer(node: dict):
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    try:
        return qwen2_5_tokenizer(**{k: v for k, v in node.items() if k != "_component_"})
    except Exception as e:  # what kd.config.instantiate.build_component does
        raise KDUserError(f"tokenizer: failed ({e})") from e


def test_tokenizer_files_are_the_arguments_naming_files(tmp_path):
    node = _tokenizer_node(write_tokenizer(tmp_path / "tok"))
    node["merges_file"] = str(tmp_path / "absent.txt")
    files = models.tokenizer_files(node)
    assert files == {
        "tokenizer.path": tmp_path / "tok" / "vocab.json",
        "tokenizer.special_tokens_path": tmp_path / "tok" / "tokenizer.json",
    }
    assert models.tokenizer_files({}) == {}


def test_checked_tokenizer_builds_and_encodes(tmp_path):
    node = _tokenizer_node(write_tokenizer(tmp_path / "tok"))
    tok = models.checked_tokenizer(lambda: _build_tokenizer(node), models.tokenizer_files(node))
    assert tok.encode(models.TOKENIZER_PROBE, add_bos=False, add_eos=False)


def test_checked_tokenizer_blames_the_damaged_file(tmp_path):
    tok_dir = write_tokenizer(tmp_path / "tok")
    node = _tokenizer_node(tok_dir)
    files = models.tokenizer_files(node)

    def never() -> None:
        raise AssertionError("an empty file is found before the builder runs")

    (tok_dir / "merges.txt").write_text("")
    with pytest.raises(KDUserError) as e:
        models.checked_tokenizer(never, files)
    assert str(e.value) == (
        f"tokenizer.merges_file: {tok_dir / 'merges.txt'} is empty; restore the tokenizer files "
        "from the model's source"
    )
    write_tokenizer(tok_dir)
    (tok_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(KDUserError, match=r"^tokenizer.special_tokens_path: .* is not valid JSON"):
        models.checked_tokenizer(lambda: _build_tokenizer(node), files)
    write_tokenizer(tok_dir)

    def fails() -> None:
        raise KDUserError("tokenizer: failed (its own reason)")

    # No file explains the failure: the builder's error is the one reported.
    with pytest.raises(KDUserError, match=r"^tokenizer: failed \(its own reason\)$"):
        models.checked_tokenizer(fails, files)


def test_checked_tokenizer_that_maps_text_to_no_id(tmp_path):
    class Cut:
        def encode(self, text):
            return [None]

    files = {"tokenizer.path": tmp_path / "vocab.json"}
    with pytest.raises(KDUserError) as e:
        models.checked_tokenizer(Cut, files)
    assert str(e.value).startswith(
        f"tokenizer: maps parts of {models.TOKENIZER_PROBE!r} to no token id (None)"
    )
    assert str(e.value).endswith(
        f"restore tokenizer.path ({tmp_path / 'vocab.json'}) from the model's source"
    )
    with pytest.raises(KDUserError, match="restore the tokenizer files from"):
        models.checked_tokenizer(Cut, {})


def test_load_checkpointer_weights(tmp_path):
    source, model = plain(seed=1), plain(seed=2)

    class Checkpointer:
        def __init__(self, state):
            self.state = state

        def load_checkpoint(self):
            if isinstance(self.state, Exception):
                raise self.state
            return {models.MODEL_KEY: self.state}

    models.load_checkpointer_weights(
        model, lambda: Checkpointer(source.state_dict()), key="checkpointer", folder="/models/s"
    )
    assert torch.equal(model.output.weight, source.output.weight)
    with pytest.raises(KDUserError) as e:
        models.load_checkpointer_weights(
            model,
            lambda: Checkpointer(ValueError("header too large")),
            key="teacher_checkpointer",
            folder="/models/t",
        )
    assert str(e.value) == (
        "teacher_checkpointer: cannot load the weights in /models/t (ValueError: header too "
        "large); check that teacher_checkpointer.checkpoint_files are complete safetensors of the "
        "model its builder names (re-download truncated files)"
    )
    # The builder's and load_weights' own errors pass as they are.
    with pytest.raises(KDUserError, match="^checkpointer: the checkpoint does not match"):
        models.load_checkpointer_weights(
            model, lambda: Checkpointer({}), key="checkpointer", folder="/models/s"
        )
