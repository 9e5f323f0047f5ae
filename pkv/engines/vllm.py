"""vLLM's decode attention over the shared pages: the CUDA PagedAttention kernels (v1 / v2) of the
last release that ships them, and the current release's Triton unified attention.

Both are built from vLLM's own sources, fetched and pinned by pkv.engines.vllm_sources (no vLLM
install): ``python -m pkv.engines.vllm_sources fetch``.
"""

from __future__ import annotations

import torch

from pkv.engines.base import Engine, EnginePlan, EngineUnavailable, check_decode_inputs, upload_block_table

# vLLM's v2 kernel partitions each sequence into chunks of this many tokens.
PARTITION_SIZE = 512
# vLLM's _custom_ops defaults for the arguments the decode path never sets: no tensor-parallel
# rank offset, no block sparsity.
_TP_RANK, _BS_LOCAL_BLOCKS, _BS_VERT_STRIDE, _BS_BLOCK_SIZE, _BS_HEAD_SLIDING_STEP = 0, 0, 0, 64, 0

# vLLM's Triton backend (vllm/v1/attention/backends/triton_attn.py): the 2D kernel's launch grid
# should reach this many programs, else the split-KV (3D) kernel runs with this many segments.
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16
# What TritonAttentionBackend accepts (supports_block_size, supports_head_size): vLLM never runs
# the kernel on other pages or heads.
TRITON_BLOCK_SIZE_MULTIPLE = 16
TRITON_MIN_HEAD_SIZE = 32


