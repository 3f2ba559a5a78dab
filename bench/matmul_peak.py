"""The device's bf16 matmul ceiling (8192^3, median of 20), the denominator of every MFU figure.

    python bench/matmul_peak.py

Printed beside every GPU run's figures (``bench/gpu.sh``), so that MFU measured on an H100 and on an
H200 can each be read against the card they ran on (train_bench reports ``mfu_vs_790``,
the H200 figure).
"""

import json
import statistics

import torch


def main(n: int = 8192, reps: int = 20) -> None:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    med = statistics.median(times)
    print(json.dumps({"device": torch.cuda.get_device_name(), "matmul_bf16_tflops": round(2 * n**3 / med / 1e12, 1)}))


if __name__ == "__main__":
    main()
