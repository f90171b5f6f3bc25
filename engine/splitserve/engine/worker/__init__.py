"""The worker: model runner, CUDA graphs, sampler, attention, fused ops, layers, loader, models, quantization."""
