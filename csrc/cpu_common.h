// Shared helpers of the CPU kernels: element types and their accumulation types.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <stdexcept>
#include <string>

#include "ops.h"

namespace bertdist {

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

// Calls f(T{}, A{}) with the element type of `t` and its accumulation type.
template <typename F>
void dispatch_cpu_dtype(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}, float{}); break;
    case DType::F64: f(double{}, double{}); break;
    case DType::F16: f(c10::Half{}, float{}); break;
    case DType::BF16: f(c10::BFloat16{}, float{}); break;
    default: throw std::runtime_error(std::string(op) + ": unsupported dtype");
  }
}

}  // namespace bertdist
