"""Codecs of the formats' own bytes, without their frameworks: safetensors headers, torch.save
archives and pickles, PyTorch DCP and HyperParallel metadata classes, MindSpore `.ckpt` records.
Readers and writers in `hpckpt.converters` use them; nothing here knows the plan or the engine.
"""
