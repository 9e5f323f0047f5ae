// Stand-in for <ATen/cuda/CUDAContext.h>, found first on the include path of vLLM's
// paged_attention_v{1,2}.cu only (pkv.engines.vllm_sources puts this folder before torch's).
//
// Why: torch's CUDAContext.h pulls in cuBLAS, cuSPARSE and cuSOLVER headers (CUDAContextLight.h,
// Exceptions.h), which a minimal CUDA toolkit does not ship, while vLLM's attention kernels use
// from it only the current stream (at::cuda::getCurrentCUDAStream) and the device guard
// (at::cuda::OptionalCUDAGuard, from c10/cuda/CUDAGuard.h, which vLLM includes itself). Both live
// in c10: torch's c10/macros/Macros.h makes c10::cuda visible as at::cuda.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
