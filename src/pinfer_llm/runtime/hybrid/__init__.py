"""GPU + CPU: where each part of the model runs (placement.py), which device runs it (devices.py), and the executor
that splits each layer between them (executor.py). The kernels themselves are in runtime/gpu/."""
