"""A short run of every CUDA operator and one FP8 Linear training step, for compute-sanitizer.

    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 scripts/sanitize_ops.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_ops.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python3 scripts/sanitize_ops.py

Sizes are small (the tools slow kernels down a hundredfold) but cover the kernels' paths:
vectorised and scalar casts, odd shapes, non-contiguous and misaligned views, empty tensors,
the fused transpose's partial tiles, many-tensor updates, the cuBLASLt GEMM with bias, and the
fused norm / activation / dbias operators (vector and one-element paths, wide rows, padding).
scripts/gpu_check.sh runs it under all three tools.
"""
import torch

import transformer_fp8 as tfp8
from transformer_fp8 import fused_ops, ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def run_fused_ops(dev: str, scale: torch.Tensor) -> None:
    """Every fused operator with every option: 4-element and one-element paths (cols 64 / 37,
    a misaligned view), rows wider than the register cache, padding, empty inputs."""
    shapes = [(0, 16), (1, 8), (5, 37), (70, 64), (3, 20001)]
    for (rows, cols) in shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(rows, cols, device=dev).to(dtype)
            w = torch.randn(cols, device=dev)
            amax = torch.zeros(1, device=dev)
            for rm in (1, 16):
                out = fused_ops.layernorm_fwd_fp8(x, w, w.to(dtype), 1e-5, True, scale, E4M3,
                                                  amax, True, True, rm)
                fused_ops.layernorm_bwd(x, x, out[3], out[4], w, True)
                out = fused_ops.rmsnorm_fwd_fp8(x, w, 1e-5, False, scale, E5M2, None, False,
                                                False, rm)
                fused_ops.rmsnorm_bwd(x, x, out[3], w.to(dtype))
                fused_ops.cast_transpose_dbias(x, scale, E4M3, amax, rm)
            fused_ops.layernorm_fwd(x, w, None, 1e-5)
            fused_ops.rmsnorm_fwd(x, w, 1e-5)
            for act in fused_ops.ACTIVATIONS:
                if act in fused_ops.GATED_ACTIVATIONS and cols % 2:
                    continue
                y = fused_ops.activation_fwd(x, act)
                fused_ops.activation_fwd_fp8(x, act, scale, E4M3, amax, True, 16)
                fused_ops.activation_bwd(y, x, act)
                fused_ops.activation_bwd_fp8(y, x, act, scale, E5M2, amax, True, True, 16)
    flat = torch.randn(1 + 9 * 64, device=dev, dtype=torch.bfloat16)
    x = flat[1:].view(9, 64)                                       # misaligned start
    fused_ops.layernorm_fwd_fp8(x, torch.ones(64, device=dev), None, 1e-5, False, scale, E4M3,
                                None, True, True, 16)
    fused_ops.activation_bwd_fp8(x[:, :32].contiguous(), x, "swiglu", scale, E4M3, None, True,
                                 True, 16)


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    dev = "cuda"
    torch.manual_seed(0)
    scale = torch.tensor([2.0], device=dev)
    for shape in [(0,), (1,), (7,), (4096,), (33, 65), (128, 256), (1000, 24), (3, 5, 17)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(shape, device=dev).to(dtype)
            amax = torch.zeros(1, device=dev)
            ops.amax(x)
            y = ops.cast_to_fp8(x, scale, E4M3, amax)
            ops.cast_from_fp8(y, scale, dtype)
            ops.cast_to_fp8(x, scale, E5M2)
            if x.dim() == 2:
                ops.cast_transpose_to_fp8(x, scale, E4M3, amax)
                ops.cast_transpose_to_fp8(x.t(), scale, E5M2)       # non-contiguous
    flat = torch.randn(4099, device=dev, dtype=torch.bfloat16)
    ops.cast_to_fp8(flat[1:], scale, E4M3, torch.zeros(1, device=dev))  # misaligned start
    ops.cast_transpose_to_fp8(flat[3:3 + 64 * 63].view(64, 63), scale, E4M3)
    x = torch.tensor([0.0, 1e-30, 1e30, float("inf"), -float("inf"), float("nan")], device=dev)
    ops.cast_to_fp8(x, scale, E4M3, torch.zeros(1, device=dev))

    # Delayed scaling: many tensors of several widths, then current scaling.
    hist = [torch.rand(16, n, device=dev) for n in (1, 2, 3, 5)] * 1
    scales = [torch.ones(h.shape[1], device=dev) for h in hist]
    invs = [torch.ones(h.shape[1], device=dev) for h in hist]
    for algo in ("max", "most_recent"):
        ops.update_delayed_scaling(hist, scales, invs, [448.0, 57344.0, 448.0, 448.0], 0, algo)
    many = [torch.rand(1024, 3, device=dev) for _ in range(300)]
    ops.update_delayed_scaling(many, [torch.ones(3, device=dev) for _ in many],
                               [torch.ones(3, device=dev) for _ in many], [448.0] * 300, 1)
    ops.compute_scale_from_amax(torch.rand(7, device=dev), 448.0, 0)

    # GEMMs: output dtypes, bias, fast accumulation, a misaligned operand view.
    for m, n, k in [(16, 16, 16), (48, 32, 80), (256, 128, 512)]:
        a = ops.cast_to_fp8(torch.randn(m, k, device=dev), scale, E4M3)
        b = ops.cast_to_fp8(torch.randn(n, k, device=dev), scale, E4M3)
        g = ops.cast_to_fp8(torch.randn(n, k, device=dev), scale, E5M2)
        for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
            bias = torch.randn(n, device=dev, dtype=out_dtype)
            ops.fp8_gemm(a, scale, b, scale, out_dtype, bias, True)
            ops.fp8_gemm(a, scale, g, scale, out_dtype)
    flat8 = ops.cast_to_fp8(torch.randn(32 * 16 + 1, device=dev), scale, E4M3)
    ops.fp8_gemm(flat8[1:].view(32, 16), scale, flat8[1:257].view(16, 16), scale,
                 torch.bfloat16)                                   # misaligned operand views

    run_fused_ops(dev, scale)

    # Two training steps of an FP8 Linear stack (forward, backward, both scale updates).
    model = torch.nn.Sequential(tfp8.Linear(64, 128), torch.nn.GELU(),
                                tfp8.Linear(128, 32)).to(dev, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    recipe = tfp8.DelayedScaling(amax_history_len=8)
    for _ in range(2):
        x = torch.randn(50, 64, device=dev, dtype=torch.bfloat16)
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    print("sanitize_ops: every operator ran")


if __name__ == "__main__":
    main()
