"""A short run of every CUDA operator and one FP8 Linear training step, for compute-sanitizer.

    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 scripts/sanitize_ops.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_ops.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python3 scripts/sanitize_ops.py

Sizes are small (the tools slow kernels down a hundredfold) but cover the kernels' paths:
vectorised and scalar casts, odd shapes, non-contiguous and misaligned views, empty tensors,
the fused transpose's partial tiles, many-tensor updates, the cuBLASLt GEMM with bias, the
fused norm / activation / dbias operators (vector and one-element paths, wide rows, padding),
block-scaled quantisation and GEMMs (every mode pair, partial edge blocks; the 1x128
quantisation with the transpose under both of its kernels,
TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL=registers and =staged), and training steps of Linear,
LayerNormMLP and TransformerLayer.
scripts/gpu_check.sh runs it under all three tools.
"""
import os

import torch

import transformer_fp8 as tfp8
from transformer_fp8 import _C, blockwise_ops, fused_ops, ops

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


def run_blockwise_ops(dev: str) -> None:
    """Block-scaled quantisation (1x128, 128x128, row-wise; with transposes; partial edge
    blocks; the fused 1x128 + transpose kernel's vector and scalar paths, every input dtype, a
    misaligned view) and the cuBLASLt block-scaled GEMM for every mode pair it runs."""
    for rows, cols in [(0, 128), (1, 16), (33, 200), (256, 384), (129, 257), (128, 1), (300, 5)]:
        x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
        for block in ((1, 128), (128, 128), (1, -1)):
            blockwise_ops.quantize_blockwise(x, *block, E4M3, True, True)
            blockwise_ops.quantize_blockwise(x.t(), *block, E5M2, False, False)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(144, 264, device=dev, dtype=dtype)
        blockwise_ops.quantize_blockwise(x, 1, 128, E4M3, True, True)
    flat = torch.randn(1 + 160 * 256, device=dev, dtype=torch.bfloat16)
    blockwise_ops.quantize_blockwise(flat[1:].view(160, 256), 1, 128, E5M2, False, True)
    modes = {"1x128": (1, 128), "128x128": (128, 128), "rowwise": (1, -1)}
    pairs = [("1x128", "1x128"), ("1x128", "128x128"), ("128x128", "1x128"),
             ("rowwise", "rowwise")]
    for m, n, k in [(128, 256, 384), (48, 32, 208)]:
        a = torch.randn(m, k, device=dev)
        b = torch.randn(n, k, device=dev)
        for mode_a, mode_b in pairs:
            a8, a_si, _, _ = blockwise_ops.quantize_blockwise(a, *modes[mode_a], E4M3)
            b8, b_si, _, _ = blockwise_ops.quantize_blockwise(b, *modes[mode_b], E4M3)
            blockwise_ops.fp8_gemm_blockwise(a8, a_si, b8, b_si, torch.bfloat16,
                                             torch.randn(n, device=dev, dtype=torch.bfloat16))


def run_1x128_with_transpose(dev: str, kernel: str) -> None:
    """The fused 1x128 quantisation with the transpose under one of its kernels
    (blockwise_transpose.cu): partial tiles, vector and element-by-element paths, every input
    dtype and FP8 format, a misaligned view."""
    os.environ["TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL"] = kernel
    assert _C._reread_blockwise_transpose_kernel() == kernel
    for rows, cols in [(1, 16), (33, 200), (256, 384), (129, 257), (128, 1), (300, 5)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(rows, cols, device=dev, dtype=dtype)
            blockwise_ops.quantize_blockwise(x, 1, 128, E4M3, True, True)
            blockwise_ops.quantize_blockwise(x, 1, 128, E5M2, False, True)
    for dtype in (torch.bfloat16, torch.float16):
        flat = torch.randn(1 + 160 * 256, device=dev, dtype=dtype)
        blockwise_ops.quantize_blockwise(flat[1:].view(160, 256), 1, 128, E4M3, True, True)


def train_steps(model, inputs, recipe, steps: int = 2) -> None:
    """Forward under fp8_autocast, backward, optimizer step: both scale updates run."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        with tfp8.fp8_autocast(fp8_recipe=recipe):
            loss = model(inputs).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


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

    # Training steps: an FP8 Linear stack, the fused modules, a TransformerLayer, and the
    # block-scaled recipe (forward, backward, both scale updates).
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    recipe = tfp8.DelayedScaling(amax_history_len=8)
    model = torch.nn.Sequential(tfp8.Linear(64, 128), torch.nn.GELU(),
                                tfp8.Linear(128, 32)).to(**bf16)
    train_steps(model, torch.randn(50, 64, **bf16), recipe)
    mlp = torch.nn.Sequential(
        tfp8.LayerNormLinear(64, 64, normalization="RMSNorm", params_dtype=torch.bfloat16,
                             device=dev),
        tfp8.LayerNormMLP(64, 96, activation="swiglu", params_dtype=torch.bfloat16,
                          device=dev))
    train_steps(mlp, torch.randn(50, 64, **bf16), recipe)
    train_steps(mlp, torch.randn(50, 64, **bf16), tfp8.Float8CurrentScaling())
    layer = tfp8.TransformerLayer(64, 128, 4, num_gqa_groups=2, hidden_dropout=0.0,
                                  attention_dropout=0.0, normalization="RMSNorm",
                                  activation="swiglu", params_dtype=torch.bfloat16, device=dev)
    # Attention through torch's math backend: cuDNN's fused SDPA kernels (torch's default here)
    # are reported by racecheck and synccheck (seen on an H200, 2026-11-26: 12 hazards and 256
    # barrier errors, all inside cudnn_generated_*_sdpa_* kernels; under synccheck the cuDNN
    # call then failed and ended the script). Those kernels are not ours to check.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        train_steps(layer, torch.randn(24, 2, 64, **bf16), recipe)
    run_blockwise_ops(dev)
    train_steps(model, torch.randn(50, 64, **bf16), tfp8.Float8BlockScaling())
    before = os.environ.get("TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL")
    for kernel in ("registers", "staged"):
        run_1x128_with_transpose(dev, kernel)
    os.environ.pop("TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL")
    if before is not None:
        os.environ["TRANSFORMER_FP8_BLOCKWISE_TRANSPOSE_KERNEL"] = before
    _C._reread_blockwise_transpose_kernel()
    torch.cuda.synchronize()
    print("sanitize_ops: every operator ran")


if __name__ == "__main__":
    main()
