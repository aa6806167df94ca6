"""Small built-in models: the GPT example, used by the examples, the demo and the planner."""

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss

__all__ = ["GPTConfig", "gpt_layers", "gpt_loss"]
