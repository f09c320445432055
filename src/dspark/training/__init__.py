"""Training DSpark drafters, the demo target, STS calibration (issue 6).

* ``data``        corpora (text / directories / JSON Lines / the standard library's deterministic
                  train-valid-test split), BPE tokenizers, packing, held-out prompts, the demo pair;
* ``objective``   the DSpark loss: 0.1 CE + 0.9 TV + 1.0 BCE(confidence, 1 - TV), weights exp(-k/γ);
* ``trainer``     the drafter's training loop (batched blocks with the inference attention mask);
* ``distributed`` data parallelism under torchrun: process group, DDP / FSDP2, exact sharding;
* ``state``       the resumable training state (weights, optimizer, data position, generators);
* ``target_lm``   training a small Qwen3 target from scratch (``python -m dspark.training.target_lm``);
* ``calibration`` greedy rounds on held-out text, ECE / AUC per position, STS temperatures.

Submodules are imported on use (``from dspark.training.trainer import train_draft``), so that
``python -m dspark.training.<module>`` runs without importing its package twice.
"""
