"""Make a student from a Hugging Face causal LM by dropping every third decoder layer (SmolLM2-135M:
30 -> 20 layers), a common initialisation for a distilled student (docs/your_own_models.md).

    python scripts/make_layer_dropped_student.py SRC_FOLDER DEST_FOLDER
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

src, dest = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
keep = [i for i in range(model.config.num_hidden_layers) if i % 3 != 2]
model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in keep)
model.config.num_hidden_layers = len(keep)
model.save_pretrained(dest)
AutoTokenizer.from_pretrained(src).save_pretrained(dest)
n = sum(p.numel() for p in model.parameters()) / 1e6
print(f"student: {len(keep)} of 30 layers, {n:.1f}M parameters -> {dest}")
