#!/usr/bin/env bash
# Download, as wheels, what scripts/gpu_check.py needs beyond a CUDA image's own packages
# (torch, transformers, peft, safetensors, pyarrow and accelerate are there; torchtune, torchao,
# omegaconf, trl and datasets are not), for a machine with no network and no package index.
#
#   scripts/gpu_wheels.sh [DEST]        # default .whl/gpu (ignored by git), about 24 MiB
#
# On the GPU machine (python 3.12, x86-64), install them beside the image's packages:
#   pip install --no-deps --no-index --target .whl/site .whl/gpu/*.whl
#   PYTHONPATH=$PWD/.whl/site:$PWD/src python scripts/gpu_check.py --out $OUT
# The pins are kd's (pyproject.toml): peft < 0.19 (0.19+ refuses torchao < 0.16, which torchtune
# 0.6.1 needs) and transformers 5.24 (the version kd is tested with here; the image's may be older).
set -euo pipefail
dest=${1:-.whl/gpu}
py=${GPU_PYTHON_VERSION:-3.12}
mkdir -p "$dest"
pip download --no-deps --only-binary=:all: -d "$dest" --python-version "$py" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  "torchtune==0.6.1" "torchao==0.15.0" "omegaconf==2.4.0" "antlr4-python3-runtime==4.13.2" \
  "trl==1.16.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "peft==0.18.1" \
  "transformers==5.24.0"
size=$(du -sm "$dest" | cut -f1)
echo "wheels in $dest: ${size} MiB"
if [ "$size" -gt 40 ]; then
  echo "more than 40 MiB of wheels: the device machine's transfer limit is tight" >&2
  exit 1
fi
