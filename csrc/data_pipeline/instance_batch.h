// The native half of data_pipeline/instance_batch.py's InstanceBatch: the ragged gather behind
// InstanceBatch.take (bound as _native_instances.gather_ragged).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "numpy_arrays.h"

namespace bertdist_instance_batch {

namespace py = pybind11;
using namespace bertdist_numpy;  // NOLINT

// InstanceBatch.take's hot loop: rows `rows` of the ragged column (values, offsets), in that
// order. One memcpy per row instead of numpy's per-element index arrays (arange + repeat +
// fancy index over every token); the shard writer gathers every row twice (bucket split, then
// sort by key). Twin of data_pipeline.instance_batch.reference_gather_ragged.
template <typename V>
py::tuple gather_typed(const py::array& values, const int64_t* offs, int64_t n_rows_in, const int64_t* rows,
                       int64_t n_rows) {
  const int64_t n_values = values.shape(0);
  std::vector<int64_t> out_offs(static_cast<size_t>(n_rows) + 1, 0);
  for (int64_t i = 0; i < n_rows; i++) {
    const int64_t r = rows[i];
    if (r < 0 || r >= n_rows_in)
      throw py::index_error("gather_ragged: rows[" + std::to_string(i) + "] = " + std::to_string(r) +
                            " is out of range for " + std::to_string(n_rows_in) + " rows");
    const int64_t a = offs[r], b = offs[r + 1];
    if (a < 0 || b < a || b > n_values)
      throw py::value_error("gather_ragged: offsets[" + std::to_string(r) + ":" + std::to_string(r + 2) + "] = (" +
                            std::to_string(a) + ", " + std::to_string(b) + ") do not lie in the " +
                            std::to_string(n_values) + " values");
    out_offs[i + 1] = out_offs[i] + (b - a);
  }
  py::array_t<V> out(static_cast<py::ssize_t>(out_offs.back()));
  const V* src = static_cast<const V*>(values.data());
  V* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < n_rows; i++) {
      const int64_t r = rows[i];
      std::copy(src + offs[r], src + offs[r + 1], dst + out_offs[i]);
    }
  }
  return py::make_tuple(std::move(out), to_numpy(std::move(out_offs)));
}

inline py::tuple gather_ragged(const py::array& values, const py::array& offsets, const py::array& rows) {
  check_array(values, "gather_ragged values", 1);
  check_array(offsets, "gather_ragged offsets", 1);
  check_array(rows, "gather_ragged rows", 1);
  if (!has_dtype<int64_t>(offsets))
    throw py::value_error("gather_ragged offsets: expected dtype int64, got " + dtype_name(offsets));
  if (!has_dtype<int64_t>(rows)) throw py::value_error("gather_ragged rows: expected dtype int64, got " + dtype_name(rows));
  if (offsets.shape(0) < 1) throw py::value_error("gather_ragged offsets: expected at least one entry (0 rows: [0])");
  const auto* offs = static_cast<const int64_t*>(offsets.data());
  const auto* r = static_cast<const int64_t*>(rows.data());
  const int64_t n_in = offsets.shape(0) - 1, n = rows.shape(0);
  if (has_dtype<uint16_t>(values)) return gather_typed<uint16_t>(values, offs, n_in, r, n);
  if (has_dtype<uint32_t>(values)) return gather_typed<uint32_t>(values, offs, n_in, r, n);
  if (has_dtype<int64_t>(values)) return gather_typed<int64_t>(values, offs, n_in, r, n);
  throw py::value_error("gather_ragged values: expected dtype uint16, uint32 or int64, got " + dtype_name(values));
}

}  // namespace bertdist_instance_batch
