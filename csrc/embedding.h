#pragma once
#include <pybind11/pybind11.h>

namespace bert_fast {
// Registers the embedding + LayerNorm entry points of bert_fast._C (implemented in embedding_cpu.cpp):
//   embedding_fwd_cpu(params: dict), embedding_bwd_cpu(params: dict)
// (the CPU keep-mask of a seed is keep_mask_cpu.cpp's keep_mask_cpu)
// and, when compiled with CUDA (BERT_FAST_WITH_CUDA):
//   embedding_fwd_cuda(params), embedding_bwd_cuda(params), embedding_segment_sum_cuda(...),
//   dropout_mask_cuda(...).
// `params` maps the field names of EmbFwdParams / EmbBwdParams (embedding_common.h) to raw
// pointers (ints), sizes and flags; "stream" is the cudaStream_t handle as an int.
void bind_embedding(pybind11::module_& m);
}  // namespace bert_fast
