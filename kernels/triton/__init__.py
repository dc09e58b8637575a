r"""Triton backend of the kernel primitives (docs/DESIGN.md, "Kernel primitive"): streaming (online
log-sum-exp) kernels over column tiles, O((N + M) * D) memory.

Same functions and signatures as :mod:`srot_fast.kernels.tensorized`:

- ``softmin(x, y, h, eps, p)``             -> (N,)    out_i = -eps * LSE_j[h_j - C(x_i, y_j) / eps]
- ``weighted_mean(x, y, h, eps, p, phi)``  -> (N, D)  sum_j softmax_j(h_j - C_ij / eps) * phi(x_i, y_j)
- ``plan_argmax(x, y, h, eps, p)``         -> (N,)    int64, argmax_j (h_j - C_ij / eps)
- ``max_cost(x, y, p)``                    -> ()      max_ij C(x_i, y_j)

with C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2). Batches: x (B, N, D), y (B, M, D), h (B, M) with one
``eps`` give (B, N), (B, N, D), (B, N), (B,) in one launch per kernel: the grid holds cdiv(N, BLOCK_N) row
blocks per problem and each program moves to its problem by the batch strides (points are read in place
when their coordinates are contiguous). Element offsets are 64-bit, so N * D, B * N * D and the outputs may
exceed 2^31 elements.

Modules (one idea each; :mod:`srot_fast.kernels.triton_softmin` re-exports the public names):

- :mod:`.tiles`: the ``@triton.jit`` tile helpers (rows of a program, columns of a tile, squared distances,
  logits, one online log-sum-exp step);
- :mod:`.kernels`: the ``@triton.jit`` kernels;
- :mod:`.autotune`: candidate block configurations, pruning, the CUDA-event timer, ``tuned_configs()``;
- :mod:`.launchers`: the ``*_fwd`` launchers (checks, path, block sizes, grid, allocation; keyword arguments),
  the dot precision from ``precision=`` or the environment, and the four primitives;
- :mod:`.options`: the run-time options ``precision`` and ``autotune`` (checked without importing triton),
  which :func:`srot_fast.sinkhorn` and :class:`srot_fast.SROTLoss` take as arguments and the geometry
  passes to every primitive as keyword arguments;
- :mod:`.blocksparse` and :mod:`.sparse_kernels`: the block-sparse primitives for d <= 3 (pruning in torch,
  ``@triton.jit`` kernels over the kept column blocks), which :mod:`srot_fast.kernels.blocksparse` calls for
  CUDA tensors.

Layers: ``_*_kernel`` (``@triton.jit``) -> ``*_fwd`` launchers (checks, path, block sizes, grid,
allocation; keyword arguments) -> the four primitives above. One program owns ``BLOCK_N`` rows of one
problem and streams the columns in tiles of ``BLOCK_M`` with a running max / rescaled sum per row, in base 2
(``exp2`` / ``log2``: the launchers pass h log2(e) and log2(e) / eps). D is a compile-time constant (one
compiled kernel per D). Two ways to form a tile of squared distances:

- *small-d path* (D < 32, and every D in float64): exact difference form, one coordinate at a time
  (unrolled for D <= 16). The softmin reads coordinate-major (B, D, N) views of x and y and has two tile
  orientations: (BLOCK_N, BLOCK_M) reduced over columns across threads, or transposed (BLOCK_M, BLOCK_N)
  where each thread owns a row and reduces its columns in registers (no warp shuffles);
- *large-d path* (float32 and half points, D >= 32, any D): |x|^2 + |y|^2 - 2 x.y with the cross term
  from ``tl.dot`` over chunks of ``BLOCK_K`` coordinates. Its ``input_precision`` for float32 points
  (``precision=`` on the launchers, else ``SROT_TRITON_DOT_PRECISION``, else "tf32x3", which falls back to
  "ieee" on GPUs without TF32 tensor cores):

  - "tf32x3" (the default): each operand split into a TF32 high part and a TF32 remainder, hi.hi + hi.lo +
    lo.hi on the tensor cores with fp32 accumulation: the accuracy of "ieee" (~2e-7 relative on squared
    distances), faster on GPUs with tensor cores;
  - "ieee": fp32 FMA on the CUDA cores;
  - "tf32" (opt-in, FlashSinkhorn's default): one tensor-core product of the operands rounded to TF32 (10
    stored significand bits). Squared distances carry relative errors up to about 3e-4 at D = 64, 8e-5 at
    D = 300 and 3e-5 at D = 3072 (median about 10x less; Gaussian and uniform data, CPU simulation of the
    TF32 rounding in tests/test_kernels.py), and a soft-min value moves by at most that fraction of the
    largest cost.

  float16 / bfloat16 points take "tf32" for x.y whatever the setting: their values are exact in TF32, so
  the products are exact and the sums float32. Float32 clouds are centred on their common mean first
  (half ones are not: see ``launchers._operands``); pairs closer than the rounding noise (relative
  2 sqrt(D) u) count as coincident (p = 1). For p = 2 the softmin folds the norms out of the pair loop:
  l_ij = (h_j - c |y_j|^2) + 2 c x_i.y_j, the row term -c |x_i|^2 added at the end (one FMA per pair
  after the dot).

``weighted_mean``: small-d path (D <= 64): one streaming pass with a (BLOCK_N, D) register accumulator and
broadcast products; float32 at 32 <= D <= 128: one pass with both x.y^T and w @ y by ``tl.dot`` (the
FlashAttention pattern); D > 128 (and float64 D > 64): two passes, the softmin gives each row's normaliser,
then a second kernel adds ``w @ y_tile`` chunk by chunk into the program's own rows of the (B, N, D) output
(``tl.dot`` in float32, broadcast products summed in registers in float64).
``eps`` travels as a tensor of the input dtype (a Python float would be specialised to float32).

Block sizes: on a GPU, the first launch of at least ``_TUNE_MIN_PAIRS`` (2^26) pairs (B * N * M) per
(kernel, D, p, path, phi, precision, dtype, size bucket of B, N and M) is autotuned among ``_CFG_DOT`` /
``_CFG_SMALL`` / ``_CFG_WMEAN_DOT`` / ``_CFG_WMEAN_SMALL`` (CUDA-event timing, no extra memory;
``autotune=False`` on a launcher, or ``SROT_TRITON_AUTOTUNE=0`` when that is not given, turns it off;
``tuned_configs()`` reports the choices); smaller launches, the interpreter and explicit block sizes use
fixed defaults.

Supported: float16, bfloat16, float32 and float64 points, any D for every primitive and launcher. Half
points are read as they are (no float32 copy: half the memory traffic of float32) and every tile is upcast
in registers: float32 arithmetic and accumulation, ``h`` float32 (a half ``h`` is upcast, O(M)), float32
results; the solver keeps float32 potentials. (The cpu, keops and tensorized backends compute half inputs
on float32 copies.)

Tests: tests/test_kernels.py and tests/test_batched_kernels.py (marker ``triton``) run under the CPU
interpreter (``TRITON_INTERPRET=1``) or on a GPU against the torch reference. The interpreter computes
``tl.dot`` with numpy in the input dtype, so it cannot show TF32: the GPU-only test
``test_triton_dot_path_is_fp32_accurate`` can. benchmarks/triton_aot_check.py compiles every configuration
for sm_90 without a GPU (shared memory, register spills).

Caution:
    - Large-d path: distances below the rounding noise of |x|^2 + |y|^2 - 2 x.y (relative 2 sqrt(D) u,
      e.g. 2.6e-5 of |x - c|^2 + |y - c|^2 at D = 12288 in float32) are set to 0 (p = 1 and every
      primitive but the p = 2 softmin, where the fold leaves them at their rounding value).
    - At D in the thousands the "ieee" softmin is slower than a dense cuBLAS cost matrix (without TF32);
      "tf32x3" closes the gap.
    - Autotuning compiles every candidate on the first large launch of each key (tens of seconds).
    - Inputs must live on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1`` set before triton is
      imported. Importing this package alone does not import triton; its modules do.
    - No autograd graph: outputs are plain tensors (the package uses the envelope theorem).
"""
