"""Dense bf16 tensor-core peaks of the GPUs whose model FLOP utilisation (MFU) the benchmarks report: a small module of
its own, so that gpu_check.py reads them without importing bench.py's torchvision and recipes."""

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16 tensor-core peaks from NVIDIA's data sheets


def peak_tflops(device_name: str) -> float | None:
    """The peak of a device named as torch or nvidia-smi name it ("NVIDIA H100 80GB HBM3"); None when not listed."""
    return next((value for key, value in PEAK_TFLOPS.items() if key in device_name), None)
