"""lightning_bamboo: pipeline-parallel training on preemptible machines."""
