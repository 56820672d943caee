"""Supervised fine-tuning's core half, Ray-free: chat data read, tokenized, masked and ordered
into per-rank step shards (:mod:`.dataset`). The loop that steps the trainer through it is the
Ray layer's `actors/sft.py`."""
