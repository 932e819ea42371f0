"""What ``teacher_quantization: int8`` costs the teacher's signal, on your own rows.

Loads the config's teacher twice through kd's own loading path (the run's dtype, e.g. bf16, and
int8 weight-only through torchao, exactly as ``kd run`` would with ``teacher_quantization=int8``)
and compares their next-token distributions on the labelled positions of the config's validation
rows (``validation.dataset``; the training rows when the config has none): the mean KL divergence
from the unquantized teacher to the int8 one, and the share of positions whose top-1 token is the
same. Nothing is trained or written.

    python scripts/int8_teacher_report.py --config my_kd.yaml --rows 64 [key=value ...]

Prints one line (and ``--json`` a JSON object); exit status 2 on a config mistake.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    """Run the report; returns the exit status."""
    from kd.errors import KDUserError, brief

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the kd config (YAML)")
    p.add_argument("--rows", type=int, default=64, help="rows compared (the first ones)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    try:
        report = _report(args.config, args.overrides, args.rows)
    except KDUserError as e:
        print(f"int8_teacher_report: error: {brief(e)}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(report)) if args.json else report.line())
    return 0


def _report(config: str, overrides: list[str], rows: int) -> object:
    from kd.config import load_config, validate_config
    from kd.config.run import run_config
    from kd.errors import KDUserError
    from kd.recipes.kd import KDRecipe
    from kd.runtime.distributed import WorldInfo
    from kd.teachers.build import ModelTeacherSource
    from kd.teachers.quantize import signal_report

    if rows < 1:
        raise KDUserError("--rows: compare at least 1 row")
    scratch = tempfile.mkdtemp(prefix="kd_int8_report_")  # nothing is written; no output_dir check
    cfg = load_config(config, [*overrides, "teacher_quantization=none", f"output_dir={scratch}"])
    validate_config(cfg)
    run = run_config(cfg)
    if not run.has_teacher:
        raise KDUserError(
            "teacher_model: this config has no local teacher model to quantize; set "
            "teacher_model (and remove teacher_logits / teacher_server)"
        )
    recipe = KDRecipe(run, world=WorldInfo(world_size=1, rank=0, local_rank=0))
    recipe.preload()
    data = getattr(recipe, "val_dataset", None) or recipe.dataset
    picked = [data[i] for i in range(min(rows, len(data)))]
    ctx, facts = recipe.ctx, recipe.facts
    plain = run.with_section("hidden_states", None)  # teacher_quantization=none above
    reference = ModelTeacherSource(plain).load(ctx, facts).model
    int8 = dataclasses.replace(plain, teacher_quantization="int8")
    quantized = ModelTeacherSource(int8).load(ctx, facts).model
    return signal_report(
        reference,
        quantized,
        picked,
        temperature=run.loss.temperature,
        ignore_index=run.loss.ignore_index,
    )


if __name__ == "__main__":
    sys.exit(main())
