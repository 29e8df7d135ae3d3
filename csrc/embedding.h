#pragma once
#include <pybind11/pybind11.h>

namespace bert_fast {
// Registers the embedding + LayerNorm entry points (CPU always, CUDA when compiled with it).
void bind_embedding(pybind11::module_& m);
}  // namespace bert_fast
