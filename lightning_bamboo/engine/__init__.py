"""engine: the pipeline engine and its communication (imports torch and DeepSpeed).

Before any of it loads DeepSpeed, a machine where torch sees no GPU names the CPU for DeepSpeed, so
that its "Setting accelerator to CPU" warning is not printed once per process
(``logs.choose_deepspeed_accelerator``).
"""

from lightning_bamboo.logs import choose_deepspeed_accelerator

choose_deepspeed_accelerator()
