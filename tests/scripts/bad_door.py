"""A DeepSpeed script with a bad ``"bamboo"`` section (``"redundancy": "sometimes"``), under the Bamboo launcher.
Used by tests/test_refusal.py."""

from __future__ import annotations

import sys
from pathlib import Path

from deepspeed.pipe import PipelineModule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from deepspeed_spot import Regression, layers  # noqa: E402

import lightning_bamboo  # noqa: E402

if __name__ == "__main__":
    lightning_bamboo.init_distributed()
    model = PipelineModule(layers=layers(), num_stages=2, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bamboo": {"redundancy": "sometimes"}}
    lightning_bamboo.initialize(model=model, model_parameters=list(model.parameters()), training_data=Regression(),
                                config=config)
    print("trained", flush=True)  # never reached