def _cuda_device(device, what: str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise EngineUnavailable(f"{what} needs a CUDA device, got {device}")
    return device




class _ConvertedCache:
    """One layout conversion per KV tensor: the converted copies are kept while the same pages
    (pointer, shape, dtype) come back, so the conversion is untimed work of ``prepare``."""

    def __init__(self, convert) -> None:
        self._convert = convert
        self._key = None
        self._caches = None

    def __call__(self, k_pages, v_pages):
        key = (k_pages.data_ptr(), v_pages.data_ptr(), tuple(k_pages.shape), k_pages.dtype)
        if self._key != key:
            self._caches = None  # free the old copies before making new ones
            self._caches = self._convert(k_pages, v_pages)
            self._key = key
        return self._caches


def _paged_layout(k_pages, v_pages):
    # vLLM's PagedAttention: K [blocks, Hkv, d / x, P, x] (x = 16 bytes of elements), V [blocks, Hkv, d, P].
    blocks, heads, page, dim = k_pages.shape
    x = 16 // k_pages.element_size()
    key_cache = k_pages.reshape(blocks, heads, page, dim // x, x).permute(0, 1, 3, 2, 4)
    value_cache = v_pages.permute(0, 1, 3, 2)
    return key_cache.contiguous(), value_cache.contiguous()


def _triton_layout(k_pages, v_pages):
    # vLLM 0.34.0's Triton backend keeps one cache per layer, logically [blocks, Hkv, P, 2d] with a
    # token-head's K in the first d of the last axis and its V in the second (AttentionSpec's
    # state content, K then V), stored in the default layout LBNHC, i.e. physically
    # [blocks, P, Hkv, 2d]; TritonAttentionImpl.forward hands the kernel the two halves of
    # kv_cache.transpose(1, 2): [blocks, P, Hkv, d] views whose token-head stride is 2d, so each
    # head's V lies right after its K. Two separate NHD tensors would be read with other strides.
    blocks, heads, page, dim = k_pages.shape
    kv = torch.empty(blocks, page, heads, 2 * dim, dtype=k_pages.dtype, device=k_pages.device)
    kv[..., :dim].copy_(k_pages.permute(0, 2, 1, 3))
    kv[..., dim:].copy_(v_pages.permute(0, 2, 1, 3))
    return kv[..., :dim], kv[..., dim:]


class _VllmEngine(Engine):
    """What both vLLM rows share: vLLM's layout of the shared pages, made once per KV tensor
    (``self._convert``, in ``prepare``, untimed), and the inputs of a step checked against it."""

    _what: str  # the row's kernel, for error messages

    def prepare(self, step, q, k_pages, v_pages) -> None:
        self._convert(k_pages, v_pages)

    def _caches(self, q, k_pages, v_pages, plan: EnginePlan):
        """The step's inputs checked, then vLLM's (key, value) caches of these pages."""
        check_decode_inputs(q, k_pages, v_pages, self.shape, plan.step.page_size)
        # vLLM's kv_cache_dtype "auto": the cache holds the model's dtype, the query's (the paged
        # kernels reinterpret the cache as q's dtype; the Triton kernel would cast it).
        if q.dtype != k_pages.dtype:
            raise ValueError(f"{self._what} reads the pages in q's dtype {q.dtype} (kv_cache_dtype 'auto'), "
                             f"got {k_pages.dtype} pages")
        return self._convert(k_pages, v_pages)


class VllmEngine(_VllmEngine):
    """vLLM's paged decode, v1 or v2 chosen with vLLM's own rule for the step.

    The kernels are vLLM 0.22.1's csrc/attention/paged_attention_v{1,2}.cu, built here with the
    project's binding (pkv.engines.vllm_build). The adapter converts the shared HND pages into
    vLLM's layout once per KV tensor (in ``prepare``, untimed), keeping the same physical page
    ids, so vLLM reads the same pages through the same block tables as every other engine.
    """

    def __init__(self, shape, device="cuda") -> None:
        # Imported here, not at the top: pkv.engines imports this module, and `python -m
        # pkv.engines.vllm_build` (or vllm_sources) must not find its own module imported before it runs.
        from pkv.engines.vllm_sources import PAGED_ATTENTION, PAGED_NAME

        self.shape = shape
        self.device = _cuda_device(device, PAGED_NAME)
        from pkv.engines.vllm_build import BUILT_BLOCK_SIZES, BUILT_HEAD_SIZES, load_vllm_paged_attention

        if shape.head_dim not in BUILT_HEAD_SIZES:
            raise EngineUnavailable(f"{PAGED_NAME} has no kernel for head_dim {shape.head_dim}: the build "
                                    f"instantiates head sizes {BUILT_HEAD_SIZES} (pkv.engines.vllm_build.BUILT_HEAD_SIZES)")
        self._block_sizes = BUILT_BLOCK_SIZES
        self._ops = load_vllm_paged_attention()
        self.name = "vllm"
        self._what = PAGED_NAME
        # v1 or v2 per step, by vLLM's rule (run), so the name is of both.
        self.implementation = f"vllm-{PAGED_ATTENTION.version}-paged_attention_v1_v2-own-build"
        self._convert = _ConvertedCache(_paged_layout)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)

    def plan(self, step) -> EnginePlan:
        if step.page_size not in self._block_sizes:
            raise EngineUnavailable(f"{self._what} has no kernel for page_size {step.page_size}: the build "
                                    f"instantiates block sizes {self._block_sizes} "
                                    f"(pkv.engines.vllm_build.BUILT_BLOCK_SIZES)")
        tensors, max_seq_len = upload_block_table(step, self.device)
        return EnginePlan(route="vllm", step=step, tensors=tensors, extra={"max_seq_len": max_seq_len})

    def run(self, q, k_pages, v_pages, plan: EnginePlan):
        key_cache, value_cache = self._caches(q, k_pages, v_pages, plan)
        # The kernels take q's row stride alone (q + row * stride(0) + head * head_size) and write
        # out as packed [B, Hq, d]: a strided head axis would be misread.
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            raise ValueError(f"{self._what} needs q's heads packed, got strides {tuple(q.stride())}")
        shape = self.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        batch = q.shape[0]
        max_seq_len = plan.extra["max_seq_len"]
        partitions = -(-max_seq_len // PARTITION_SIZE)
        common = (shape.num_kv_heads, shape.sm_scale, plan.tensors["block_table"], plan.tensors["seq_lens"],
                  plan.step.page_size, max_seq_len, None, "auto", self._one, self._one, _TP_RANK,
                  _BS_LOCAL_BLOCKS, _BS_VERT_STRIDE, _BS_BLOCK_SIZE, _BS_HEAD_SLIDING_STEP)
        # vLLM's own dispatch rule between the single-pass and the partitioned kernel.
        if max_seq_len <= 8192 and (partitions == 1 or batch * shape.num_qo_heads > 512):
            self._ops.paged_attention_v1(out, q, key_cache, value_cache, *common)
        else:
            exp_sums = torch.empty(batch, shape.num_qo_heads, partitions, dtype=torch.float32,
                                   device=self.device)
            max_logits = torch.empty_like(exp_sums)
            tmp_out = torch.empty(batch, shape.num_qo_heads, partitions, shape.head_dim,
                                  dtype=q.dtype, device=self.device)
            self._ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, q, key_cache,
                                         value_cache, *common)
        return out


class VllmTritonEngine(_VllmEngine):
    """vLLM's Triton unified attention (the current release's decode path on every GPU), called as
    vLLM's Triton backend calls it for a decode batch: one query token per sequence as a ragged
    batch (cu_seqlens_q = 0..B), causal, no window, no softcap, the split-KV (3D) kernel below
    vLLM's batch threshold with vLLM's 16 segments. The shared HND pages are converted to the
    backend's page (K and V of a token-head side by side, NHD) once per KV tensor (in
    ``prepare``, untimed), keeping the physical page ids.
    """

    def __init__(self, shape, device="cuda") -> None:
        from pkv.engines.vllm_sources import TRITON_ATTENTION, TRITON_NAME

        self.shape = shape
        self.device = _cuda_device(device, TRITON_NAME)
        from pkv.engines.vllm_build import load_vllm_triton_unified_attention

        if shape.head_dim < TRITON_MIN_HEAD_SIZE:
            raise EngineUnavailable(f"{TRITON_NAME} takes head_dim >= {TRITON_MIN_HEAD_SIZE} "
                                    f"(vLLM {TRITON_ATTENTION.version}'s Triton backend), got {shape.head_dim}")
        self._version = TRITON_ATTENTION.version
        self._attention = load_vllm_triton_unified_attention()
        self.name = "vllm_triton"
        self._what = TRITON_NAME
        self.implementation = f"vllm-{TRITON_ATTENTION.version}-triton_unified_attention"
        self._convert = _ConvertedCache(_triton_layout)
        # As vLLM's TritonAttentionMetadataBuilder sizes them: one scratch row per sequence up to
        # the threshold, the head size padded to a power of two.
        self._seq_threshold_3d = MIN_LAUNCH_GRID_SIZE_2D // shape.num_kv_heads
        rows = max(self._seq_threshold_3d, 1)
        padded = 1 << (shape.head_dim - 1).bit_length()
        self._segm_output = torch.empty(rows, shape.num_qo_heads, NUM_PAR_SOFTMAX_SEGMENTS, padded,
                                        dtype=torch.float32, device=self.device)
        self._segm_max = torch.empty(rows, shape.num_qo_heads, NUM_PAR_SOFTMAX_SEGMENTS,
                                     dtype=torch.float32, device=self.device)
        self._segm_expsum = torch.empty_like(self._segm_max)
        self._one = torch.ones(1, dtype=torch.float32, device=self.device)

    def plan(self, step) -> EnginePlan:
        if step.page_size % TRITON_BLOCK_SIZE_MULTIPLE:
            raise EngineUnavailable(f"{self._what} takes page sizes that are multiples of "
                                    f"{TRITON_BLOCK_SIZE_MULTIPLE} (vLLM {self._version}'s Triton backend), "
                                    f"got {step.page_size}")
        tensors, max_seq_len = upload_block_table(step, self.device)
        batch = len(step.seq_lens)
        tensors["cu_seqlens_q"] = torch.arange(batch + 1, dtype=torch.int32, device=self.device)
        # vLLM expands its per-layer scales to [num_seqs, Hkv] (unquantized KV reads them as 1).
        tensors["descale"] = self._one.expand(batch, self.shape.num_kv_heads)
        return EnginePlan(route="vllm_triton", step=step, tensors=tensors, extra={"max_seq_len": max_seq_len})

    def run(self, q, k_pages, v_pages, plan: EnginePlan):
        key_cache, value_cache = self._caches(q, k_pages, v_pages, plan)
        out = torch.empty_like(q)
        tensors = plan.tensors
        self._attention(
            q=q, k=key_cache, v=value_cache, out=out,
            cu_seqlens_q=tensors["cu_seqlens_q"], max_seqlen_q=1,
            seqused_k=tensors["seq_lens"], max_seqlen_k=plan.extra["max_seq_len"],
            softmax_scale=self.shape.sm_scale, causal=True, window_size=(-1, -1),
            block_table=tensors["block_table"], softcap=0,
            q_descale=None, k_descale=tensors["descale"], v_descale=tensors["descale"],
            seq_threshold_3D=self._seq_threshold_3d, num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS,
            softmax_segm_output=self._segm_output, softmax_segm_max=self._segm_max,
            softmax_segm_expsum=self._segm_expsum,
        )
        return out
